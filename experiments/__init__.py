"""Benchmarks and studies of dsv-jax; run each from the repository root as `python -m experiments.NAME`.

Shared pieces: experiments/harness.py (timing, time budgets, random inputs, error text, results files, tables,
plots, a measurement in a child process), experiments/training.py (train steps and the studies' setups) and
experiments/quick_cpu.py (the CPU set-up of --quick runs). Results: experiments/results/.
"""

import time

# The wall clock when this package was imported: for `python -m experiments.NAME`, the start of the process,
# from which the scripts' time budgets (harness.Budget) count.
STARTED = time.time()
