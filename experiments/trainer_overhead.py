"""How much of a training step is the trainer's own loop: the `Trainer`'s logged step time against the same
compiled step run bare, for a small model where host work is not hidden behind a long device step.

    python -m experiments.trainer_overhead            # GPU: the quality-parity model at 16k tokens (~2 min)
    python -m experiments.trainer_overhead --quick    # CPU: tiny sizes, proves the script works

Setup: experiments/training.py's "shapes" study (hidden 256 x 4 blocks, one bucket of 16 x 64 x 64 latents =
16k tokens at patch 1x2x2, 2 samples a step), full attention, no evaluation, no checkpoint inside the timed
steps. Measured:
  trainer     `Trainer.run()` for --steps steps, the logged step_time (log windows of 10 steps; the first
              window, with the warm-up, left out): what a user's run gets, data loading, the per-step guard
              check and the host's bookkeeping included
  blocked     the same compiled step (the trainer's own executable) on one batch, blocked on after each step
  pipelined   the same, --steps steps dispatched back to back and blocked on once: the device's rate
Writes experiments/results/trainer_overhead.json (--quick: *_quick.json, git-ignored).
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from dsv_jax.config import get_config
from dsv_jax.train.trainer import Trainer
from experiments import harness
from experiments.training import run_steps, study_overrides


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU, tiny sizes")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default 150; quick 30)")
    args = p.parse_args(argv)
    steps = args.steps or (30 if args.quick else 150)
    tokens = 256 if args.quick else 16384
    cfg = get_config(
        "tiny",
        study_overrides("shapes", tokens, quick=args.quick)
        + [
            f"train.steps={steps}",
            "train.log_every=10",
            "train.eval_every=0",
            f"train.ckpt_every={10 * steps}",
            "train.sample_at_end=false",
            "train.warmup_steps=5",
        ],
    )
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(cfg, workdir, progress=False)
        records = [r for r in trainer.run() if "loss" in r]
        shape = trainer.feed.shapes[0]
        exe = trainer.compiled_step(shape)
        batch = trainer.to_global(trainer.feed.batch_at(0, shape))
        lr = np.float32(1e-4)
        state, blocked = run_steps(exe, trainer.state, (batch, lr), 20)
        t0 = time.perf_counter()
        for _ in range(steps):
            state, metrics = exe(state, batch, lr)
        jax.block_until_ready((state, metrics))
        pipelined = (time.perf_counter() - t0) / steps
        trainer.state = state
        trainer.close()
    logged = [r["step_time"] for r in records if r["step"] > 10 and r["step"] % 10 == 0]  # one per log window
    out = {
        "model": "shapes study (hidden 256 x 4 blocks)",
        "tokens_per_sample": tokens,
        "batch": records[-1]["batch"],
        "steps": steps,
        "trainer_step_s": statistics.median(logged),
        "trainer_step_s_windows": logged,
        "blocked_step_s": blocked.median_s,
        "pipelined_step_s": pipelined,
    }
    out["trainer_over_pipelined"] = out["trainer_step_s"] / pipelined
    out["blocked_over_pipelined"] = blocked.median_s / pipelined
    path = harness.write_results("trainer_overhead" + ("_quick" if args.quick else ""), out)
    harness.print_table(
        [
            {
                "trainer_ms": 1e3 * out["trainer_step_s"],
                "blocked_ms": 1e3 * blocked.median_s,
                "pipelined_ms": 1e3 * pipelined,
                "trainer/pipelined": out["trainer_over_pipelined"],
            }
        ],
        ["trainer_ms", "blocked_ms", "pipelined_ms", "trainer/pipelined"],
    )
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
