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

What DSV adds when every block is dense (--dsv; issue 38, "DSV never costs more than it saves"):

    python -m experiments.trainer_overhead --dsv --baseline-steps 100   # GPU: the 16k photos setup (~4-5 min)
    python -m experiments.trainer_overhead --dsv --preset tiny   # the tiny preset as it is (CPU: 10-15 min)
    python -m experiments.trainer_overhead --dsv --quick         # CPU, tiny sizes, proves the script works

Arms, each a `Trainer` on the same batches (same data seed), run in interleaved rounds of --round steps:
  full            full attention (cuDNN on a GPU)
  dsv             DSV in stage 2 with every block dense (dsv.threshold=0.99: nothing goes sparse), its
                  back-off at the steady state (profiles dsv.backoff_max_every apart, the predictor on every
                  stage2_predictor_every * 2**level-th step; the first profile of each bucket half a cycle
                  in), for whole cycles of dsv.backoff_max_every steps: the amortised cost of that schedule
  dsv_no_backoff  the same with dsv.backoff_max_every=0: the schedule before the back-off (the predictor on
                  every 4th step, a profile every dsv.profile_every), for whole periods of it
Measured: each arm's mean step time over its rounds (the trainer's logged step_time: host work, the
predictor's and the profiles' steps and the profiles' host sync included), its ratio to full attention (all
rounds, and per round against the full round beside it: the spread), the trainer's own end-of-run DSV
summary, and the compiled steps alone (blocked, interleaved, largest bucket): full, DSV without predictor or
profile ("plain"), with the predictor ("predictor", stage 2's rows), and a profile step ("profile"), from which
`model` estimates each schedule's ratio (its counted step kinds x these times; without the profiles' host sync).
Also the process CPU time of each round and compiled step (`cpu_*`): on a shared CPU, where other programs
slow the wall clock by tens of percent from one minute to the next, the CPU time is the steadier measure.
Writes experiments/results/dsv_overhead_<setup>_<device>.json (--quick: dsv_overhead_quick.json, git-ignored).
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import math
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv_jax.config import get_config
from dsv_jax.dsv.controller import shape_key
from dsv_jax.train.metrics import read_metrics
from dsv_jax.train.trainer import Trainer
from experiments import harness
from experiments.training import run_steps, study_overrides


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU, tiny sizes")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default 150; quick 30)")
    p.add_argument("--dsv", action="store_true", help="DSV with every block dense against full attention")
    p.add_argument(
        "--preset",
        choices=["photos", "tiny"],
        default="photos",
        help="--dsv: the 16k photos setup of the quality-parity run, or the tiny preset as configured",
    )
    p.add_argument("--round", type=int, help="--dsv: steps per round (default 100; tiny 50; quick 8)")
    p.add_argument("--cycles", type=int, default=1, help="--dsv: back-off cycles (dsv.backoff_max_every steps)")
    p.add_argument("--bare", type=int, help="--dsv: timed calls per compiled step (default 10; quick 2)")
    p.add_argument(
        "--baseline-steps",
        type=int,
        help="--dsv: steps of the arm without the back-off, rounded up to whole periods of its schedule "
        "(default: half the DSV arm's)",
    )
    args = p.parse_args(argv)
    if args.dsv:
        return dsv_main(args)
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


# -- --dsv: what DSV adds when every block is dense ------------------------------------------------------

# the quality-parity photos run's DSV settings (experiments/results/RESULTS.md, "Quality parity", its photos runs)
PHOTOS_DSV = ["dsv.profile_every=50", "dsv.recall_target=0.95", "dsv.predictor_lr=0.0005"]


def dsv_arms(args) -> dict[str, list[str]]:
    """Config overrides of each arm (see the module docstring) on the tiny preset."""
    steps = args.cycles * 10_000 + 1  # never reached: no end-of-run evaluation
    train = [
        f"train.steps={steps}",
        "train.log_every=10",
        "train.eval_every=0",
        f"train.ckpt_every={steps}",
        "train.sample_at_end=false",
        "train.warmup_steps=5",
    ]
    if args.quick:
        setup = study_overrides("photos", 256, quick=True) + ["dsv.profile_every=4", "dsv.backoff_max_every=16"]
    elif args.preset == "tiny":
        setup = []
    else:
        setup = study_overrides("photos", 16384, quick=False) + ["train.lr=0.0005"] + PHOTOS_DSV
    dsv = ["attention=dsv", "dsv.threshold=0.99"]
    return {
        "full": setup + train,
        "dsv": setup + train + dsv,
        "dsv_no_backoff": setup + train + dsv + ["dsv.backoff_max_every=0"],
    }


