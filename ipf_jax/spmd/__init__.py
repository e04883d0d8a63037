"""The SPMD program (docs/DESIGN.md §2, §4, §6-§9): the ``(particle, data)`` mesh and the batch layout on it,
the sharded state, one particle's task (model, loss, metrics; Linen or NNX) looped over a device's local
particles, the optimizer, and the jitted ``shard_map`` programs built from them: the train step (gradients,
weights, resampling and exchange, correction, commit), the eval step and the fused model. Takes a
``ParticleSpec`` (``spec``), never a config; the population maths it calls are ``ipf_jax.population``'s."""
