"""The errors a user's input gets: each names what is wrong and how to fix it."""

from __future__ import annotations


class ConfigError(ValueError):
  """A config value that cannot work; the message names the field and the fix."""

  def __init__(self, field: str, message: str):
    super().__init__(f"config.{field}: {message}")
    self.field = field