def dense_stage2(ctl, shapes, backed_off: bool) -> None:
    """Put a DSV controller in stage 2 with every block of every bucket in `shapes` dense: at the steady state
    of its back-off (the next profile of each bucket half a cycle in), or at the start of stage 2."""
    level = ctl.max_backoff if backed_off else 0
    every = min(ctl.dsv.profile_every << level, max(ctl.dsv.backoff_max_every, ctl.dsv.profile_every))
    state = ctl.state_dict()
    state.update(stage=2, switch_step=0, loss_ema=0.0)
    state["shapes"] = {
        shape_key(shape): {
            "sparsity": np.zeros((ctl.depth, ctl.heads)).tolist(),
            "rungs": [0.0] * ctl.depth,
            "profiles": 1,
            "backoff": level,
            "last_profile": every // 2 - every if backed_off else None,
        }
        for shape in shapes
    }
    ctl.load_state_dict(state)


def _time_bare(executables: dict, reps: int) -> dict:
    """Each compiled step (name -> (exe, state, args)) called `reps` times, blocked on, interleaved: wall and
    process CPU seconds per call (on a shared CPU the CPU time is the steadier measure of the work)."""
    wall, cpu = {name: [] for name in executables}, {name: [] for name in executables}
    states = {name: state for name, (_, state, _) in executables.items()}
    for rep in range(reps + 1):  # the first round warms up
        for name, (exe, _, args) in executables.items():
            t0, c0 = time.perf_counter(), time.process_time()
            states[name], metrics = exe(states[name], *args)
            jax.block_until_ready((states[name], metrics))
            if rep:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    return {
        name: {
            "median_s": statistics.median(t),
            "min_s": min(t),
            "max_s": max(t),
            "times_s": t,
            "cpu_median_s": statistics.median(cpu[name]),
            "cpu_times_s": cpu[name],
        }
        for name, t in wall.items()
    }


def _bare_steps(trainers: dict, reps: int) -> dict:
    """The compiled steps of full attention and of DSV's three kinds on the largest bucket, each on a copy of
    its trainer's state (the trainers' own states are not advanced)."""
    full, dsv = trainers["full"], trainers["dsv"]
    shape = max(dsv.feed.shapes, key=math.prod)
    batch = dsv.to_global(dsv.feed.batch_at(0, shape))
    lr = np.float32(1e-4)
    ctl = dsv.controller
    step_plain = next(s for s in range(1, 10_000) if not ctl.trains_predictor(s, False, shape))
    variants = {
        "plain": ctl.plans(shape, step=step_plain),
        "predictor": ctl.plans(shape, step=0),
        "profile": ctl.plans(shape, profile=True, step=0),
    }
    inputs = ctl.inputs(shape)
    copy = lambda state: jax.tree.map(jnp.copy, state)
    exes = {"full": (full.compiled_step(shape), copy(full.state), (batch, lr))}
    for name, plans in variants.items():
        exes[name] = (dsv.compiled_step(shape, plans), copy(dsv.state), (batch, lr, inputs))
    out = _time_bare(exes, reps)
    for name, (exe, _, _) in exes.items():  # what XLA counts in each program (a scanned block once)
        cost = exe.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict per device
        out[name].update(
            flops=float(cost.get("flops", np.nan)), bytes_accessed=float(cost.get("bytes accessed", np.nan))
        )
    return {"shape": list(shape), **out}


def _paired(per_round: dict, arm: str) -> float:
    """An arm's time over its rounds / full attention's over the same rounds (the same steps)."""
    n = len(per_round[arm])
    return float(np.sum(per_round[arm]) / np.sum(per_round["full"][:n]))


def _kinds(records) -> dict[str, int]:
    n = {"plain": 0, "predictor": 0, "profile": 0}
    for r in records:
        n["profile" if r.get("dsv/profile_step") else "predictor" if r.get("dsv/predictor_step") else "plain"] += 1
    return n


