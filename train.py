"""Train a particle population with IPF-DDP (the same command as ``ipf-train``; see ``ipf_jax/runtime/cli.py``).

  python train.py --config configs/digits.py                         # ipf, into runs/digits_ipf_qsr
  python train.py --config configs/digits.py --config.mode=ddp       # plain DDP, into runs/digits_ddp
  python train.py --config configs/digits.py --config.mode=ensemble  # deep ensemble, into runs/digits_ensemble

Exit codes: 0 finished; 1 error (one line "error: ..."); 2 bad command line;
69 a peer process did not start or was lost; 75 stopped at
config.time_limit_minutes; 130 stopped by SIGINT; 143 stopped by SIGTERM or a
preemption notice (multi-process runs: any signal). After 75, 130 and 143 a checkpoint is saved: rerun the same
command to resume.
"""

from ipf_jax.runtime import cli

if __name__ == "__main__":
  cli.run()
