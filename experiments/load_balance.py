"""AdaptiveLoad load balancing: equal-token vs dual-constraint batching on a mixed image/video set.

    python -m experiments.load_balance            # H200: 0.8B width, 8 layers (~4-5 min)
    python -m experiments.load_balance --quick    # CPU: a tiny model, well under a minute

The data: a joint image + video mix modelled on public statistics (no files are read: batches are
drawn from the modelled distribution; grain is not needed). Videos follow Panda-70M's clip lengths
(70.7M clips, 167k hours on the dataset's page: a mean of 8.5 s), modelled as log-normal with sigma
0.8 (our assumption), each clip trained on at the longest duration bucket it covers (1, 2, 4, 8 s;
clips under 1 s dropped), at 192x320 (16:10, ~16:9 like the source); 30% of samples are images (our
assumption, typical of joint image-video training), a third at 256x256 and two thirds at 512x512. Latent
shapes assume a Wan-like VAE (4x temporal, 8x spatial, 16 channels) and the 0.8B preset's 1x2x2 patches,
with latent frame counts that are multiples of the 4x4x4 attention tile (4, 8, 16, 32: ~0.8, 1.8, 3.8, 7.8 s at 16 fps).

Method, in one run:
1. Shape benchmarking on the model itself (dsv_jax.train.shape_bench.StepBench: the trainer's
   compiled step): time every bucket at its equal-token batch, and the shortest one at half of it;
   fit t = a + b * B * S**p (scipy curve_fit); report p, R^2, max error.
2. Both modes at the same memory cap M_mem (tokens per batch): equal tokens B = M_mem // S; dual
   B = min(M_mem // S, M_comp // S**p). M_comp comes from a target step time, chosen as fit-cost
   does (`--target auto`): the most even predicted step times among targets that lose at most 3%
   predicted tokens/s (every candidate is reported as a predicted sweep).
3. (a) Predicted from the fit: per-step time CV and tokens/s of each mode with dsv-jax's SPMD step
   (one bucket per step for all devices, steps drawn in proportion to samples / B), and in the
   paper's setting (each of G data-parallel ranks draws its own bucket; a step waits for the slowest
   rank): tokens/s and compute imbalance 1 - mean/max over ranks.
   (b) Measured: both modes' steps interleaved in blocks on one device, every program compiled
   before timing (a compile counter must stay 0): step-time CV, tokens/s, model TFLOP/s (dense-equivalent
   FLOPs of dsv_jax.model.flops) and their share of the bf16 ceiling, compiled peak memory per mode, device
   peak, OOMs.
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass

import jax
import numpy as np

from dsv_jax.config import get_config
from dsv_jax.data.bucketing import BatchRule
from dsv_jax.data.cost_model import CostModel, balance_target, fit_cost_model, predict_schedule, step_time_cv
from dsv_jax.model.flops import parameter_count, train_step_flops
from dsv_jax.train.compiles import CompileCounter
from dsv_jax.train.shape_bench import StepBench, is_oom
from dsv_jax.train.trainer import enable_compilation_cache
from experiments.harness import (
    H200_BF16_TFLOPS,
    RESULTS_DIR,
    peak_memory_bytes,
    print_table,
    pyplot,
    save_figure,
    write_results,
)
from experiments.training import QUICK_MODEL

PANDA70M_MEAN_CLIP_S = 167_000 * 3600 / 70.7e6  # = 8.5 s
DURATION_SIGMA = 0.8  # assumption: log-normal spread of clip lengths
IMAGE_SHARE = 0.3  # assumption: share of images among samples
MAX_BATCH = 4096


@dataclass(frozen=True)
class Bucket:
    name: str
    shape: tuple[int, int, int]  # latent (T, H, W)
    share: float  # of samples


def duration_shares(edges_s, mean_s=PANDA70M_MEAN_CLIP_S, sigma=DURATION_SIGMA) -> list[float]:
    """Share of clips whose length falls in [edge_i, edge_i+1) (the last bucket is open), log-normal
    lengths with the given mean; clips shorter than edges[0] are dropped and the rest renormalised."""
    mu = math.log(mean_s) - sigma**2 / 2

    def cdf(x):
        return 0.5 * (1 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2))))

    bounds = [cdf(e) for e in edges_s] + [1.0]
    raw = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
    return [r / sum(raw) for r in raw]


def mix(quick: bool) -> list[Bucket]:
    if quick:  # tiny latents for the CPU run: one image and two video buckets
        images = [("image", (1, 16, 16), 1.0)]
        videos = [("video 2s", (4, 8, 16)), ("video 4s", (8, 8, 16))]
        edges = [2, 4]
    else:
        images = [("image 256x256", (1, 32, 32), 1 / 3), ("image 512x512", (1, 64, 64), 2 / 3)]
        videos = [
            ("video 1s 192x320", (4, 24, 40)),
            ("video 2s 192x320", (8, 24, 40)),
            ("video 4s 192x320", (16, 24, 40)),
            ("video 8s 192x320", (32, 24, 40)),
        ]
        edges = [1, 2, 4, 8]
    out = [Bucket(n, s, IMAGE_SHARE * w) for n, s, w in images]
    out += [Bucket(n, s, (1 - IMAGE_SHARE) * w) for (n, s), w in zip(videos, duration_shares(edges))]
    return out


def step_frequencies(shares, batch) -> np.ndarray:
    """How often each bucket is a step when every sample is seen once per epoch: share / B."""
    f = np.asarray(shares) / np.asarray(batch, np.float64)
    return f / f.sum()


def predicted_per_rank(model: CostModel, shares, batch, seq, ranks: int, steps: int = 4000, seed: int = 0) -> dict:
    """The paper's setting: every rank draws its own bucket; a step lasts as long as its slowest rank."""
    rng = np.random.default_rng(seed)
    freq = step_frequencies(shares, batch)
    pick = rng.choice(len(freq), size=(steps, ranks), p=freq)
    t = model.predict(np.asarray(batch)[pick], np.asarray(seq)[pick])
    step = t.max(axis=1)
    tokens = (np.asarray(batch) * seq)[pick].sum(axis=1)
    return {
        "ranks": ranks,
        "tokens_per_s": float(tokens.sum() / step.sum()),
        "compute_imbalance": float(np.mean(1 - t.mean(axis=1) / step)),
        "step_cv": step_time_cv(step),
    }


