"""Quality studies: what the methods reach on real data (Fashion-MNIST, digits), fine-tuning, robustness to
faults and divergence. Speed, memory and scale are ``benchmarks/``; their shared helpers are
``benchmarks.common``. Each study's command and measured table are in BENCHMARKS.md or docs/RUNNING.md."""
