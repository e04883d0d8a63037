"""The population's mathematics (docs/DESIGN.md §3-§5), written for arrays and collectives over a named axis,
with no mesh, model or config: importance weights and their normalisation, the effective sample size,
systematic resampling and the assignment of copies to slots (``particle_filter``), the exchange that moves
resampled particles between devices (``exchange``), the weighted global correction (``correction``), its
int8 compression (``compression``) and the named random streams of a step (``streams``). Everything here is
checked against plain numpy loops in ``tests/test_filter.py`` and ``tests/test_exchange.py``."""
