"""What a run leaves for people and other programs: the per-step TensorBoard scalars (``summary``), the final
evaluation as text (``tables``), the fused model as plain Flax files and ``load_fused`` (``export``), and the
pictures drawn from a workdir's event files, ``python -m ipf_jax.reporting WORKDIR`` (``report``). Reads
results; trains and evaluates nothing."""


def main(argv=None):
  """``python -m ipf_jax.reporting WORKDIR``: ``report.main`` (matplotlib is imported only then)."""
  from ipf_jax.reporting import report

  return report.main(argv)
