"""What an evaluation measures, as sums that add over batches, devices and processes and are finished on the
host: accuracy, NLL, ECE, Brier, selective prediction, OOD AUROC, diversity, Gaussian-regression scores
(``metrics``); and what is derived from finished results: the table's rows, a shifted set's brief results,
temperature scaling fitted on a held-out set (``results``). No mesh, no model: the eval step that produces
the sums is in ``ipf_jax.spmd.eval_step``."""
