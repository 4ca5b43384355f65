"""Sparsity emergence (issue 17): does attention become sparse as a model learns real pictures, and as the
sequence grows? Keep ratios that hold 90% / 95% of the attention mass, per block and head, over training,
at several sequence lengths.

    # one H200 in one 10-minute call (jax 0.11.2): 16k and 32k tokens, 500 steps in rounds of 100; stops
    # cleanly at the budget (checkpoint, JSON, plots; also copied to $OUT):
    python -m experiments.sparsity_emergence --workdir runs/emergence --budget-s 540
    # a later call on the same machine continues from the checkpoints and records in runs/emergence, e.g.
    # more steps, or 64k tokens (its own run; the JSON keeps every S and fits at the last common step):
    python -m experiments.sparsity_emergence --workdir runs/emergence --steps 1000 --budget-s 540
    python -m experiments.sparsity_emergence --workdir runs/emergence --tokens 65536 --steps 200 \
        --budget-s 540
    # one S trained longer, in its own results file (sparsity_emergence_16k_long.json):
    python -m experiments.sparsity_emergence --workdir runs/emergence16 --tokens 16384 --steps 1500 \
        --every 250 --budget-s 490 --name sparsity_emergence_16k_long
    # CPU, tiny sizes (~25 s of CPU with warm compile caches, ~90 s cold; the CI test):
    python -m experiments.sparsity_emergence --quick

GPU time per step (measured on one H200): 0.24 s at 16k (2 samples), 0.37 s at 32k (1 sample), 1.24 s at
64k; a measurement 3-10 s; two train-step compiles
(with and without profiling) and one analysis compile per S; a checkpoint per round and S.

Setup (experiments/training.py, shared with quality_parity.py --setup photos): data.source=photos (real
photographs under camera pans and zooms, cut-out objects moving over them; data/photos.py) at one bucket
per sequence length S: 16 x 64 x 64 (S = 16k tokens at patch 1x2x2), 16 x 64 x 128 (32k),
16 x 128 x 128 (64k); a DiT of 8 blocks x 12 heads x 64 (hidden 768, 109M parameters), 3D tiles of
4 x 4 x 4 = 64 tokens; equal tokens per step (--tokens-per-batch 32768: 2 samples at 16k, 1 above),
AdamW at --lr with a short warm-up and cosine decay over --steps, bf16, remat.

One run per S, trained in rounds of --every steps (all S advance together, so a budget stop leaves
them at the same step). Each run is attention=dsv held in stage 1 (dsv.switch_loss=0,
dsv.stage1_steps=0): full attention (the dense backend, cuDNN on a GPU) with DSV's rank-16 predictor
learning beside it; the predictor reads the blocks' inputs through stop_gradient, so the model trains as
under plain full attention, and one run gives both the oracle keep ratios and the predictor's recall.
Checkpoints (orbax, with the controller state) go to --workdir/s<S>; a rerun resumes from them and from
the records in --workdir/records.json.

Measured at step 0 and every --every steps, on held-out batches (the photos' eval split: caption
combinations never trained on) at noise levels --t, per block and head (sparsity_analysis.analyse):
  keep ratio holding theta = 0.90 / 0.95 of each sampled query's attention mass, for selections of
    tokens      the query's own best keys (the oracle)
    blocks      the query's own best 64-token KV blocks
    rule        DSV's selection rule on the true q, k (one list per query tile, block scores)
    predictor   the same rule on the predictor's low-rank projections
  the predictor's recall at the keep ratio the controller measures while dense (1 - dsv.threshold),
  the profiler's theta-sparsity (10th percentile) and the share of mass in the top 10% of keys;
  what the controller would decide now from its training-time statistics (dsv.recall_target 0.95,
  dsv.threshold 0.5): per block dense or sparse, and the rung.
Results: experiments/results/<--name>.json (default sparsity_emergence; also to $OUT), plots
<name>_steps.png (keep ratio vs training step, one line per S; dashed: the sparsest block) and
<name>_tokens.png (keep ratio vs S at the last step all S reached, log-log, with the fit
keep = a * S^b). --quick writes *_quick.* files (git-ignored).
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import jax
import numpy as np

from experiments.harness import RESULTS_DIR, Budget, device_info, print_table, pyplot, save_figure, write_results
from experiments.training import study_overrides

THETAS = (0.9, 0.95)
KINDS = ("tokens", "blocks", "rule", "predictor")


class StopAtBudget(Budget):
    """The budget of the whole script (harness.Budget, from the process start). When only `reserve` seconds
    are left, SIGTERM makes a running Trainer save and stop at its next step; the study then writes what it
    has."""

    def __init__(self, seconds: float | None, reserve: float):
        super().__init__(seconds, reserve=reserve)
        signal.signal(signal.SIGTERM, self._on_term)  # outside Trainer.run: just remember it
        if seconds is not None:
            timer = threading.Timer(max(0.0, self.left()), self._fire)
            timer.daemon = True
            timer.start()

    def _on_term(self, signum, frame):
        self.expired = True

    def _fire(self):
        self.expired = True
        while True:  # again every few seconds: one that lands in a compile, before Trainer.run listens, is lost
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)


def config_for(args, tokens: int):
    from dsv_jax.config import get_config

    overrides = study_overrides("photos", tokens, quick=args.quick, tokens_per_batch=args.tokens_per_batch) + [
        # train.steps one past the last round: the trainer's own held-out evaluation (when it reaches train.steps)
        # would compile another program per S, and the study measures what it needs itself
        f"train.steps={args.steps + 1}",
        f"train.lr={args.lr}",
        f"train.warmup_steps={max(1, args.steps // 20)}",
        f"train.log_every={max(1, min(10, args.every))}",
        f"train.ckpt_every={args.every}",
        "train.keep_checkpoints=2",
        "train.sample_at_end=false",
        f"train.eval_batches={args.batches}",
        f"data.seed={args.data_seed}",
        "attention=dsv",
        "dsv.switch_loss=0",
        "dsv.stage1_steps=0",
        f"dsv.profile_every={args.profile_every}",
        f"dsv.recall_target={args.recall_target}",
        f"dsv.predictor_lr={args.predictor_lr or args.lr}",
    ]
    return get_config("tiny", overrides + list(args.set)), overrides + list(args.set)


def measure(trainer, shape, args) -> dict:
    """One record: the analysis of the trainer's current model on held-out batches (see the docstring)."""
    from dsv_jax.dsv.profiler import TOP_FRACTIONS, keep_for_recall
    from experiments.sparsity_analysis import analyse

    cfg = trainer.cfg
    state = trainer.policy.state_dict()
    per_t, _, layout = analyse(cfg, trainer.graphdef, trainer.state.params, state, shape, args.t, args.batches, seed=0)
    top10 = TOP_FRACTIONS.index(0.1)
    out = {"t": {}}
    for t, r in per_t.items():
        curves = {
            "tokens": r["oracle_curve"][:, :, 0],
            "blocks": r["oracle_curve"][:, :, 1],
            "rule": r["exact_proxy_curve"],
            "predictor": r["recall_curve"],
        }
        keep = {
            f"{theta}": {
                k: np.round(keep_for_recall(c, theta), 4).tolist() for k, c in curves.items() if np.isfinite(c).all()
            }
            for theta in THETAS
        }
        out["t"][str(t)] = {
            "keep": keep,
            "predictor_recall": np.round(r["recall"], 4).tolist(),
            "sparsity": np.round(r["sparsity"], 4).tolist(),
            "top10_mass": np.round(r["top_mass"][..., top10], 4).tolist(),
        }
    ctl = trainer.policy  # the DSV controller (attention=dsv, one device)
    head_keep = ctl.keep(shape)
    rungs = [ctl.decide(head_keep[i], 0.0) for i in range(cfg.model.depth)]
    out["controller"] = {
        "head_keep": np.round(head_keep, 4).tolist(),
        "rungs": rungs,
        "sparse_blocks": int(sum(r > 0 for r in rungs)),
        "profiles": state["shapes"].get("x".join(map(str, shape)), {}).get("profiles", 0),
    }
    out["tokens"] = int(layout.n_real)
    return out


