"""Recall by granularity (issue 38, item 1): the keep ratio that holds 90% / 95% of the attention mass when
keys are selected in 3D boxes of 1 to 64 tokens, shared by query tiles of 1 to 128 tokens, on a model that
learnt real pictures. Where a sparse kernel pays depends on how coarse a selection can be for the keep it needs.

    # one H200 in one 10-minute call (jax 0.11.2): train 1500 steps, measure at steps 500 and 1500, stop
    # cleanly at the budget (checkpoint, records, JSON, plot; also copied to $OUT):
    python -m experiments.granularity --workdir runs/granularity --steps 1500 --measure-at 500,1500 \\
        --budget-s 570 --reserve-s 20
    # the same command again on the same machine continues from the checkpoints and records in --workdir
    # (if the first call stopped at the budget before step 1500 or its measurement)
    # CPU, tiny sizes (the test; ~1 minute of CPU):
    python -m experiments.granularity --quick

GPU time (H200, the 16k setup; sparsity_emergence_16k_long.json): 0.24 s a step, two train-step compiles,
a checkpoint per --every (250) steps: 1500 steps in ~7 min with the compiles. A measurement (estimated, not
yet timed on a GPU): 2 noise levels x 2 batches = 4 capturing forwards and 32 block analyses, ~15 s warm; the
first also compiles both (~1 min at most). Expect ~8.5-9 min in all: if the budget stops it first, the rerun
finishes in 1-2 min. The run: experiments/sparsity_emergence.py's, at 16k tokens only
(experiments/training.py `study_overrides("photos", 16384)`): data.source=photos, 16 x 64 x 64 latents at
patch 1x2x2 (16384 tokens, a 16 x 32 x 32 grid), a DiT of 8 blocks x 12 heads x 64 (109M parameters), 3D tiles
of 4 x 4 x 4 tokens, two samples a step, AdamW 5e-4 cosine, bf16; attention=dsv held in stage 1
(dsv.switch_loss=0): full attention, with the rank-16 predictor learning beside it through stop_gradient.
Trained in rounds of --every steps with orbax checkpoints in --workdir/s16384 and the measurements in
--workdir/records.json (sparsity_emergence.run_rounds); a rerun resumes from both.

What is measured, per block and head, on --batches held-out batches (the photos' eval split) at each noise
level --t (the forward returns each block's q, k and the predictor's q_lr, k_lr: AttentionPlan.capture):

  queries   --windows windows of W = max(--q-tiles) consecutive tokens (W = 128: two 4x4x4 tiles), spread
            over the sequence (predictor.sample_positions' stride and cycling offset), and every query in
            them: exact softmax rows p[q, :] over all S keys (fp32, HIGHEST precision dots).
  query tile  q_tile consecutive tokens of today's tile-major layout (raster inside a tile): 32 = half a
            tile (a 2x4x4 box), 64 = one tile, 128 = two tiles neighbouring along w (4x4x8); 1 = a single
            query (on --q1-rows of the sampled rows, strided with a cycling offset).
  KV box    a box of b_t x b_h x b_w tokens inside a tile (--boxes; it must divide the tile): the keys are
            grouped by the token coordinates of the layout (coords // box), not by sequence position, so
            the result holds for any in-tile order; "1" is a single token.
  methods, for a query tile T and the boxes B_1..B_n, m_T(B) = mean over T's rows of their mass in B:
    oracle     T's boxes ranked by m_T (T's total attention mass in them): one shared list per tile, the
               best any per-tile selection can do. At q_tile 1 and box 1: each query's own best keys, the
               floor of every selection.
    rule       DSV's selection rule on the true q, k: T's proxy = the mean of its q rows; a box's score =
               the mean over its keys of proxy . k (= proxy . mean k), as dsv_jax/dsv/selection.py and
               pallas_kernels/lowrank_topk rank them ("mean" block reduce); boxes ranked by score.
    predictor  the same rule on the predictor's q_lr, k_lr (models trained with attention=dsv).
  keep ratio at theta: the fewest boxes c (as a fraction of the n boxes) whose ranked masses, summed and
            averaged over the sampled query tiles and batches, reach theta (0.9, 0.95) of the attention
            mass: one count per head, as DSV keeps one count per head. Exact counts, not the
            RECALL_FRACTIONS grid that sparsity_emergence rounds up to. Also the mean recall at each of
            profiler.RECALL_FRACTIONS (mean over heads).

Which in-tile order makes each box one contiguous (and box-aligned) range of the sequence: "raster_thw"
(today's layout: t, then h, then w inside the tile) or "morton_thw" (the bits of t, h, w interleaved, t's the
most significant at each level): `contiguity` in the JSON, per box. A kernel that reads a box as one range
needs its box contiguous in the layout it adopts.

Results: experiments/results/granularity.json (--name; also to $OUT): `rows`, per step, theta, method, q_tile
and box: the keep ratio, mean over t, blocks and heads, with the sparsest and densest block (each block's mean
over t and heads); `records`, per measured step and t: the keep ratios per block (mean over heads; per head in
--workdir/records.json) and the recall curves (mean over blocks and heads); `contiguity`; `train`. Plot
granularity.png: keep ratio against the box, per step and theta. --quick writes granularity_quick.*
(git-ignored): the tiny model of the quick runs with 4x4x4 tiles on a 4 x 8 x 8 token grid.
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import functools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.harness import RESULTS_DIR, device_info, print_table, pyplot, save_figure, write_results

THETAS = (0.9, 0.95)
METHODS = ("oracle", "rule", "predictor")
BOXES = ("1", "1x1x4", "1x2x2", "2x2x2", "1x2x4", "1x4x4", "2x2x4", "2x4x4", "4x4x4")
ORDERS = ("raster_thw", "morton_thw")
HIGHEST = jax.lax.Precision.HIGHEST


# -- boxes, orders and the sampled queries (numpy, static) ----------------------------------------------


def parse_box(text: str) -> tuple[int, int, int]:
    """ "b_t x b_h x b_w" ("2x2x4"), or "1" for a single token -> (b_t, b_h, b_w)."""
    parts = text.strip().lower().split("x")
    try:
        dims = tuple(int(v) for v in parts)
    except ValueError:
        dims = ()
    if dims == (1,):
        return (1, 1, 1)
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(f"box {text!r} is not '1' or 'TxHxW' with positive integers (e.g. 2x2x4)")
    return dims


def box_name(box) -> str:
    return "1" if tuple(box) == (1, 1, 1) else "x".join(map(str, box))


def box_permutation(coords: np.ndarray, grid, box) -> np.ndarray:
    """int [S]: sequence positions grouped by box (coords [S, 3] of each position // box, boxes in raster
    order): perm.reshape(n_boxes, box_tokens) lists each box's positions. Needs the box to divide the grid."""
    grid, box = np.asarray(grid), np.asarray(box)
    if (grid % box).any():
        raise ValueError(f"box {box_name(box)} does not divide the token grid {tuple(grid)}")
    cells = grid // box
    b = coords // box
    group = (b[:, 0] * cells[1] + b[:, 1]) * cells[2] + b[:, 2]
    return np.argsort(group, kind="stable")


