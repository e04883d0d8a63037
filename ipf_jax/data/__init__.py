"""The input (docs/DESIGN.md §8): datasets as host-side iterators of numpy batches with an epoch and a position,
so a resumed run reads on from where it stopped (``ipf_jax.config.read.dataset`` opens the one a config names).
``digits`` is embedded (scikit-learn); the others are read with TFDS from a data folder and must have been prepared
there (``fashion_mnist`` from Debian's files: ``python -m ipf_jax.data.prepare fashion_mnist``). Also the
user's own arrays (``ArrayDataset``) or batch functions (``Data``), and the shifted and OOD evaluation sets.
Knows nothing of the mesh: ``ipf_jax.spmd.layout`` places a batch on it.
"""

from __future__ import annotations

TFDS_DATASETS = ("imagenet2012", "cifar10", "cifar100", "fashion_mnist")
DATASETS = ("digits",) + TFDS_DATASETS