def headline(record: dict) -> dict:
    """{theta: {kind: (mean over t, blocks and heads, the sparsest block's mean over t and heads)}}."""
    out = {}
    for theta in map(str, THETAS):
        out[theta] = {}
        for kind in KINDS:
            per_t = [np.asarray(r["keep"][theta][kind]) for r in record["t"].values() if kind in r["keep"][theta]]
            if per_t:
                blocks = np.mean(per_t, axis=(0, 2))  # [depth]
                out[theta][kind] = (float(blocks.mean()), float(blocks.min()))
    return out


def fit_power(tokens: list[int], keep: list[float]) -> dict | None:
    """keep = a * S^b by least squares on logs (None with fewer than two S)."""
    if len(tokens) < 2:
        return None
    b, log_a = np.polyfit(np.log(tokens), np.log(keep), 1)
    return {"a": float(np.exp(log_a)), "b": float(b), "points": len(tokens)}


def summarise(runs: dict) -> dict:
    """The last step every S reached, and at it, per theta and kind, keep vs S with its power-law fit."""
    common = set.intersection(*(set(r["records"]) for r in runs.values())) if runs else set()
    if not common:
        return {}
    step = max(common, key=int)
    tokens = sorted(runs, key=int)
    out = {"step": int(step), "tokens": [int(s) for s in tokens], "keep": {}, "fit": {}}
    for theta in map(str, THETAS):
        out["keep"][theta], out["fit"][theta] = {}, {}
        for kind in KINDS:
            values = [headline(runs[s]["records"][step])[theta].get(kind) for s in tokens]
            if all(v is not None for v in values):
                out["keep"][theta][kind] = [v[0] for v in values]
                out["fit"][theta][kind] = fit_power([int(s) for s in tokens], [v[0] for v in values])
    return out