def dsv_main(args) -> int:
    quick = args.quick
    n_round = args.round or (8 if quick else 50 if args.preset == "tiny" else 100)
    reps = args.bare or (2 if quick else 10)
    arms = dsv_arms(args)
    setup = "quick" if quick else args.preset
    trainers, rounds, records, workdirs = {}, {a: [] for a in arms}, {a: [] for a in arms}, {}
    cpu = {a: [] for a in arms}  # process CPU seconds per step of each round (the whole run() call)
    with tempfile.TemporaryDirectory() as root:
        for name, overrides in arms.items():
            workdirs[name] = f"{root}/{name}"
            trainer = Trainer(get_config("tiny", overrides), workdirs[name], progress=False)
            trainer.save = lambda data_state: None  # no checkpoints: not what this measures
            if trainer.controller is not None:
                dense_stage2(trainer.controller, trainer.feed.shapes, backed_off=name == "dsv")
            trainers[name] = trainer
        ctl = trainers["dsv"].controller
        # the steady state's period: the back-off's cycle; before the back-off, profile_every x the predictor's
        cycle = max(ctl.dsv.backoff_max_every, ctl.dsv.profile_every)
        period = math.lcm(ctl.dsv.profile_every, ctl.dsv.stage2_predictor_every)
        total = {"full": cycle * args.cycles, "dsv": cycle * args.cycles}
        # whole periods of the old schedule: --baseline-steps or half the DSV arm's steps, rounded up
        total["dsv_no_backoff"] = period * math.ceil((args.baseline_steps or total["dsv"] / 2) / period)
        print(f"steps per arm: {total}, rounds of {n_round}", flush=True)
        for trainer in trainers.values():  # compile every variant before anything is timed
            trainer.precompile()
        bare = _bare_steps(trainers, reps)
        done = dict.fromkeys(arms, 0)
        while any(done[a] < total[a] for a in arms):
            for name, trainer in trainers.items():
                if done[name] >= total[name]:
                    continue
                stop = done[name] + min(n_round, total[name] - done[name])
                c0 = time.process_time()
                recs = [r for r in trainer.run(stop_at=stop) if "loss" in r]
                cpu[name].append((time.process_time() - c0) / len(recs))
                rounds[name].append(float(np.mean([r["step_time"] for r in recs])))
                records[name] += recs
                done[name] = stop
                print(f"  {name} to step {stop}: {1e3 * rounds[name][-1]:.1f} ms/step", flush=True)
        summary = next((r["dsv/summary"] for r in reversed(read_metrics(workdirs["dsv"])) if "dsv/summary" in r), None)
        for trainer in trainers.values():
            trainer.close()
    full_ref = trainers["full"]
    mean = {a: float(np.mean([r["step_time"] for r in records[a]])) for a in arms}
    out = {
        "setup": setup,
        "config_overrides": arms,
        "buckets": [list(s) for s in full_ref.feed.shapes],
        "batch": {"x".join(map(str, s)): full_ref.feed.batch_size(s) for s in full_ref.feed.shapes},
        "round_steps": n_round,
        "steps": {a: len(records[a]) for a in arms},
        "step_kinds": {a: _kinds(records[a]) for a in arms if a != "full"},
        "round_mean_step_s": rounds,
        "mean_step_s": mean,
        # against full attention's rounds over the same steps (the same batches): all of them, and each round
        # against the full round run just before it
        "ratio_to_full": {a: _paired(rounds, a) for a in arms if a != "full"},
        "round_ratios": {a: [x / f for x, f in zip(rounds[a], rounds["full"])] for a in arms if a != "full"},
        # process CPU time per step of each round (a GPU: the host's work only; a CPU: the work itself)
        "round_cpu_step_s": cpu,
        "cpu_ratio_to_full": {a: _paired(cpu, a) for a in arms if a != "full"},
        "round_cpu_ratios": {a: [x / f for x, f in zip(cpu[a], cpu["full"])] for a in arms if a != "full"},
        "bare": bare,
        "dsv_summary": summary,
    }
    for key, field in (("model", "median_s"), ("model_cpu", "cpu_median_s")):
        t = {k: bare[k][field] for k in ("full", "plain", "predictor", "profile")}
        out[key] = {
            a: sum(n * t[k] for k, n in kinds.items()) / (sum(kinds.values()) * t["full"])
            for a, kinds in out["step_kinds"].items()
        }
    device = "gpu" if harness.on_gpu() else "cpu"
    name = "dsv_overhead_quick" if quick else f"dsv_overhead_{'photos16k' if setup == 'photos' else setup}_{device}"
    path = harness.write_results(name, out)
    harness.print_table(
        [
            {
                "arm": a,
                "ms/step": 1e3 * mean[a],
                "x full": mean[a] / mean["full"],
                "rounds x full": " ".join(f"{x:.3f}" for x in out["round_ratios"].get(a, [])),
                "model x full": out["model"].get(a, 1.0),
                "cpu x full": out["cpu_ratio_to_full"].get(a, 1.0),
                "cpu rounds x full": " ".join(f"{x:.3f}" for x in out["round_cpu_ratios"].get(a, [])),
                "cpu model x full": out["model_cpu"].get(a, 1.0),
            }
            for a in arms
        ],
        [
            "arm",
            "ms/step",
            "x full",
            "rounds x full",
            "model x full",
            "cpu x full",
            "cpu rounds x full",
            "cpu model x full",
        ],
    )
    harness.print_table(
        [
            {
                "step": k,
                "median_ms": 1e3 * v["median_s"],
                "min_ms": 1e3 * v["min_s"],
                "max_ms": 1e3 * v["max_s"],
                "cpu_median_ms": 1e3 * v["cpu_median_s"],
            }
            for k, v in bare.items()
            if k != "shape"
        ],
        ["step", "median_ms", "min_ms", "max_ms", "cpu_median_ms"],
    )
    print(summary)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