QUICK_OVERRIDES = (*QUICK_MODEL, "model.depth=1", "model.patch=[1,2,2]", "text.max_len=8", "parallel.fsdp=1")


def make_config(quick: bool, preset: str = "0.8b", depth: int = 8, overrides=()):
    """The model of this experiment: a tiny one for CPU runs, else `preset` at `depth` layers (FSDP off)."""
    if quick:
        return get_config("tiny", [*QUICK_OVERRIDES, *overrides])
    return get_config(preset, [f"model.depth={depth}", "parallel.fsdp=1", *overrides])


def equal_batches(bench: StepBench, seq, m_mem: int) -> np.ndarray:
    rule = BatchRule("equal_tokens", max_batch=MAX_BATCH, multiple=bench.dp, tokens_per_batch=m_mem)
    return np.array([rule(s) for s in seq])


def shape_benchmark(bench: StepBench, buckets, eq_b, iters: int):
    """Step 1: time the equal-token batch of every bucket (B x S ~ const, S varies: p) and the shortest
    bucket at half its batch (B varies at one S: separates a from b), fit t = a + b B S^p.
    Every program is one compile on the GPU, the dominant cost, so the grid is kept this small.
    Returns (fit, points, compile seconds)."""
    grid = [(int(b), bk.shape) for b, bk in zip(eq_b, buckets)]
    half = max(bench.dp, int(eq_b[0]) // 2 // bench.dp * bench.dp)
    if (half, buckets[0].shape) not in grid:
        grid.append((half, buckets[0].shape))
    compile_s, points = 0.0, []
    for b, shape in grid:
        t0 = time.perf_counter()
        bench.compiled(b, shape)
        compile_s += time.perf_counter() - t0
        times = bench.time_steps(b, shape, warmup=2, iters=iters)
        points.append(
            {
                "batch": b,
                "shape": list(shape),
                "seq_len": bench.seq_len(shape),
                "time_s": statistics.median(times),
                **bench.memory(b, shape),
            }
        )
    fit = fit_cost_model([p["batch"] for p in points], [p["seq_len"] for p in points], [p["time_s"] for p in points])
    for p in points:
        p["predicted_s"] = float(fit.predict(p["batch"], p["seq_len"]))
    return fit, points, compile_s


def batch_modes(fit: CostModel, seq, shares, eq_b, m_mem: int, multiple: int, target="auto"):
    """Step 2: both modes' batch sizes per bucket at the same memory cap. The dual rule's compute budget
    comes from a target step time: `target` in ms, or auto (cost_model.balance_target, as fit-cost).
    Returns ({"equal_tokens": B, "dual": B}, target seconds, the predicted sweep over targets)."""

    def dual_batches(target_s):
        rule = BatchRule(
            "dual",
            max_batch=MAX_BATCH,
            multiple=multiple,
            m_mem=m_mem,
            m_comp=fit.compute_budget_for(target_s),
            p=fit.p,
        )
        return np.array([rule(s) for s in seq])

    target_s, sweep = balance_target(fit, seq, shares, dual_batches, eq_b)
    if target != "auto":
        target_s = float(target) / 1e3
    return {"equal_tokens": np.asarray(eq_b), "dual": dual_batches(target_s)}, target_s, sweep


def compile_modes(bench: StepBench, buckets, modes: dict) -> tuple[dict, float]:
    """Compile every (B, shape) program of the modes that is missing and run each once (warm-up).
    Returns (random batches keyed by (B, shape), compile seconds)."""
    compile_s = 0.0
    for bb in modes.values():
        for b, bk in zip(bb, buckets):
            t0 = time.perf_counter()
            bench.compiled(int(b), bk.shape)
            compile_s += time.perf_counter() - t0
    batches = {
        (int(b), bk.shape): bench.random_batch(int(b), bk.shape) for bb in modes.values() for b, bk in zip(bb, buckets)
    }
    for (b, shape), batch in batches.items():
        bench.step(b, shape, batch)
    return batches, compile_s


def measure_modes(
    bench: StepBench, buckets, seq, modes: dict, batches: dict, n_steps: int, *, seed: int = 1, on_block=None
):
    """Step 3b: `n_steps` steps per mode, buckets drawn in proportion to samples / B, the modes
    interleaved in blocks (drift hits both alike), OOMs counted (the state is rebuilt). on_block(measured)
    is called after every block with the summary so far. Returns (measured per mode, compiles during
    the timed steps, losses after every block)."""
    cfg = bench.cfg
    shares = np.array([b.share for b in buckets])
    rng = np.random.default_rng(seed)
    schedule = {
        name: rng.choice(len(buckets), size=n_steps, p=step_frequencies(shares, bb)) for name, bb in modes.items()
    }
    times = {name: [] for name in modes}
    tokens = {name: 0 for name in modes}
    flops = {name: 0.0 for name in modes}  # dense-equivalent model FLOPs (dsv_jax.model.flops)
    step_flops = {
        (int(b), bk.shape): train_step_flops(cfg, bk.shape, int(b))["dense_equiv"]
        for bb in modes.values()
        for b, bk in zip(bb, buckets)
    }
    ooms = {name: 0 for name in modes}
    used = {name: set() for name in modes}
    losses = []

    def summary():
        out = {}
        for name in modes:
            total = sum(times[name])
            out[name] = {
                "steps": len(times[name]),
                "step_cv": step_time_cv(times[name]),
                "median_step_ms": 1e3 * statistics.median(times[name]) if times[name] else math.nan,
                "tokens_per_s": tokens[name] / total if total else math.nan,
                "model_tflops": flops[name] / total / 1e12 if total else math.nan,
                "mfu_vs_bf16_ceiling": flops[name] / total / 1e12 / H200_BF16_TFLOPS / bench.mesh.size
                if total
                else math.nan,
                "programs": len(used[name]),
                "compiled_peak_bytes": max((bench.memory(b, s).get("peak_bytes", 0) for b, s in used[name]), default=0),
                "ooms": ooms[name],
                "step_times_s": list(times[name]),
            }
        return out

    block = max(4, n_steps // 10)
    with CompileCounter() as compiles:
        for start in range(0, n_steps, block):
            for name, bb in modes.items():
                for i in range(start, min(start + block, n_steps)):
                    k = int(schedule[name][i])
                    b, shape = int(bb[k]), buckets[k].shape
                    used[name].add((b, shape))
                    try:
                        times[name].append(bench.step(b, shape, batches[(b, shape)]))
                    except Exception as e:
                        if not is_oom(e):
                            raise
                        ooms[name] += 1
                        bench.reset_state()
                        continue
                    tokens[name] += b * int(seq[k])
                    flops[name] += step_flops[(b, shape)]
            losses.append(float(bench.last_metrics["loss"]))
            if on_block is not None:
                on_block(summary())
    return summary(), compiles.count, losses


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny CPU run")
    ap.add_argument("--preset", default="0.8b")
    ap.add_argument("--depth", type=int, default=8, help="layers (the 0.8B preset has 28; fewer fit the budget)")
    ap.add_argument("--mem-tokens", type=int, help="M_mem, tokens per batch (default: 4 of the longest clips)")
    ap.add_argument(
        "--target",
        default="auto",
        help="dual target step time in ms, or auto: the most even predicted step times within 3%% "
        "of equal-token tokens/s (cost_model.balance_target, as fit-cost)",
    )
    ap.add_argument("--steps", type=int, default=300, help="timed steps per mode (fewer if the budget needs)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=270.0,
        help="wall-clock budget of the whole script: the timed steps per mode shrink to fit it",
    )
    ap.add_argument("--ranks", type=int, default=8, help="data-parallel ranks of the per-rank prediction")
    args = ap.parse_args()
    t_start = time.perf_counter()
    enable_compilation_cache()  # a second run of this script skips most compiles

    cfg = make_config(args.quick, args.preset, args.depth)
    if args.quick:
        steps, iters, budget = min(args.steps, 16), 3, min(args.budget_s, 50.0)
    else:
        steps, iters, budget = args.steps, 5, args.budget_s
    buckets = mix(args.quick)
    bench = StepBench(cfg)
    seq = np.array([bench.seq_len(b.shape) for b in buckets])
    m_mem = args.mem_tokens or 4 * int(seq.max())
    eq_b = equal_batches(bench, seq, m_mem)
    n_params = parameter_count(cfg)
    print(
        f"{cfg.name} depth {cfg.model.depth} hidden {cfg.model.hidden} ({n_params / 1e6:.0f}M params) on "
        f"{jax.devices()[0].device_kind}; M_mem = {m_mem} tokens"
    )

    # 1. shape benchmarking
    fit, points, compile_s = shape_benchmark(bench, buckets, eq_b, iters)
    print(
        f"[{time.perf_counter() - t_start:.0f} s] fit: t = {fit.a * 1e3:.2f} ms + {fit.b:.3g} * B * S^{fit.p:.3f}"
        f"   R^2 {fit.r2:.4f}, max error {100 * fit.max_rel_error:.1f}% over {len(points)} shapes"
    )

    # 2. the dual rule's compute budget from a target step time
    shares = np.array([b.share for b in buckets])
    modes, target, sweep = batch_modes(fit, seq, shares, eq_b, m_mem, bench.dp, args.target)
    for s in sweep:
        s["per_rank_tokens_per_s"] = predicted_per_rank(fit, shares, np.array(s["batch"]), seq, args.ranks)[
            "tokens_per_s"
        ]
    eq_b, dual_b = modes["equal_tokens"], modes["dual"]

    # (a) predicted
    predicted = {}
    eq_per_rank = predicted_per_rank(fit, shares, eq_b, seq, args.ranks)
    for name, bb in modes.items():
        pr = predicted_per_rank(fit, shares, bb, seq, args.ranks)
        predicted[name] = {"spmd": predict_schedule(fit, seq, shares, bb), "per_rank": pr}
        predicted[name]["per_rank"]["tokens_per_s_ratio"] = pr["tokens_per_s"] / eq_per_rank["tokens_per_s"]

    # (b) measured: compile what is missing, warm up, then interleave the modes in blocks
    batches, more_compile_s = compile_modes(bench, buckets, modes)
    compile_s += more_compile_s
    elapsed = time.perf_counter() - t_start
    print(f"[{elapsed:.0f} s] {len(bench._compiled)} programs compiled in {compile_s:.0f} s; timing both modes")
    per_pair = predicted["equal_tokens"]["spmd"]["mean_step_s"] + predicted["dual"]["spmd"]["mean_step_s"]
    n_steps = int(max(min(20, steps), min(steps, (budget - elapsed - 5) / max(per_pair, 1e-6))))
    measured, n_compiles, losses = measure_modes(bench, buckets, seq, modes, batches, n_steps)
    ooms = {name: m["ooms"] for name, m in measured.items()}
    gain = measured["dual"]["tokens_per_s"] / measured["equal_tokens"]["tokens_per_s"] - 1
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite training loss during the timed steps: {losses}")

    rows = [
        {
            "bucket": bk.name,
            "shape": "x".join(map(str, bk.shape)),
            "S": int(s),
            "share": round(bk.share, 3),
            "B equal": int(e),
            "B dual": int(d),
            "t equal ms": 1e3 * float(fit.predict(e, s)),
            "t dual ms": 1e3 * float(fit.predict(d, s)),
        }
        for bk, s, e, d in zip(buckets, seq, eq_b, dual_b)
    ]
    print_table(rows, list(rows[0]))
    print()
    table = [
        {
            "mode": n,
            "pred CV": predicted[n]["spmd"]["cv"],
            "meas CV": measured[n]["step_cv"],
            "tokens/s": measured[n]["tokens_per_s"],
            "pred tok/s": predicted[n]["spmd"]["tokens_per_s"],
            f"per-rank x{args.ranks} tok/s ratio": predicted[n]["per_rank"]["tokens_per_s_ratio"],
            "imbalance": predicted[n]["per_rank"]["compute_imbalance"],
            "peak GiB": measured[n]["compiled_peak_bytes"] / 2**30,
            "OOMs": measured[n]["ooms"],
        }
        for n in modes
    ]
    print_table(table, list(table[0]))
    print(
        f"\ndual vs equal tokens: measured tokens/s {100 * gain:+.1f}%, step-time CV "
        f"{100 * measured['equal_tokens']['step_cv']:.1f}% -> {100 * measured['dual']['step_cv']:.1f}%; "
        f"compiles after warm-up: {n_compiles}; target step {1e3 * target:.1f} ms; {n_steps} steps per mode"
    )

    payload = {
        "quick": args.quick,
        "preset": cfg.name,
        "depth": cfg.model.depth,
        "hidden": cfg.model.hidden,
        "params": n_params,
        "dtype": cfg.model.dtype,
        "attention": cfg.attention,
        "distribution": {
            "source": "Panda-70M clip lengths (mean 8.5 s = 167k h / 70.7M clips); "
            f"log-normal sigma {DURATION_SIGMA} and image share {IMAGE_SHARE} assumed",
            "buckets": [
                {"name": b.name, "shape": list(b.shape), "seq_len": int(s), "share": b.share}
                for b, s in zip(buckets, seq)
            ],
        },
        "m_mem_tokens": m_mem,
        "target_step_s": target,
        "m_comp": fit.compute_budget_for(target),
        "fit": {"a": fit.a, "b": fit.b, "p": fit.p, "r2": fit.r2, "max_rel_error": fit.max_rel_error, "points": points},
        "batch_sizes": {n: bb.tolist() for n, bb in modes.items()},
        "predicted": predicted,
        "target_sweep": sweep,
        "measured": measured,
        "tokens_per_s_gain": gain,
        "compiles_after_warmup": n_compiles,
        "compile_seconds": compile_s,
        "device_peak_bytes": peak_memory_bytes(),
        "goals": {
            "step_cv_le_8pct": measured["dual"]["step_cv"] <= 0.08,
            "tokens_per_s_ge_20pct": gain >= 0.20,
            "zero_ooms": not any(ooms.values()),
            "zero_recompiles": n_compiles == 0,
        },
        "wall_s": time.perf_counter() - t_start,
    }
    name = "load_balance_quick" if args.quick else "load_balance"
    path = write_results(name, payload)
    plot(payload, os.path.join(RESULTS_DIR, f"{name}.png"))
    print(f"wrote {path}")


def plot(payload: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for name, m in payload["measured"].items():
        ax[0].plot(np.array(m["step_times_s"]) * 1e3, ".", ms=3, label=f"{name} (CV {100 * m['step_cv']:.1f}%)")
    ax[0].set(xlabel="step", ylabel="step time (ms)", title="measured step times")
    ax[0].legend()
    pts = payload["fit"]["points"]
    ax[1].loglog([p["time_s"] * 1e3 for p in pts], [p["predicted_s"] * 1e3 for p in pts], "o")
    lim = [min(p["time_s"] for p in pts) * 800, max(p["time_s"] for p in pts) * 1200]
    ax[1].plot(lim, lim, "k:", lw=1)
    f = payload["fit"]
    ax[1].set(
        xlabel="measured (ms)", ylabel="predicted (ms)", title=f"t = a + b B S^p: p = {f['p']:.3f}, R^2 = {f['r2']:.3f}"
    )
    sw = payload["target_sweep"]
    ax[2].plot([s["cv"] * 100 for s in sw], [s["tokens_per_s_ratio"] for s in sw], ".", label="dual, one target each")
    ax[2].axvline(payload["predicted"]["equal_tokens"]["spmd"]["cv"] * 100, color="gray", ls=":", label="equal tokens")
    ax[2].set(
        xlabel="predicted step-time CV (%)",
        ylabel="tokens/s vs equal tokens",
        title="dual rule over target step times (predicted)",
    )
    ax[2].legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