def plot(runs: dict, summary: dict, out_dir: str, suffix: str, base: str = "sparsity_emergence") -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    paths = []
    fig, axes = plt.subplots(
        len(THETAS), len(KINDS), figsize=(3.4 * len(KINDS), 3.0 * len(THETAS)), sharey=True, squeeze=False
    )
    for row, theta in enumerate(map(str, THETAS)):
        for col, kind in enumerate(KINDS):
            ax = axes[row][col]
            for j, s in enumerate(sorted(runs, key=int)):
                steps = sorted(runs[s]["records"], key=int)
                values = [headline(runs[s]["records"][st])[theta].get(kind) for st in steps]
                pts = [(int(st), v) for st, v in zip(steps, values) if v is not None]
                if not pts:
                    continue
                x = [p[0] for p in pts]
                ax.plot(
                    x,
                    [p[1][0] for p in pts],
                    marker="o",
                    color=f"C{j}",
                    label=f"S = {int(s) // 1024}k" if int(s) >= 1024 else f"S = {s}",
                )
                ax.plot(x, [p[1][1] for p in pts], ls="--", color=f"C{j}", alpha=0.6)
            ax.set_title(f"{kind}, {float(theta):.0%} of the mass", fontsize=9)
            ax.set_xlabel("training step")
            ax.grid(alpha=0.3)
        axes[row][0].set_ylabel("keep ratio")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("keep ratio vs training step (solid: mean over blocks and heads; dashed: sparsest block)")
    fig.tight_layout()
    paths.append(save_figure(fig, os.path.join(out_dir, f"{base}_steps{suffix}.png")))

    if summary and len(summary["tokens"]) >= 1:
        fig, axes = plt.subplots(1, len(THETAS), figsize=(4.6 * len(THETAS), 3.6), squeeze=False)
        s = np.asarray(summary["tokens"], np.float64)
        for ax, theta in zip(axes[0], map(str, THETAS)):
            for j, (kind, keep) in enumerate(summary["keep"][theta].items()):
                fit = summary["fit"][theta][kind]
                label = kind + (f": {fit['a']:.3g} S^{fit['b']:.3f}" if fit else "")
                ax.plot(s, keep, "o", color=f"C{j}", label=label)
                if fit:
                    grid = np.geomspace(s.min(), s.max() * 4, 20)
                    ax.plot(grid, fit["a"] * grid ** fit["b"], color=f"C{j}", alpha=0.6)
            ax.set_xscale("log")
            ax.set_yscale("log")
            # ticks at the measured S (16k, 32k, ...): the log axis' own minor labels overlap at this span
            ticks = list(s) + [s.max() * 4]
            ax.set_xticks(ticks, [f"{v / 1024:g}k" if v >= 1024 else f"{v:g}" for v in ticks])
            ax.xaxis.set_minor_formatter(plt.NullFormatter())
            ax.set_xlabel("tokens per sample S")
            ax.set_ylabel("keep ratio")
            ax.set_title(f"{float(theta):.0%} of the mass, step {summary['step']}", fontsize=9)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(save_figure(fig, os.path.join(out_dir, f"{base}_tokens{suffix}.png")))
    return paths