def in_tile_order(tile, order: str) -> np.ndarray:
    """In-tile coordinates [tile tokens, 3] listed in `order`: "raster_thw" (t, h, w raster) or "morton_thw"
    (bits interleaved, t's bit the most significant at each level; needs power-of-two tile sides)."""
    coords = np.indices(tile).reshape(3, -1).T  # raster
    if order == "raster_thw":
        return coords
    if order != "morton_thw":
        raise ValueError(f"unknown in-tile order {order!r}: choose from {ORDERS}")
    bits = [int(math.log2(n)) for n in tile]
    if any(1 << b != n for b, n in zip(bits, tile)):
        raise ValueError(f"a Morton order needs power-of-two tile sides, got {tuple(tile)}")
    key = np.zeros(len(coords), np.int64)
    for level in reversed(range(max(bits, default=0))):
        for d in range(3):
            if level < bits[d]:
                key = key * 2 + ((coords[:, d] >> level) & 1)
    return coords[np.argsort(key, kind="stable")]


def contiguity(box, tile, order: str) -> dict:
    """Whether every box of a tile is one contiguous range of the tile's tokens in `order`, and whether those
    ranges start at multiples of the box size (aligned: a kernel can address box i as rows i*g..i*g+g)."""
    perm = box_permutation(in_tile_order(tile, order), tile, box)  # each box's positions in `order`
    g = int(np.prod(box))
    runs = np.sort(perm.reshape(-1, g), axis=1)
    contiguous = bool(np.all(runs[:, -1] - runs[:, 0] == g - 1))
    return {"contiguous": contiguous, "aligned": contiguous and bool(np.all(runs[:, 0] % g == 0))}


