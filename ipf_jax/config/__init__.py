"""From a config to a run's parts: the schema with every field's default and meaning (``defaults``), the
checks that reject a config before anything compiles, each naming the field and a value that works, and the
resolution of the mode into the step's ``ParticleSpec`` (``validation``); and ``builder.build``, which turns a
config, a task and an example batch into the mesh, schedule, optimizer, state initialiser and jitted steps
that the library and the trainer use."""