def trainer_logging() -> None:
    """INFO lines of the trainer (e.g. "resumed from step") on stderr, without the libraries' chatter."""
    # force: orbax logs while it is imported (through experiments.training's trainer import), which gives the
    # root logger a WARNING handler first, and the trainer's INFO lines would be lost
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def load_records(path: str) -> dict:
    """The runs recorded by an earlier call with the same workdir ({} for none)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        runs = json.load(f)
    steps = {k: sorted(v["records"], key=int) for k, v in runs.items()}
    print(f"resuming the records of {path}: {steps}")
    return runs


def run_rounds(
    trainers: dict, runs: dict, targets, budget: Budget, measure, save, measure_at=None, measure_cost=None
) -> None:
    """Train every run (trainers[S], recorded in runs[str(S)]) to each of `targets` in turn, all S together,
    and at a target in `measure_at` (None: every target) record measure(S, trainer, run) in
    run["records"][step], then save(). A round or a measurement that the budget does not allow is not
    started: a round's time is estimated from the rounds before (the median step time, and the least
    overhead of compiles and checkpoints), a measurement's by measure_cost(S) (None, or None returned: the
    last measurement's time). Once a round does not fit or the budget's SIGTERM stopped one, no S trains
    further, so all stay at (about) the same step. Each round's training (loss, step time) goes into
    run["train"]."""
    timing = {s: {"step_s": None, "overhead_s": None, "measure_s": None} for s in trainers}
    halted = False
    for target in targets:
        for s, trainer in trainers.items():
            run, tm = runs[str(s)], timing[s]
            step = int(trainer.state.step)
            if step < target and not halted:
                need = (target - step) * tm["step_s"] + tm["overhead_s"] if tm["step_s"] else 0.0
                if not budget.allows(need):
                    halted = True
                    print(
                        f"budget: S={s} stays at step {step} ({budget.elapsed():.0f} s used, the next "
                        f"{target - step} steps need ~{need:.0f} s)",
                        flush=True,
                    )
                else:
                    t0 = time.perf_counter()
                    logged = trainer.run(stop_at=target)
                    wall, done = time.perf_counter() - t0, int(trainer.state.step) - step
                    halted = int(trainer.state.step) < target  # the budget's SIGTERM stopped it
                    if done:
                        median = lambda key: float(np.median([r[key] for r in logged if key in r]))
                        losses = [r["loss"] for r in logged if "loss" in r][-max(1, done // 4) :]
                        # steps at their measured rate; the rest (compiles, the checkpoint) the least seen
                        tm["step_s"] = median("step_time")
                        rest = max(0.0, wall - done * tm["step_s"])
                        tm["overhead_s"] = rest if tm["overhead_s"] is None else min(tm["overhead_s"], rest)
                        run.setdefault("train", []).append(
                            {
                                "step": int(trainer.state.step),
                                "loss": float(np.mean(losses)),
                                "median_step_s": tm["step_s"],
                                "tokens_per_s": median("tokens_per_s"),
                                "chunk_wall_s": wall,
                            }
                        )
                step = int(trainer.state.step)
            if str(step) in run["records"] or step != target or (measure_at is not None and step not in measure_at):
                continue
            cost = measure_cost(s) if measure_cost is not None else None
            if not budget.allows((tm["measure_s"] or 0.0) if cost is None else cost):
                print(f"budget: no measurement of S={s} at step {step}", flush=True)
                continue
            t0 = time.perf_counter()
            run["records"][str(step)] = measure(s, trainer, run)
            tm["measure_s"] = time.perf_counter() - t0
            save()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny CPU run")
    p.add_argument("--tokens", help="tokens per sample, comma separated (default 16384,32768; quick 256,512)")
    p.add_argument("--steps", type=int, help="training steps per run (default 500; quick 4)")
    p.add_argument("--every", type=int, help="steps between measurements (default 100; quick 2)")
    p.add_argument("--profile-every", type=int, help="DSV profile steps of training (default 50; quick 2)")
    p.add_argument("--t", default=None, help="noise levels of the analysis (default 0.2,0.5,0.8; quick 0.5)")
    p.add_argument("--batches", type=int, default=1, help="held-out batches per noise level")
    p.add_argument("--tokens-per-batch", type=int, help="equal-token batching (default 32768; quick 512)")
    p.add_argument("--lr", type=float, help="model learning rate (default 5e-4; quick 1e-3)")
    p.add_argument("--predictor-lr", type=float, help="DSV predictor learning rate (default: --lr)")
    p.add_argument("--recall-target", type=float, default=0.95, help="dsv.recall_target of the would-be decisions")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run")
    p.add_argument("--budget-s", type=float, help="wall-clock budget of the whole script (stops cleanly, saves)")
    p.add_argument("--reserve-s", type=float, default=30.0, help="seconds kept for the last save, JSON and plots")
    p.add_argument("--workdir", help="checkpoints and records (default runs/sparsity_emergence; quick: a temp dir)")
    p.add_argument("--results-dir", default=RESULTS_DIR, help="where the JSON and plots go")
    p.add_argument(
        "--name",
        default="sparsity_emergence",
        help="results name: <name>.json, <name>_steps.png, <name>_tokens.png (--quick appends _quick)",
    )
    args = p.parse_args(argv)
    quick = args.quick
    tokens = [int(v) for v in (args.tokens or ("256,512" if quick else "16384,32768")).split(",")]
    args.steps = args.steps if args.steps is not None else (4 if quick else 500)
    args.every = args.every or (2 if quick else 100)
    args.profile_every = args.profile_every or (2 if quick else 50)
    args.t = [float(v) for v in (args.t or ("0.5" if quick else "0.2,0.5,0.8")).split(",")]
    args.tokens_per_batch = args.tokens_per_batch or (512 if quick else 32768)
    args.lr = args.lr or (1e-3 if quick else 5e-4)
    for s in tokens:  # bad input fails here, before any compile
        config_for(args, s)
    trainer_logging()
    budget = StopAtBudget(args.budget_s, args.reserve_s)
    workdir = args.workdir or (
        tempfile.mkdtemp(prefix="sparsity_emergence_") if quick else os.path.join("runs", "sparsity_emergence")
    )
    os.makedirs(workdir, exist_ok=True)
    suffix = "_quick" if quick else ""
    name = args.name + suffix
    records_path = os.path.join(workdir, "records.json")
    runs = load_records(records_path)  # every S measured so far stays in the results, trained now or not

    from dsv_jax.train.step import abstract_model
    from dsv_jax.train.trainer import Trainer

    trainers = {}
    for s in tokens:
        cfg, overrides = config_for(args, s)
        trainers[s] = Trainer(cfg, os.path.join(workdir, f"s{s}"), progress=False)
        run = runs.setdefault(str(s), {"records": {}})
        run.update(shape=list(cfg.data.buckets[0]), config_overrides=overrides, workdir=trainers[s].workdir)
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_model(trainers[tokens[0]].cfg)[1]))

    def save():
        with open(records_path, "w") as f:
            json.dump(runs, f)
        summary = summarise(runs)
        path = write_results(
            name,
            {
                "device": device_info(),
                "args": vars(args),
                "parameters": params,
                "wall_s": budget.elapsed(),
                "budget_expired": budget.expired,
                "summary": summary,
                "runs": runs,
            },
            args.results_dir,
        )
        return path, summary

    targets = sorted(set(list(range(0, args.steps + 1, args.every)) + [args.steps]))

    def measured(s, trainer, run):
        record = measure(trainer, tuple(run["shape"]), args)
        h = headline(record)
        print(
            f"S={s} step {int(trainer.state.step)}: keep@95% tokens {h['0.95']['tokens'][0]:.3f} blocks "
            f"{h['0.95']['blocks'][0]:.3f} rule {h['0.95']['rule'][0]:.3f} predictor "
            f"{h['0.95'].get('predictor', (float('nan'),))[0]:.3f}; controller: "
            f"{record['controller']['sparse_blocks']} sparse blocks ({budget.elapsed():.0f} s)",
            flush=True,
        )
        return record

    try:
        run_rounds(trainers, runs, targets, budget, measured, save)
    finally:
        for trainer in trainers.values():
            trainer.close()
    path, summary = save()
    rows = []
    for s in sorted(map(int, runs)):
        run = runs[str(s)]
        if not run["records"]:
            continue
        last = max(run["records"], key=int)
        h = headline(run["records"][last])
        rows.append(
            {
                "S": s,
                "step": int(last),
                **{f"{k}@95": h["0.95"][k][0] for k in KINDS if k in h["0.95"]},
                **{f"{k}@90": h["0.9"][k][0] for k in KINDS if k in h["0.9"]},
                "sparse_blocks": run["records"][last]["controller"]["sparse_blocks"],
                "train_loss": run["train"][-1]["loss"] if run.get("train") else "",
            }
        )
    if rows:
        print_table(
            rows, ["S", "step"] + [f"{k}@{p}" for p in (90, 95) for k in KINDS] + ["sparse_blocks", "train_loss"]
        )
    if summary:
        for theta in map(str, THETAS):
            fits = {k: (f"{v['b']:.3f}" if v else "-") for k, v in summary["fit"][theta].items()}
            print(f"keep@{theta} ~ S^b at step {summary['step']}: {fits}")
    plots = plot(runs, summary, args.results_dir, suffix, args.name)
    print("wrote", path, *plots, f"({budget.elapsed():.0f} s{', budget reached' if budget.expired else ''})")
    if quick and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
