"""Attention sparsity of a trained model (the DSV paper's observations), as JSON + plots.

    python -m experiments.sparsity_analysis --workdir runs/quality/dsv [--shape 8,64,64]
    python -m experiments.sparsity_analysis --quick    # trains a tiny model on the CPU first

For held-out batches at fixed noise levels t, every block's exact attention rows of sampled queries
(every dsv.query_stride-th token) give, per block and head:
  * the share of attention mass held by the top 1, 2, 5, 10, 20, 50% of keys (mean over queries);
  * sparsity at theta (1 - critical / S, critical = fewest keys with theta of the mass): the
    conservative low percentile DSV uses, and the mean over queries;
  * the mean distance, per axis (t, h, w in tokens), of a query's critical keys from it, next to the
    mean distance of all keys (what uniform attention would give): how local attention is;
  * for a DSV run, the recall of its selection (the trained stage-2 plans; dense blocks measured at the
    rung of the cost-benefit threshold);
  * the keep ratio (share of keys or KV blocks) at which a selection holds 95% of the attention mass:
    keep95_tokens / keep95_blocks for the best possible selection of single tokens / of whole KV blocks
    per query, keep95_exact for DSV's selection rule (one list per query tile from the tile's mean query,
    block scores) applied to the true q, k, and keep95_predictor for the same rule on the predictor's
    low-rank projections (DSV runs): where recall is lost, to the granularity, the sharing, or the rank.
    --kv-block N measures them at another KV block size (default: the run's dsv.kv_block, else the tile).
Plots (matplotlib, `pip install -e ".[plots]"`): top-key mass curves, a block x head sparsity map,
critical-KV distances and the recall curves, named sparsity_<run>[_kv<N>]_*.png after the workdir's last
component; results JSON sparsity_analysis_<run>[_kv<N>].json. Written to $OUT, or
experiments/results/sparsity_analysis/.
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import dataclasses
import functools
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from experiments.harness import RESULTS_DIR, print_table, pyplot, save_figure, write_results
from experiments.training import study_overrides

AXES = ("t", "h", "w")


def analysis_plans(cfg, shape, controller, kv_block: int = 0):
    """Per-block plans that profile with the analysis statistics (and, for DSV, the trained selection);
    kv_block > 0 replaces the plans' KV block size."""
    from dsv_jax.dsv.controller import DSVController
    from dsv_jax.dsv.plan import AttentionPlan

    d = cfg.dsv
    if cfg.attention != "dsv":
        plan = AttentionPlan(
            mode="dense",
            backend=d.dense_backend,
            profile=True,
            analysis=True,
            theta=d.theta,
            percentile=d.percentile,
            query_stride=d.query_stride,
            max_queries=d.max_queries,
            kv_block=kv_block,
        )
        return [plan] * cfg.model.depth, None
    ctl = DSVController(cfg, controller)
    plans = [
        dataclasses.replace(
            p, profile=True, analysis=True, keep=p.keep or ctl.prospective, kv_block=kv_block or p.kv_block
        )
        for p in ctl.plans(shape, train=False)
    ]
    return plans, {"keep": jnp.asarray(ctl.keep(shape), jnp.float32)}


def uniform_distance(layout, positions) -> np.ndarray:
    """Mean per-axis distance from the sampled queries to all valid keys (uniform attention) [3]."""
    c = layout.coords[layout.valid].astype(np.float64)
    q = layout.coords[positions].astype(np.float64)
    return np.mean(np.abs(c[None] - q[:, None]), axis=(0, 1))


@functools.lru_cache(maxsize=16)
def _stats_fn(graphdef, plans: tuple):
    """The jitted forward that returns the blocks' profile statistics, one per (model, plans): repeated
    analyses of a training run (experiments/sparsity_emergence.py) compile it once."""
    from flax import nnx

    from dsv_jax.train.loss import noised

    @jax.jit
    def stats(params, batch, t, key, inputs):
        model = nnx.merge(graphdef, params)
        x0 = batch["latents"].astype(jnp.float32)
        text, mask = model.encode_text(batch)
        tb = jnp.full((x0.shape[0],), t)
        xt, _ = noised(x0, jax.random.normal(key, x0.shape), tb)
        _, aux = model(xt, tb, text, mask, attention=list(plans), attention_inputs=inputs, return_aux=True)
        return aux

    return stats


