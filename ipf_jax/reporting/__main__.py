"""``python -m ipf_jax.reporting WORKDIR [--out DIR]``: the pictures of a run (``ipf_jax.reporting.report``)."""

from ipf_jax.reporting import main

if __name__ == "__main__":
  main()
