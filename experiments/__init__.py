"""Benchmarks and studies of dsv-jax; run each from the repository root as `python -m experiments.NAME`.

Shared pieces: experiments/harness.py (timing, budgets, inputs, train steps, results files) and
experiments/quick_cpu.py (the CPU set-up of --quick runs). Results: experiments/results/.
"""

import time

# The wall clock when this package was imported: for `python -m experiments.NAME`, the start of the process,
# from which the scripts' time budgets (harness.Budget) count.
STARTED = time.time()
