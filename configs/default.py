"""Every field with its default and meaning: ``ipf_jax/config/defaults.py`` (the library's schema).

python train.py --config configs/default.py   # the defaults as they are
"""

from ipf_jax.config.defaults import get_config  # noqa: F401
