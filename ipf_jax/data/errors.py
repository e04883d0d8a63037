"""Errors of the input pipeline (importable without TensorFlow)."""


class DataError(RuntimeError):
  """A dataset that cannot be read; the message says which, where, and how to prepare it."""
