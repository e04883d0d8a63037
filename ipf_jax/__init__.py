"""ipf-jax: IPF-DDP, data-parallel training of a weighted particle population in JAX."""

__version__ = "0.1.0"