def heldout_aux(cfg, graphdef, params, plans, inputs, shape, t: float, batches: int, seed: int):
    """The blocks' outputs (aux, on the device) of the model under `plans` for each of `batches` held-out
    batches (the eval split) of latent `shape` noised to level t, batch i with noise key seed + i."""
    from dsv_jax.data.feed import make_feed

    feed = make_feed(cfg, batch_multiple=1, process_index=0, process_count=1, split="eval")
    stats = _stats_fn(graphdef, tuple(plans))
    for i in range(batches):
        batch = {k: jnp.asarray(v) for k, v in feed.batch_at(i, shape).items()}
        yield stats(params, batch, jnp.float32(t), jax.random.key(seed + i), inputs)


def analyse(cfg, graphdef, params, controller, shape, t_values, batches: int, seed: int, kv_block: int = 0):
    from dsv_jax.dsv.predictor import sample_positions
    from dsv_jax.model.tokens import grid_shape, token_layout

    plans, inputs = analysis_plans(cfg, shape, controller, kv_block)
    per_t = {}
    for t in t_values:
        runs = [
            jax.device_get(aux) for aux in heldout_aux(cfg, graphdef, params, plans, inputs, shape, t, batches, seed)
        ]
        per_t[t] = {k: np.mean([r[k] for r in runs], axis=0) for k in runs[0]}
    layout = token_layout(grid_shape(shape, cfg.model.patch), cfg.model.tile)
    positions = layout.valid_positions[sample_positions(layout.n_real, cfg.dsv.query_stride, cfg.dsv.max_queries)]
    return per_t, uniform_distance(layout, positions), layout


