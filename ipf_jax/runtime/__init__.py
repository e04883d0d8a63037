"""The run-time around the jitted steps (docs/DESIGN.md §7): the training loop with its logging, evaluation
and ETA (``trainer``, ``run_eval``), checkpoints that survive preemption, crashes and full disks
(``checkpoint``, ``compatibility``, ``quiet``), signals and time limits (``preemption``), the multi-process
start-up and peer watch (``cluster``), the workdir and its lock (``workdir``) and the ``train.py`` command
line (``cli``). Everything that touches the filesystem, signals or other processes is here."""