def query_rows(seq: int, window: int, windows: int) -> np.ndarray:
    """Sorted sequence positions of `windows` windows of `window` consecutive tokens, spread over the
    sequence with predictor.sample_positions' stride and cycling offset (all windows where fewer exist)."""
    from dsv_jax.dsv.predictor import sample_positions

    starts = np.unique(sample_positions(seq // window, 1, windows)) * window
    return (starts[:, None] + np.arange(window)).ravel().astype(np.int32)


# -- the measurement (jax, on the device) ----------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def curve_fn(grid, tile, boxes: tuple, q_tiles: tuple, windows: int, q1_rows: int, has_lr: bool, heads_per_step=4):
    """jitted f(q, k, q_lr, k_lr) of one block on the unpadded layout token_layout(grid, tile) ([B, S, H, D]
    and [B, S, H, r]; q_lr, k_lr None without a predictor) -> {(method, q_tile, box name): mean ranked mass
    [H, n_boxes]}: entry c is the mass, averaged over the sampled query tiles and the batch, of the box
    ranked c-th by the method (its cumulative sum is the recall curve). heads_per_step (sample, head) pairs
    at a time (lax.map's batch: the softmax rows of each are Q x S fp32)."""
    from dsv_jax.dsv.predictor import sample_positions
    from dsv_jax.model.tokens import token_layout

    layout = token_layout(grid, tile)
    rows = query_rows(layout.seq_len, max(q_tiles), windows)
    n_q = len(rows)
    q1 = sample_positions(n_q, 1, q1_rows)  # the single queries: a strided subset, cycling offset
    perms = {b: box_permutation(layout.coords, grid, parse_box(b)) for b in boxes}

    def one(args):
        """One (sample, head): sampled q rows [Q, D], all k [S, D] (and q_lr rows, k_lr)."""
        qs, ks, *lr = (a.astype(jnp.float32) for a in args)
        s, d = ks.shape
        p = jax.nn.softmax(jnp.einsum("qd,sd->qs", qs, ks, precision=HIGHEST) * d**-0.5, axis=-1)
        out = {}
        for name, perm in perms.items():
            g = int(np.prod(parse_box(name)))
            nb = s // g
            mass = jnp.sum(p[:, perm].reshape(n_q, nb, g), axis=-1)  # [Q, nb]
            box_keys = [jnp.mean(x[perm].reshape(nb, g, -1), axis=1) for x in (ks, *lr[1:])]
            for qt in q_tiles:
                if qt == 1:
                    m, proxies = mass[q1], [x[q1] for x in (qs, *lr[:1])]
                else:  # a tile's mean row: its total mass / qt, and DSV's proxy (the mean query)
                    m = jnp.mean(mass.reshape(n_q // qt, qt, nb), axis=1)
                    proxies = [jnp.mean(x.reshape(n_q // qt, qt, -1), axis=1) for x in (qs, *lr[:1])]
                out[("oracle", qt, name)] = jnp.mean(-jnp.sort(-m, axis=-1), axis=0)
                for method, proxy, kb in zip(METHODS[1:], proxies, box_keys):
                    order = jnp.argsort(-jnp.einsum("tr,nr->tn", proxy, kb, precision=HIGHEST), axis=-1)
                    out[(method, qt, name)] = jnp.mean(jnp.take_along_axis(m, order, axis=-1), axis=0)
        return out

    @jax.jit
    def run(q, k, q_lr=None, k_lr=None):
        b, _, h, _ = q.shape

        def heads(x, sampled=False):  # [B, S, H, X] -> [B * H, S or Q, X]
            x = x[:, rows] if sampled else x
            return jnp.swapaxes(x, 1, 2).reshape(b * h, x.shape[1], x.shape[-1])

        per_head = (heads(q, True), heads(k)) + ((heads(q_lr, True), heads(k_lr)) if has_lr else ())
        res = jax.lax.map(one, per_head, batch_size=min(heads_per_step, b * h))
        return {key: jnp.mean(v.reshape(b, h, -1), axis=0) for key, v in res.items()}

    return run


def keep_ratios(mean_ranked_mass, thetas=THETAS) -> np.ndarray:
    """[len(thetas), ...]: the fewest leading entries (as a fraction of the n) whose sum reaches theta."""
    curve = np.cumsum(np.asarray(mean_ranked_mass, np.float64), axis=-1)
    n = curve.shape[-1]
    return np.stack([np.minimum(np.sum(curve < th - 1e-6, axis=-1) + 1, n) / n for th in thetas])


def recall_at_fractions(mean_ranked_mass) -> np.ndarray:
    """[..., len(RECALL_FRACTIONS)]: the mass held by the leading ceil(f * n) entries (profiler's rounding)."""
    from dsv_jax.dsv.profiler import RECALL_FRACTIONS

    curve = np.cumsum(np.asarray(mean_ranked_mass, np.float64), axis=-1)
    n = curve.shape[-1]
    counts = np.array([min(n, max(1, math.ceil(f * n - 1e-4))) for f in RECALL_FRACTIONS])
    return curve[..., counts - 1]


class Measurement:
    """The study's measurement of a model (`__call__`), with the timings that estimate the next one."""

    def __init__(self, args):
        self.args = args
        self.warm_s = None  # estimated seconds of a measurement without compiles (after the first)

    def geometry(self, cfg, shape):
        from dsv_jax.model.tokens import grid_shape, token_layout

        layout = token_layout(grid_shape(shape, cfg.model.patch), cfg.model.tile)
        if layout.padded:
            raise ValueError(f"shape {tuple(shape)}: the token grid {layout.grid} does not divide into tiles")
        tile = layout.tile
        for b in self.args.boxes:
            if np.any(np.asarray(tile) % np.asarray(parse_box(b))):
                raise ValueError(f"--boxes: {b} does not divide the {box_name(tile)} tile")
        window = max(self.args.q_tiles)
        if any(window % q for q in self.args.q_tiles) or layout.seq_len % window:
            raise ValueError(
                f"--q-tiles {self.args.q_tiles}: the largest must be a multiple of the others and divide "
                f"S = {layout.seq_len}"
            )
        return layout, query_rows(layout.seq_len, window, self.args.windows)

    def __call__(self, cfg, graphdef, params, shape) -> dict:
        from dsv_jax.dsv.plan import AttentionPlan
        from experiments.sparsity_analysis import heldout_aux

        args = self.args
        layout, rows = self.geometry(cfg, shape)
        has_lr = cfg.attention == "dsv"
        plan = AttentionPlan(mode="dsv" if has_lr else "dense", capture=True, backend=cfg.dsv.dense_backend)
        analyse = curve_fn(
            layout.grid,
            layout.tile,
            tuple(args.boxes),
            tuple(args.q_tiles),
            args.windows,
            args.q1_rows,
            has_lr,
            args.heads_per_step,
        )
        t_start = time.perf_counter()
        forwards, analyses, record = [], [], {"t": {}}
        for t in args.t:
            sums = None
            t0 = time.perf_counter()
            for aux in heldout_aux(cfg, graphdef, params, [plan] * cfg.model.depth, None, shape, t, args.batches, 0):
                jax.block_until_ready(aux["capture/q"])
                forwards.append(time.perf_counter() - t0)
                per_block = []
                for i in range(cfg.model.depth):
                    t0 = time.perf_counter()
                    lr = (aux["capture/q_lr"][i], aux["capture/k_lr"][i]) if has_lr else ()
                    per_block.append(jax.device_get(analyse(aux["capture/q"][i], aux["capture/k"][i], *lr)))
                    analyses.append(time.perf_counter() - t0)
                sums = per_block if sums is None else [jax.tree.map(np.add, a, b) for a, b in zip(sums, per_block)]
                t0 = time.perf_counter()
            mean = [{k: v / args.batches for k, v in blk.items()} for blk in sums]
            record["t"][str(t)] = summarise_blocks(mean)
        record["measure_s"] = time.perf_counter() - t_start
        # later measurements compile nothing: the first forward and block analysis of this one did
        med = lambda xs: statistics.median(xs[1:]) if len(xs) > 1 else xs[0]
        self.warm_s = len(forwards) * med(forwards) + len(analyses) * med(analyses)
        record.update(
            tokens=int(layout.n_real),
            query_rows=len(rows),
            forward_s=forwards,
            block_analysis_s=[min(analyses), max(analyses)],
            warm_estimate_s=self.warm_s,
        )
        return record


def summarise_blocks(blocks: list[dict]) -> dict:
    """Per-block dicts {(method, q_tile, box): mean ranked mass [H, n]} -> {"keep": {theta: {method: {q_tile:
    {box: [block][head]}}}}, "recall": {method: {q_tile: {box: [block][fraction] (mean over heads)}}}}."""
    keep = {str(th): {} for th in THETAS}
    recall = {}
    for key in blocks[0]:
        method, qt, box = key
        k = np.stack([keep_ratios(blk[key]) for blk in blocks], axis=1)  # [theta, block, head]
        for j, th in enumerate(THETAS):
            keep[str(th)].setdefault(method, {}).setdefault(str(qt), {})[box] = np.round(k[j], 5).tolist()
        r = np.stack([recall_at_fractions(blk[key]).mean(axis=0) for blk in blocks])  # [block, F]
        recall.setdefault(method, {}).setdefault(str(qt), {})[box] = np.round(r, 5).tolist()
    return {"keep": keep, "recall": recall}


# -- results -----------------------------------------------------------------------------------------------


def _map_lists(tree, fn):
    """The nested dict `tree` with fn applied to each list in it."""
    return {k: _map_lists(v, fn) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def compact(record: dict) -> dict:
    """A record as the results JSON keeps it: keep ratios per block as the mean over heads, recall curves as
    the mean over blocks (the per-head, per-block values stay in --workdir/records.json)."""
    out = {k: v for k, v in record.items() if k != "t"}
    out["t"] = {
        t: {
            "keep_per_block": _map_lists(r["keep"], lambda v: np.round(np.mean(v, axis=1), 4).tolist()),
            "recall": _map_lists(r["recall"], lambda v: np.round(np.mean(v, axis=0), 4).tolist()),
        }
        for t, r in record["t"].items()
    }
    return out


def summary_rows(records: dict) -> list[dict]:
    """Per measured step, theta, method, q_tile and box: keep ratio, mean over t, blocks and heads, and the
    sparsest / densest block (each block's mean over t and heads)."""
    rows = []
    for step in sorted(records, key=int):
        per_t = list(records[step]["t"].values())
        for theta in map(str, THETAS):
            for method, by_q in per_t[0]["keep"][theta].items():
                for qt, by_box in by_q.items():
                    for box in by_box:
                        k = np.mean([np.asarray(r["keep"][theta][method][qt][box]) for r in per_t], axis=0)
                        blocks = k.mean(axis=1)  # [block]
                        rows.append(
                            {
                                "step": int(step),
                                "theta": float(theta),
                                "method": method,
                                "q_tile": int(qt),
                                "box": box,
                                "box_tokens": int(np.prod(parse_box(box))),
                                "keep": float(blocks.mean()),
                                "keep_sparsest_block": float(blocks.min()),
                                "sparsest_block": int(blocks.argmin()),
                                "keep_densest_block": float(blocks.max()),
                                "densest_block": int(blocks.argmax()),
                            }
                        )
    return rows


def print_tables(rows: list[dict]) -> None:
    """Per step and theta: one line per box, the mean keep of each method and q_tile (o = oracle, r = rule,
    p = predictor, then the q_tile; *_min: the sparsest block's, for q_tile 64)."""
    for step in sorted({r["step"] for r in rows}):
        for theta in THETAS:
            sel = [r for r in rows if r["step"] == step and r["theta"] == theta]
            table, columns = {}, {}
            for r in sorted(sel, key=lambda r: (METHODS.index(r["method"]), r["q_tile"])):
                line = table.setdefault(r["box"], {"box": r["box"], "tokens": r["box_tokens"]})
                col = f"{r['method'][0]}{r['q_tile']}"
                line[col] = r["keep"]
                columns[col] = True
                if r["q_tile"] == 64:
                    line[col + "_min"] = r["keep_sparsest_block"]
                    columns[col + "_min"] = True
            print(f"\nstep {step}: keep ratio holding {theta:.0%} of the attention mass (mean over blocks and heads)")
            print_table(sorted(table.values(), key=lambda x: (x["tokens"], x["box"])), ["box", "tokens", *columns])


def plot(rows: list[dict], path: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    steps = sorted({r["step"] for r in rows})
    boxes = sorted({r["box"] for r in rows}, key=lambda b: (int(np.prod(parse_box(b))), b))
    fig, axes = plt.subplots(
        len(THETAS), len(steps), figsize=(5.2 * len(steps), 3.8 * len(THETAS)), squeeze=False, sharey=True
    )
    styles = {"oracle": "-", "rule": "--", "predictor": ":"}
    for i, theta in enumerate(THETAS):
        for j, step in enumerate(steps):
            ax = axes[i][j]
            sel = [r for r in rows if r["step"] == step and r["theta"] == theta]
            q_tiles = sorted({r["q_tile"] for r in sel})
            for c, qt in enumerate(q_tiles):
                for method, ls in styles.items():
                    pts = {r["box"]: r["keep"] for r in sel if r["q_tile"] == qt and r["method"] == method}
                    if not pts or (qt == 1 and method != "oracle"):
                        continue
                    x = [k for k, b in enumerate(boxes) if b in pts]
                    ax.plot(
                        x,
                        [pts[boxes[k]] for k in x],
                        ls=ls,
                        marker="o",
                        ms=3,
                        color="k" if qt == 1 else f"C{c}",
                        label=f"{method}, {'each query' if qt == 1 else f'q_tile {qt}'}",
                    )
            floor = [r["keep"] for r in sel if r["q_tile"] == 1 and r["method"] == "oracle" and r["box"] == "1"]
            if floor:
                ax.axhline(floor[0], color="grey", lw=0.8, label="floor: each query's own best tokens")
            ax.set_xticks(range(len(boxes)), boxes, rotation=45, fontsize=8)
            ax.set_xlabel("KV box (tokens t x h x w)")
            ax.set_title(f"step {step}: {theta:.0%} of the mass", fontsize=9)
            ax.grid(alpha=0.3)
        axes[i][0].set_ylabel("keep ratio (mean over blocks, heads)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return save_figure(fig, path)


# -- the study -------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny CPU run")
    p.add_argument("--workdir", help="checkpoints and records (default runs/granularity; quick: a temp dir)")
    p.add_argument("--tokens", type=int, help="tokens per sample (default 16384; quick 256)")
    p.add_argument("--steps", type=int, help="training steps (default 1500; quick 4)")
    p.add_argument("--measure-at", help="steps to measure at, comma separated (default 500,1500; quick 2,4)")
    p.add_argument("--every", type=int, help="steps per training round and checkpoint (default 250; quick 2)")
    p.add_argument("--profile-every", type=int, help="DSV profile steps of training (default 50; quick 2)")
    p.add_argument("--t", help="noise levels (default 0.2,0.8; quick 0.5)")
    p.add_argument("--batches", type=int, default=2, help="held-out batches per noise level")
    p.add_argument("--boxes", default=",".join(BOXES), help="KV boxes TxHxW inside the tile ('1': a token)")
    p.add_argument("--q-tiles", default="1,32,64,128", help="query tiles (consecutive tokens); 1: single queries")
    p.add_argument("--windows", type=int, default=16, help="sampled windows of max(--q-tiles) queries per sample")
    p.add_argument("--heads-per-step", type=int, default=4, help="(sample, head) pairs analysed at once")
    p.add_argument("--q1-rows", type=int, default=256, help="sampled rows that the single-query (q_tile 1) use")
    p.add_argument("--tokens-per-batch", type=int, help="equal-token batching (default 32768; quick 512)")
    p.add_argument("--lr", type=float, help="model learning rate (default 5e-4; quick 1e-3)")
    p.add_argument("--predictor-lr", type=float, help="DSV predictor learning rate (default: --lr)")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    p.add_argument("--budget-s", type=float, help="wall-clock budget of the whole script (stops cleanly, saves)")
    p.add_argument("--reserve-s", type=float, default=30.0, help="seconds kept for the last save, JSON and plot")
    p.add_argument("--results-dir", default=RESULTS_DIR, help="where the JSON and plot go")
    p.add_argument("--name", default="granularity", help="results name: <name>.json, <name>.png (quick: _quick)")
    args = p.parse_args(argv)
    quick = args.quick
    args.tokens = args.tokens or (256 if quick else 16384)
    args.steps = args.steps if args.steps is not None else (4 if quick else 1500)
    args.every = args.every or (2 if quick else 250)
    args.profile_every = args.profile_every or (2 if quick else 50)
    args.tokens_per_batch = args.tokens_per_batch or (512 if quick else 32768)
    args.lr = args.lr or (1e-3 if quick else 5e-4)
    args.recall_target = 0.95  # config_for's dsv.recall_target (the controller does not act in stage 1)
    try:
        args.measure_at = sorted({int(v) for v in (args.measure_at or ("2,4" if quick else "500,1500")).split(",")})
        args.t = [float(v) for v in (args.t or ("0.5" if quick else "0.2,0.8")).split(",")]
        args.q_tiles = sorted({int(v) for v in args.q_tiles.split(",")})
    except ValueError as e:
        p.error(f"--measure-at, --t and --q-tiles take comma-separated numbers: {e}")
    try:
        args.boxes = [box_name(parse_box(b)) for b in args.boxes.split(",")]
    except ValueError as e:
        p.error(f"--boxes: {e}")
    if any(s < 1 or s > args.steps for s in args.measure_at):
        p.error(f"--measure-at {args.measure_at}: every step must be in 1..--steps ({args.steps})")
    if min(args.q_tiles) < 1 or min(args.windows, args.q1_rows, args.batches, args.heads_per_step) < 1:
        p.error("--q-tiles, --windows, --q1-rows, --batches and --heads-per-step must be positive")
    if quick:
        args.set = ["model.tile=[4,4,4]"] + args.set  # the study's tile (the quick runs' default is 2x4x4)
    return args


def main(argv=None) -> int:
    from dsv_jax.dsv.profiler import RECALL_FRACTIONS
    from experiments.sparsity_emergence import StopAtBudget, config_for, load_records, run_rounds, trainer_logging

    args = parse_args(argv)
    cfg, overrides = config_for(args, args.tokens)  # bad input fails here, before any compile
    measurement = Measurement(args)
    shape = tuple(cfg.data.buckets[0])
    layout, rows = measurement.geometry(cfg, shape)
    contig = {b: {o: contiguity(parse_box(b), layout.tile, o) for o in ORDERS} for b in args.boxes}
    first_tile = layout.coords[: layout.tile_size]  # tile 0 sits at the origin
    today = next((o for o in ORDERS if np.array_equal(in_tile_order(layout.tile, o), first_tile)), None)
    trainer_logging()
    budget = StopAtBudget(args.budget_s, args.reserve_s)
    workdir = args.workdir or (
        tempfile.mkdtemp(prefix="granularity_") if args.quick else os.path.join("runs", "granularity")
    )
    os.makedirs(workdir, exist_ok=True)
    name = args.name + ("_quick" if args.quick else "")
    records_path = os.path.join(workdir, "records.json")
    runs = load_records(records_path)

    from dsv_jax.train.trainer import Trainer

    s = args.tokens
    trainer = Trainer(cfg, os.path.join(workdir, f"s{s}"), progress=False)
    run = runs.setdefault(str(s), {"records": {}})
    run.update(shape=list(shape), config_overrides=overrides, workdir=trainer.workdir)

    def save():
        with open(records_path, "w") as f:
            json.dump(runs, f)
        rows_ = summary_rows(run["records"])
        path = write_results(
            name,
            {
                "device": device_info(),
                "args": vars(args),
                "shape": list(shape),
                "tokens": int(layout.n_real),
                "grid": list(layout.grid),
                "tile": list(layout.tile),
                "query_rows_per_sample": len(rows),
                "thetas": list(THETAS),
                "methods": list(METHODS),
                "q_tiles": args.q_tiles,
                "boxes": args.boxes,
                "in_tile_order_today": today,
                "contiguity": contig,
                "wall_s": budget.elapsed(),
                "budget_expired": budget.expired,
                "rows": rows_,
                "train": run.get("train", []),
                "recall_fractions": list(RECALL_FRACTIONS),
                "records": {step: compact(r) for step, r in run["records"].items()},
            },
            args.results_dir,
        )
        return path, rows_

    def measured(s, trainer, run):
        step = int(trainer.state.step)
        record = measurement(trainer.cfg, trainer.graphdef, trainer.state.params, shape)
        keep = [r["keep"]["0.9"]["oracle"] for r in record["t"].values()]
        floor = np.mean([k["1"]["1"] for k in keep]) if "1" in keep[0] and "1" in keep[0]["1"] else float("nan")
        print(
            f"S={s} step {step}: measured in {record['measure_s']:.0f} s (warm ~{record['warm_estimate_s']:.0f} s)"
            f"; each query's best tokens @90%: {floor:.3f} ({budget.elapsed():.0f} s)",
            flush=True,
        )
        return record

    targets = sorted(set(range(args.every, args.steps + 1, args.every)) | set(args.measure_at) | {args.steps})
    try:
        run_rounds(
            {s: trainer},
            runs,
            targets,
            budget,
            measured,
            save,
            measure_at=set(args.measure_at),
            measure_cost=lambda s: measurement.warm_s,
        )
    finally:
        trainer.close()
    path, rows_ = save()
    if rows_:
        print_tables(rows_)
    aligned = {o: [b for b in args.boxes if contig[b][o]["aligned"]] for o in ORDERS}
    print(f"boxes that are aligned contiguous ranges, per in-tile order (today's: {today}): {aligned}")
    figure = plot(rows_, os.path.join(args.results_dir, f"{name}.png")) if rows_ else None
    print("wrote", path, figure or "", f"({budget.elapsed():.0f} s{', budget reached' if budget.expired else ''})")
    if args.quick and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