def plot(per_t, uniform, out_dir: str, title: str, prefix: str) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    from dsv_jax.dsv.profiler import TOP_FRACTIONS

    paths = []
    ts = sorted(per_t)
    fig, axes = plt.subplots(1, len(ts), figsize=(4 * len(ts), 3.4), squeeze=False)
    for ax, t in zip(axes[0], ts):
        mass = per_t[t]["top_mass"].mean(axis=1)  # [depth, F]
        for i, row in enumerate(mass):
            ax.plot([100 * f for f in TOP_FRACTIONS], row, marker="o", label=f"block {i}")
        ax.set_xscale("log")
        ax.set_xlabel("top keys (% of S)")
        ax.set_ylabel("share of attention mass")
        ax.set_title(f"t = {t}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    paths.append(save_figure(fig, os.path.join(out_dir, f"{prefix}_top_key_mass.png")))

    fig, axes = plt.subplots(1, len(ts), figsize=(3.6 * len(ts) + 1, 3.4), squeeze=False, layout="constrained")
    for ax, t in zip(axes[0], ts):
        sp = per_t[t]["sparsity"]
        im = ax.imshow(sp, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(sp.shape[1]))
        ax.set_yticks(range(sp.shape[0]))
        ax.set_xlabel("head")
        ax.set_ylabel("block")
        ax.set_title(f"sparsity, t = {t}")
    fig.colorbar(im, ax=axes[0].tolist())
    paths.append(save_figure(fig, os.path.join(out_dir, f"{prefix}_sparsity_block_head.png")))

    t = ts[len(ts) // 2]
    dist = per_t[t]["critical_distance"].mean(axis=1)  # [depth, 3]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    width = 0.8 / (len(dist) + 1)
    for i, row in enumerate(dist):
        ax.bar(np.arange(3) + i * width, row, width, label=f"block {i}")
    ax.bar(np.arange(3) + len(dist) * width, uniform, width, color="grey", label="all keys")
    ax.set_xticks(np.arange(3) + 0.4 - width / 2, AXES)
    ax.set_ylabel("mean |distance| to the query (tokens)")
    ax.set_title(f"critical KV distance, t = {t}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(save_figure(fig, os.path.join(out_dir, f"{prefix}_critical_distance.png")))

    from dsv_jax.dsv.profiler import RECALL_FRACTIONS

    r = per_t[t]
    depth = r["oracle_curve"].shape[0]
    fig, axes = plt.subplots(1, depth, figsize=(3.2 * depth, 3.2), squeeze=False, sharey=True)
    curves = {
        "best tokens": r["oracle_curve"][:, :, 0],
        "best blocks": r["oracle_curve"][:, :, 1],
        "rule on true q, k": r["exact_proxy_curve"],
        "predictor": r["recall_curve"],
    }
    for i, ax in enumerate(axes[0]):
        for label, c in curves.items():
            if np.isfinite(c[i]).all():
                ax.plot(RECALL_FRACTIONS, c[i].mean(axis=0), label=label)
        ax.axhline(0.95, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("keep ratio")
        ax.set_title(f"block {i}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"recall (attention mass kept), t = {t}")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(save_figure(fig, os.path.join(out_dir, f"{prefix}_recall_curves.png")))
    return paths


def quick_workdir() -> str:
    from dsv_jax.config import get_config
    from dsv_jax.train.trainer import train

    workdir = tempfile.mkdtemp(prefix="sparsity_analysis_")
    cfg = get_config(
        "tiny",
        study_overrides("shapes", 256, quick=True)
        + [
            "train.steps=4",
            "train.sample_at_end=false",
            "train.eval_batches=1",
            "attention=dsv",
            "dsv.stage1_steps=2",
            "dsv.threshold=0.2",
            "dsv.profile_every=2",
        ],
    )
    train(cfg, workdir, progress=False)
    return workdir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", help="a training workdir with checkpoints")
    p.add_argument("--quick", action="store_true", help="train a tiny model on the CPU, then analyse it")
    p.add_argument("--shape", help="latent T,H,W (default: the config's longest bucket)")
    p.add_argument("--t", default="0.2,0.5,0.8", help="noise levels")
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-block", type=int, default=0, help="KV block size of the selections measured (0: the run's)")
    args = p.parse_args(argv)
    if not args.workdir and not args.quick:
        p.error("give --workdir (a trained run) or --quick")
    workdir = args.workdir or quick_workdir()
    from dsv_jax.train.checkpoint import load_trained

    cfg, graphdef, params, controller, step = load_trained(workdir)
    from dsv_jax.sample import default_shape

    shape = tuple(int(v) for v in args.shape.split(",")) if args.shape else default_shape(cfg)
    t_values = [float(v) for v in args.t.split(",")]
    per_t, uniform, layout = analyse(
        cfg, graphdef, params, controller, shape, t_values, args.batches, args.seed, args.kv_block
    )

    from dsv_jax.dsv.profiler import RECALL_FRACTIONS, TOP_FRACTIONS, keep_for_recall

    rows = []
    for t in t_values:
        r = per_t[t]
        for i in range(cfg.model.depth):
            row = {
                "t": t,
                "block": i,
                "sparsity": float(r["sparsity"][i].mean()),
                "sparsity_mean": float(r["sparsity_mean"][i].mean()),
                "top10%_mass": float(r["top_mass"][i, :, TOP_FRACTIONS.index(0.1)].mean()),
            }
            row.update({f"dist_{a}": float(r["critical_distance"][i, :, j].mean()) for j, a in enumerate(AXES)})
            if np.isfinite(r["recall"][i]).all():
                row["recall"] = float(r["recall"][i].mean())
            # keep ratios that reach 95% recall: the best token / block selections, the selection rule on
            # the true q, k, and (DSV) on the predictor's projections (mean over heads)
            curves = {
                "keep95_tokens": r["oracle_curve"][i, :, 0],
                "keep95_blocks": r["oracle_curve"][i, :, 1],
                "keep95_exact": r["exact_proxy_curve"][i],
                "keep95_predictor": r["recall_curve"][i],
            }
            row.update({k: float(keep_for_recall(c, 0.95).mean()) for k, c in curves.items() if np.isfinite(c).all()})
            rows.append(row)
    print(
        f"{workdir} (step {step}, attention={cfg.attention}), shape {shape}: {layout.n_real} tokens; "
        f"uniform-attention distance t/h/w = {np.round(uniform, 2).tolist()}"
    )
    print_table(
        rows,
        [
            "t",
            "block",
            "sparsity",
            "sparsity_mean",
            "top10%_mass",
            "dist_t",
            "dist_h",
            "dist_w",
            "recall",
            "keep95_tokens",
            "keep95_blocks",
            "keep95_exact",
            "keep95_predictor",
        ],
    )
    out_dir = os.environ.get("OUT") or (
        tempfile.mkdtemp(prefix="sparsity_plots_") if args.quick else os.path.join(RESULTS_DIR, "sparsity_analysis")
    )
    os.makedirs(out_dir, exist_ok=True)
    run_name = os.path.basename(os.path.abspath(workdir))
    prefix = ("quick" if args.quick else run_name) + (f"_kv{args.kv_block}" if args.kv_block else "")
    paths = plot(per_t, uniform, out_dir, f"{run_name} step {step}, {shape}", f"sparsity_{prefix}")
    payload = {
        "workdir": workdir,
        "step": step,
        "attention": cfg.attention,
        "shape": shape,
        "tokens": layout.n_real,
        "theta": cfg.dsv.theta,
        "percentile": cfg.dsv.percentile,
        "top_fractions": TOP_FRACTIONS,
        "recall_fractions": RECALL_FRACTIONS,
        "kv_block": args.kv_block or "the run's",
        "uniform_distance": uniform.tolist(),
        "rows": rows,
        "plots": paths,
        "per_t": {str(t): {k: np.asarray(v).tolist() for k, v in r.items()} for t, r in per_t.items()},
    }
    print("wrote", write_results(f"sparsity_analysis_{prefix}", payload), *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
