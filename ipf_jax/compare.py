"""``python -m ipf_jax.compare``: DDP, a deep ensemble and ipf at equal compute, one table and one picture
(``ipf_jax/runtime/compare.py``)."""

from ipf_jax.runtime import compare

if __name__ == "__main__":
  compare.run()
