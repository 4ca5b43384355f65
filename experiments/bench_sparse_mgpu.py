"""Check and time the Mosaic GPU (Hopper) block-sparse attention against cuDNN (and the Triton path).

    python -m experiments.bench_sparse_mgpu [--seqs 32768 65536] [--sparsities 0.9 0.95] [--budget-s 540]
    python -m experiments.bench_sparse_mgpu --rows 64,16,32,1 --seqs 65536 --no-small-check --budget-s 300
    python -m experiments.bench_sparse_mgpu --quick      # CPU: the kernels in jax's GPU interpreter, tiny sizes

--rows: one row per KV granularity, side by side with cuDNN in one run (written to
bench_sparse_mgpu_granularity.json): 16, 32 and 64 are the Mosaic GPU kernels at 128-row query tiles; 1 is
token level (32-query groups, each keeping a multiple of 256 tokens, as the DSV authors' kernel), run on
whatever path `sparse_attention(impl="auto")` picks for it (recorded as `path`). Without --rows, each of
--variants (tunings or geometries of the Mosaic GPU path) is a row.

Per sequence length S (B=1, H=16, D=128, bf16) and row, at each sparsity every tile keeps
round((1 - sparsity) * S / kv_block) blocks, from two sources (--blocks), each its own line in the JSON
(`"blocks"`):
  uniform   uniformly random blocks (harness.random_selection, no local band);
  selector  the blocks `lowrank_topk` (rank 16) picks on random normal q_lr, k_lr: what the selection
            hands the kernels in "selection + fwd + bwd". On such inputs its picks are not random: a block
            whose mean key is long wins in many tiles, so the reads gather on fewer blocks (`reads`).
Per line:
  reads     how the KV blocks are read, per head: `distinct` blocks read by some tile (mean over heads) and
            their share of all; `cv`, the coefficient of variation of the number of tiles that read each block,
            and `cv_vs_uniform`, that over a uniform choice's (binomial) cv; `effective_share`, (sum of
            reads)^2 / (sum of squared reads) over the number of blocks (1: every block read equally often);
  check     before timing, the compiled fwd+bwd on exactly these inputs against the plain-JAX reference on
            a sample: `check_heads` heads, per head `check_tiles` query tiles (o, dq) and `check_blocks` KV
            blocks (dk, dv: with every tile that reads them, at most `check_max_tiles`); relative Frobenius
            errors, `max_err`; a line that fails is not timed;
  times     fwd and fwd+bwd (jax.vjp), the kernels as separate calls (`parts`, Mosaic GPU path), and with
            the selector the selection alone and selection + fwd + bwd compiled as one program; kept-work
            TFLOP/s (fwd 4 B H S kept D, fwd+bwd 3.5x that) and its ratio to cuDNN's rate, speedups over
            cuDNN's fwd+bwd of the same run.
Timing (harness.time_fn with `calls`): every program, cuDNN's and the sparse ones alike, gets --warmup
blocked calls, then --reps repetitions of exactly --calls back-to-back calls blocked once; median, min, max.

Each row (its sparsities and sources) runs in a child process that reports every finished line as it
goes; each stage (inputs, compile and check, timing, ...) is watched by a timer (--job-timeout-s) that ends
the child when it runs past it. A line whose child crashed or timed out is recorded with its `status`
("crashed" / "timed out"), the `stage` and the tail of the child's output, and a new child goes on with the
row's other lines; no line starts past --budget-s (counted from the process start; the rest: `skipped`).
Writes experiments/results/bench_sparse_mgpu.json (--rows: _granularity; --quick: _quick; and $OUT/ when
set); prints a table last.
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import faulthandler
import functools
import json
import os
import re
import time

import jax  # imported, not started: the parent process never touches the GPU, its children do
import jax.numpy as jnp
import numpy as np

from dsv_jax.model.flops import ATTENTION_FWD_BWD, attention_flops
from experiments import harness
from experiments.harness import error_text
from pallas_kernels.sparse_attention_reference import dense_masked_reference

HEADS, HEAD_DIM, Q_TILE, KV_BLOCK = 16, 128, 64, 64
RANK = 16  # of the low-rank q, k the selection scores (DSV's predictor rank)
SOURCES = ("uniform", "selector")  # where a line's KV blocks come from (the module docstring)
# how every program is timed (harness.time_fn with a fixed number of calls); a job's "timing" overrides it
TIMING = {"warmup": 2, "reps": 5, "calls": 4}
# the sampled check of every line (the module docstring); a job's "check" overrides it
CHECK = {"heads": 2, "tiles": 4, "blocks": 2, "max_tiles": 256}
# --quick (CPU): tiny sizes; every sparse row on sparse_attention's path off a GPU (the XLA reference)
QUICK = {"seqs": [512], "heads": 2, "head_dim": 64, "rows": "64,16,1", "timing": {"warmup": 1, "reps": 2, "calls": 2}}

GEOMETRY_KEYS = ("q_tile", "kv_block")  # variant keys that set the selection's geometry, not the kernels' tuning


def set_geometry(options: dict) -> dict:
    """A child process's variant: its q_tile / kv_block (if any) become this process's Q_TILE / KV_BLOCK;
    returns the remaining options (the kernels' tuning)."""
    global Q_TILE, KV_BLOCK
    options = dict(options)
    Q_TILE, KV_BLOCK = options.pop("q_tile", Q_TILE), options.pop("kv_block", KV_BLOCK)
    return options


def kept_blocks(seq, sparsity, kv_block, multiple=1):
    """Blocks each tile keeps: round((1 - sparsity) * blocks), rounded up to a multiple of `multiple` (the
    DSV authors' token lists: 256)."""
    n = max(1, round((1.0 - sparsity) * (seq // kv_block)))
    return min(-(-n // multiple) * multiple, seq // kv_block)


def uniform_selection(seq, top_k, heads=None, q_tile=None, kv_block=None, seed=0):
    """index [1, H, tiles, top_k] (ascending) and count [1, H, tiles] (all top_k): uniformly random blocks."""
    q_tile, kv_block, heads = q_tile or Q_TILE, kv_block or KV_BLOCK, heads or HEADS
    key = jax.random.fold_in(jax.random.key(seed), 1)
    return harness.random_selection(
        key, seq=seq, heads=heads, q_tile=q_tile, kv_block=kv_block, keep=top_k / (seq // kv_block), local_share=0.0
    )


def lowrank_inputs(seq, heads=None, seed=7):
    """Random normal q_lr, k_lr [1, S, H, RANK] (bf16): what the selector scores."""
    k_q, k_k = jax.random.split(jax.random.key(seed))
    return tuple(jax.random.normal(key, (1, seq, heads or HEADS, RANK), jnp.bfloat16) for key in (k_q, k_k))


def inputs(seq, sparsity, heads=None, head_dim=None, q_tile=None, kv_block=None, seed=0, multiple=1):
    """q, k, v, cotangent (bf16 normal) and a uniformly random selection (ascending ids, full counts of
    `kept_blocks`)."""
    q_tile, kv_block = q_tile or Q_TILE, kv_block or KV_BLOCK
    heads, head_dim = heads or HEADS, head_dim or HEAD_DIM
    q, k, v, w = harness.random_qkv(jax.random.key(seed), seq, heads, head_dim)
    top_k = kept_blocks(seq, sparsity, kv_block, multiple)
    index, count = uniform_selection(seq, top_k, heads, q_tile, kv_block, seed)
    return q, k, v, w, index, count


def timed(fn, *args):
    """harness.time_fn with this process's TIMING: ms per call, the same method for every program."""
    return harness.time_fn(fn, *args, warmup=TIMING["warmup"], iters=TIMING["reps"], calls=TIMING["calls"])


@functools.partial(jax.jit, static_argnames="num_blocks")
def _reads_per_head(index, count, num_blocks):
    """Per head: distinct blocks read, cv of the reads per block, effective share, mean reads per block."""
    _, h, _, k = index.shape
    live = (jnp.arange(k) < count[..., None]).astype(jnp.float32)
    flat = lambda x: jnp.moveaxis(x, 1, 0).reshape(h, -1)
    reads = jax.vmap(lambda i, w: jnp.zeros(num_blocks, jnp.float32).at[i].add(w))(flat(index), flat(live))
    mean = jnp.mean(reads, axis=1)
    return (
        jnp.sum(reads > 0, axis=1),
        jnp.std(reads, axis=1) / jnp.maximum(mean, 1e-30),
        jnp.sum(reads, axis=1) ** 2 / jnp.maximum(jnp.sum(reads**2, axis=1), 1e-30) / num_blocks,
        mean,
    )


def block_reads(index, count, num_blocks: int) -> dict:
    """How a selection reads the KV blocks, per head (means over heads; see the module docstring): distinct
    blocks read, their share, the cv of the reads per block and that over a uniform choice's, the effective
    share. index [B, H, T, K], count [B, H, T]."""
    distinct, cv, effective, mean = (np.asarray(x, np.float64) for x in _reads_per_head(index, count, num_blocks))
    tiles = index.shape[0] * index.shape[2]
    p = np.clip(mean / tiles, 1e-12, 1.0)  # a block's chance to be in one tile's list
    uniform_cv = np.sqrt((1.0 - p) / np.maximum(tiles * p, 1e-30))  # binomial(tiles, p)
    return {
        "distinct": float(distinct.mean()),
        "distinct_share": float(distinct.mean() / num_blocks),
        "cv": float(cv.mean()),
        "cv_vs_uniform": float(np.mean(cv / np.maximum(uniform_cv, 1e-30))) if (uniform_cv > 0).all() else None,
        "effective_share": float(effective.mean()),
    }


SMALL_CASES = [  # (q_tile, kv_block, D, masked): both list modes of every kernel, both head dims
    (64, 64, 128, False),
    (64, 64, 64, True),
    (128, 128, 128, True),
    (128, 64, 64, False),
    (64, 192, 128, True),
]
SMALL_CASES_FINE = [  # the 16- and 32-row blocks: both list modes of the forward and dQ, both head dims
    (128, 16, 128, True),
    (64, 16, 64, False),
    (128, 32, 128, False),
    (64, 32, 128, True),
]


def small_check(options=None, cases=None, seq=1536):
    """The compiled kernels at S=1536 (seq), H=2 against dense_masked_reference: random counts including empty
    tiles, random kv_valid including empty blocks, lse with its cotangent. Errors per case. `options`:
    tuning of the Mosaic GPU path (a variant's); cases: (q_tile, kv_block, D, masked) (default SMALL_CASES).
    Off a GPU the kernels run in jax's GPU interpreter."""
    from pallas_kernels.sparse_attention_mgpu import check_smem, default_config, sparse_attention_mgpu

    b, s, h = 1, seq, 2
    rows = []
    for case, (q_tile, kv_block, d, masked) in enumerate(cases or SMALL_CASES):
        row = {"q_tile": q_tile, "kv_block": kv_block, "head_dim": d, "masked": masked}
        try:  # a tuning made for one geometry (e.g. 128-row steps at q_tile 128) may not fit another's SMEM
            check_smem(default_config(q_tile, kv_block, d, 1.0, tuning=options))
        except ValueError as e:
            rows.append({**row, "skipped": str(e)})
            continue
        try:
            ks = jax.random.split(jax.random.key(100 + case), 8)
            q, k, v = (jax.random.normal(k_, (b, s, h, d), jnp.bfloat16) for k_ in ks[:3])
            tiles, blocks = s // q_tile, s // kv_block
            n_sel = max(1, blocks // 3)
            index = jnp.sort(jax.lax.top_k(jax.random.uniform(ks[3], (b, h, tiles, blocks)), n_sel)[1], axis=-1)
            count = jax.random.randint(ks[4], (b, h, tiles), 0, n_sel + 1).at[:, :, 0].set(0)
            kv_valid = jax.random.randint(ks[5], (b, blocks), 0, kv_block + 1).at[:, 1].set(0) if masked else None
            wo = jax.random.normal(ks[6], (b, s, h, d))
            wl = jax.random.normal(ks[7], (b, h, s))
            scale = d**-0.5

            def loss(fn):
                def f(q, k, v):
                    o, lse = fn(q, k, v)
                    lse_term = jnp.where(jnp.isfinite(lse), lse * wl, 0.0)
                    return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(lse_term), (o, lse)

                return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

            kernel = loss(
                lambda q, k, v: sparse_attention_mgpu(
                    q,
                    k,
                    v,
                    index,
                    count,
                    q_tile=q_tile,
                    kv_block=kv_block,
                    kv_valid=kv_valid,
                    return_lse=True,
                    tuning=options or None,
                    interpret=not harness.on_gpu(),
                )
            )
            ref = loss(
                lambda q, k, v: dense_masked_reference(
                    q, k, v, index, count, kv_valid, q_tile=q_tile, kv_block=kv_block, sm_scale=scale
                )
            )
            (_, got), got_g = kernel(q, k, v)
            (_, want), want_g = ref(*(x.astype(jnp.float32) for x in (q, k, v)))
            for name, a, w in zip(["o", "lse", "dq", "dk", "dv"], [*got, *got_g], [*want, *want_g]):
                a, w = np.asarray(a, np.float64), np.asarray(w, np.float64)
                fin = np.isfinite(w)
                same = (np.isfinite(a) == fin).all()
                a, w = np.where(fin, a, 0.0), np.where(fin, w, 0.0)
                row[name] = (
                    float(np.linalg.norm(a - w) / max(np.linalg.norm(w), 1e-30)) if same else "nonfinite mismatch"
                )
            row["ok"] = all(
                isinstance(row[n], float) and row[n] < (1e-4 if n == "lse" else 2e-2)
                for n in ["o", "lse", "dq", "dk", "dv"]
            )
        except Exception as e:
            row["ok"] = False
            row["error"] = error_text(e, trace=True)
        rows.append(row)
    return rows


# -- the programs a line times -----------------------------------------------------------------------------


def attend_fn(impl, options=None):
    """attend(q, k, v, index, count) -> o of a sparse path: "mgpu" (the Mosaic GPU kernels with `options` as
    their tuning; off a GPU in jax's GPU interpreter), "auto" (whatever sparse_attention picks on this device:
    kernel_path) or "triton" (the Pallas Triton lowering)."""
    interpret = not harness.on_gpu()
    if impl == "auto":
        from pallas_kernels.sparse_attention import sparse_attention

        return lambda q, k, v, index, count: sparse_attention(q, k, v, index, count, q_tile=Q_TILE, kv_block=KV_BLOCK)
    if impl == "triton":
        from pallas_kernels.sparse_attention_triton import sparse_attention_pallas
        from pallas_kernels.tuning import for_device

        return lambda q, k, v, index, count: sparse_attention_pallas(
            q,
            k,
            v,
            index,
            count,
            q_tile=Q_TILE,
            kv_block=KV_BLOCK,
            sm_scale=q.shape[-1] ** -0.5,
            tuning=for_device()[0],
            interpret=interpret,
        )
    if impl != "mgpu":
        raise ValueError(f"impl={impl!r} is not one of 'mgpu', 'auto', 'triton'")
    from pallas_kernels.sparse_attention_mgpu import sparse_attention_mgpu

    return lambda q, k, v, index, count: sparse_attention_mgpu(
        q, k, v, index, count, q_tile=Q_TILE, kv_block=KV_BLOCK, tuning=options or None, interpret=interpret
    )


def dense_fns():
    """(fwd(q, k, v), fwd_bwd(q, k, v, w)) of full attention, jitted: cuDNN on a GPU (XLA's on a CPU)."""
    implementation = "cudnn" if harness.on_gpu() else None
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=implementation)
    return jax.jit(attend), jax.jit(harness.fwd_bwd(attend))


def attention_fns(impl, options=None):
    """(fwd(q, k, v, index, count), fwd_bwd(q, k, v, index, count, w) -> (o, (dq, dk, dv))) of a sparse path,
    jitted; the selection is an argument, so every source of blocks at one top_k runs the same programs."""
    attend = attend_fn(impl, options)
    return jax.jit(attend), jax.jit(harness.fwd_bwd(attend, 3))


def select_fn(top_k):
    """select(q_lr, k_lr) -> index [1, H, tiles, top_k]: lowrank_topk at this process's geometry, jitted."""
    from pallas_kernels.lowrank_topk import lowrank_topk

    return jax.jit(lambda q_lr, k_lr: lowrank_topk(q_lr, k_lr, top_k, q_tile=Q_TILE, kv_block=KV_BLOCK))


def select_attend_fn(top_k, impl, options=None):
    """step(q, k, v, w, q_lr, k_lr): the selection then fwd+bwd of the path on its blocks, one program (the
    issue's "selection + fwd + bwd")."""
    attend, select = attend_fn(impl, options), select_fn(top_k)

    @jax.jit
    def step(q, k, v, w, q_lr, k_lr):
        ids = select(q_lr, k_lr)
        count = jnp.full(ids.shape[:3], top_k, jnp.int32)
        return harness.fwd_bwd(lambda q, k, v: attend(q, k, v, ids, count))(q, k, v, w)

    return step


# -- the sampled check -------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("q_tile", "kv_block"))
def reference_tiles(qh, kh, vh, wh, tiles, valid, index, count, block_rows, *, q_tile, kv_block):
    """The plain-JAX reference of one head over some query tiles, in float32 at full precision: qh, kh, vh, wh
    [S, D]; tiles [n] with valid [n] (invalid ones: any tile, cotangent 0, so they add nothing); index [n, K]
    and count [n] their lists; block_rows [m, kv_block] the key rows whose gradients are wanted. Returns o and
    dq of the tiles' rows [n, q_tile, D], dk and dv of block_rows [m, kv_block, D]: exact where every tile
    that reads those rows is among the valid ones."""
    scale = qh.shape[-1] ** -0.5
    n_sel = index.shape[-1]
    rows = tiles[:, None] * q_tile + jnp.arange(q_tile)  # [n, q_tile]
    dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)

    def attend(qh, kh, vh):
        def one(args):
            r, ids, c = args
            keys = (ids[:, None] * kv_block + jnp.arange(kv_block)).reshape(-1)
            live = jnp.repeat(jnp.arange(n_sel) < c, kv_block)
            s = jnp.where(live[None], dot(qh[r], kh[keys].T) * scale, -jnp.inf)
            return dot(jax.nn.softmax(s, axis=-1), vh[keys])

        return jax.lax.map(one, (rows, index, count), batch_size=8)

    o, pullback = jax.vjp(attend, qh, kh, vh)
    dq, dk, dv = pullback(jnp.where(valid[:, None, None], wh[rows], 0.0))
    return o, dq[rows], dk[block_rows], dv[block_rows]


def check_plan(index_h, count_h, num_blocks, rng, *, tiles, blocks, max_tiles):
    """Which query tiles and KV blocks one head's check covers: `tiles` random tiles, then up to `blocks` KV
    blocks (one at random among those read, then the least read, alternately) with every tile that reads them,
    while the tiles stay within max_tiles. index_h [T, K], count_h [T] (numpy). -> (tile ids, block ids)."""
    n_tiles, n_sel = index_h.shape
    live = np.arange(n_sel)[None] < count_h[:, None]
    reads = np.bincount(index_h[live], minlength=num_blocks)
    chosen_tiles = set(rng.choice(n_tiles, min(tiles, n_tiles), replace=False).tolist())
    read = np.flatnonzero(reads)
    pools = [rng.permutation(read)[:64], read[np.argsort(reads[read], kind="stable")][:64]]
    chosen_blocks = []
    for i in range(blocks):
        for b in pools[i % 2]:
            if b in chosen_blocks:
                continue
            users = set(np.flatnonzero(((index_h == b) & live).any(axis=1)).tolist())
            if len(chosen_tiles | users) <= max_tiles:
                chosen_blocks.append(int(b))
                chosen_tiles |= users
                break
    return sorted(chosen_tiles), chosen_blocks


def sampled_check(q, k, v, w, index, count, got, *, heads, tiles, blocks, max_tiles, seed=0):
    """The compiled path's outputs `got` = (o, dq, dk, dv) on q, k, v, cotangent w and this selection against
    reference_tiles on a sample (check_plan per head, `heads` random heads): relative Frobenius errors of o
    and dq over the sampled tiles' rows and of dk and dv over the sampled blocks' rows, summed over the heads.
    -> {"errors", "max_err", "finite", "correct", "heads", "tiles", "blocks"} (tiles, blocks: checked, all
    heads)."""
    _, seq, n_heads, _ = q.shape
    num_blocks = seq // KV_BLOCK
    cap = min(max_tiles, seq // Q_TILE)
    rng = np.random.default_rng(seed)
    picked = sorted(rng.choice(n_heads, min(heads, n_heads), replace=False).tolist())
    num, den = np.zeros(4), np.zeros(4)
    finite, n_tiles, n_blocks = True, 0, 0
    for h in picked:
        index_h, count_h = np.asarray(index[0, h]), np.asarray(count[0, h])
        tile_ids, block_ids = check_plan(index_h, count_h, num_blocks, rng, tiles=tiles, blocks=blocks, max_tiles=cap)
        n_tiles, n_blocks = n_tiles + len(tile_ids), n_blocks + len(block_ids)
        pad = lambda ids, n: np.asarray(ids + [ids[0]] * (n - len(ids)), np.int32)
        t = pad(tile_ids, cap)
        valid = np.arange(cap) < len(tile_ids)
        b = pad(block_ids or [0], blocks)
        block_rows = b[:, None] * KV_BLOCK + np.arange(KV_BLOCK)
        part = lambda x: x[0, :, h].astype(jnp.float32)
        want = reference_tiles(
            part(q),
            part(k),
            part(v),
            part(w),
            t,
            valid,
            index_h[t],
            count_h[t],
            block_rows,
            q_tile=Q_TILE,
            kv_block=KV_BLOCK,
        )
        rows = t[:, None] * Q_TILE + np.arange(Q_TILE)
        mine = [got[0][0, rows, h], got[1][0, rows, h], got[2][0, block_rows, h], got[3][0, block_rows, h]]
        masks = [valid, valid, np.arange(blocks) < len(block_ids), np.arange(blocks) < len(block_ids)]
        for i, (a, ref, m) in enumerate(zip(mine, want, masks)):
            a, ref = np.asarray(a, np.float64)[m], np.asarray(ref, np.float64)[m]
            finite = finite and bool(np.isfinite(a).all())
            num[i] += np.sum((a - ref) ** 2)
            den[i] += np.sum(ref**2)
    errors = {name: (float(np.sqrt(n / d)) if d > 0 else None) for name, n, d in zip(["o", "dq", "dk", "dv"], num, den)}
    worst = max((e for e in errors.values() if e is not None), default=float("inf"))
    ok = errors["o"] is not None and errors["o"] < 1e-2 and worst < 2e-2
    return {
        "errors": errors,
        "max_err": worst,
        "finite": finite,
        "correct": bool(finite and ok and n_blocks > 0),
        "heads": picked,
        "tiles": n_tiles,
        "blocks": n_blocks,
    }


@functools.lru_cache(maxsize=None)
def piece_programs(seq, q_tile, kv_block, head_dim, options_json, interpret):
    """The Mosaic GPU path's kernels as separate jitted programs at one geometry, the selection an argument
    (so that every source of blocks reuses them): (cfg, {name: (fn, products)})."""
    from pallas_kernels import sparse_attention_mgpu as mgpu
    from pallas_kernels import sparse_attention_mgpu_bwd as bwd
    from pallas_kernels import sparse_attention_mgpu_fused as fused
    from pallas_kernels import sparse_attention_mgpu_fwd as fwd
    from pallas_kernels.mgpu_common import ROWS

    if kv_block < ROWS:  # 16- or 32-row blocks: their own dK/dV kernel (the forward and dQ are shared)
        from pallas_kernels import sparse_attention_mgpu_fine as dkdv_kernels
    else:
        dkdv_kernels = bwd
    options = json.loads(options_json)
    cfg = mgpu.default_config(q_tile, kv_block, head_dim, head_dim**-0.5, interpret=interpret, tuning=options)
    mgpu.check_smem(cfg)
    programs = {"fwd": (jax.jit(lambda q, k, v, index, count: fwd.forward(q, k, v, index, count, None, cfg)), 2)}
    if cfg.fuses_backward:
        programs["fused"] = (
            jax.jit(
                lambda q, k, v, w, lse2, delta, index, count: fused.backward(
                    q, k, v, w, lse2, delta, index, count, None, cfg
                )
            ),
            5,
        )
        return cfg, programs
    programs["worklist"] = (jax.jit(lambda index, count: mgpu.dkdv_schedule(index, count, cfg, seq)), 0)
    programs["dq"] = (
        jax.jit(lambda q, k, v, w, lse2, delta, index, count: bwd.dq(q, k, v, w, lse2, delta, index, count, None, cfg)),
        3,
    )
    programs["dkdv"] = (
        jax.jit(
            lambda q, k, v, w, lse2, delta, tiles, starts, blocks: dkdv_kernels.dkdv(
                q, k, v, w, lse2, delta, tiles, starts, blocks, None, cfg
            )
        ),
        4,
    )
    return cfg, programs


def pieces(q, k, v, w, index, count, options, interpret=False):
    """The Mosaic GPU path's pieces as separate jitted calls at this process's geometry: [(name, fn, args,
    products)] for the forward kernel, the transposed index and its block order (dkdv_schedule), the dQ
    kernel and the dK/dV kernel, or with a fused backward (options' fused_backward at 16- or 32-row blocks)
    the forward and that one kernel; products: the 64 x 64 x D products each runs per (query tile, KV block)
    pair (the forward 2, dQ 3 as it recomputes S and dP, dK/dV 4, the fused backward 5). The programs are
    compiled once per geometry and tuning (piece_programs): another selection of the same shape reuses them."""
    from pallas_kernels.sparse_index import sanitize_index

    seq, head_dim = q.shape[1], q.shape[-1]
    options_json = json.dumps(options or {}, sort_keys=True)
    _, programs = piece_programs(seq, Q_TILE, KV_BLOCK, head_dim, options_json, interpret)
    index, count = sanitize_index(index, count, seq // KV_BLOCK)
    forward, _ = programs["fwd"]
    o, lse2 = forward(q, k, v, index, count)
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), w.astype(jnp.float32))
    grads_in = (q, k, v, w, lse2, delta)
    calls = [("fwd", forward, (q, k, v, index, count), 2)]
    if "fused" in programs:
        return calls + [("fused", programs["fused"][0], (*grads_in, index, count), 5)]
    worklist = programs["worklist"][0]
    tiles, starts, blocks = worklist(index, count)
    return calls + [
        ("worklist", worklist, (index, count), 0),
        ("dq", programs["dq"][0], (*grads_in, index, count), 3),
        ("dkdv", programs["dkdv"][0], (*grads_in, tiles, starts, blocks), 4),
    ]


def parts(q, k, v, w, index, count, options, interpret=False):
    """Median ms of each of `pieces` (timed as everything else: `timed`), the kernels' kept-work TFLOP/s as
    executed and that rate's fraction of the bf16 matmul ceiling (harness.H200_BF16_MAX_TFLOPS)."""
    b, seq, heads, head_dim = q.shape
    unit = 2.0 * b * heads * seq * float(count[0, 0, 0]) * KV_BLOCK * head_dim  # one product, all heads
    out = {}
    for name, fn, args, products in pieces(q, k, v, w, index, count, options, interpret):
        t = timed(fn, *args)
        out[name + "_kernel_ms"] = t["median_ms"]
        if products:
            out[name + "_executed_tflops"] = products * unit / t["median_ms"] / 1e9
            out[name + "_of_ceiling"] = out[name + "_executed_tflops"] / harness.H200_BF16_MAX_TFLOPS
    return out


def forward_vs_triton(q, k, v, index, count):
    """Forward of the Mosaic GPU path against the Triton path on given inputs (q_tile, kv_block 64):
    relative error of o, then both timed (for experiments/bench_sparse_attention.py)."""
    mgpu, _ = attention_fns("mgpu")
    triton, _ = attention_fns("triton")
    err = harness.rel_error(mgpu(q, k, v, index, count), triton(q, k, v, index, count))
    out = {"ok": bool(err < 1e-2), "o_rel_err_vs_triton": err}
    if out["ok"]:
        b, seq, heads, head_dim = q.shape
        flops = attention_flops(seq, heads, head_dim, float(count.mean()) * KV_BLOCK, b)
        for name, fn in [("mgpu", mgpu), ("triton", triton)]:
            out[f"{name}_fwd_ms"] = timed(fn, q, k, v, index, count)["median_ms"]
            out[f"{name}_fwd_tflops"] = flops / out[f"{name}_fwd_ms"] / 1e9
    return out


@functools.lru_cache(maxsize=None)
def _select(top_k, q_tile, kv_block):  # one jitted selection per top_k and geometry (this process's)
    return select_fn(top_k)


@functools.lru_cache(maxsize=None)
def _select_attend(top_k, impl, options_json, q_tile, kv_block):
    return select_attend_fn(top_k, impl, json.loads(options_json))


# -- a child process: one row's lines, stage by stage --------------------------------------------------------


# Test hook (tests/experiments/test_bench_sparse_mgpu_rows.py): a JSON list of {"fault": "abort" | "hang",
# "stage": name, "key": {items of a line's key}}; a child aborts (as XLA's fatal checks do) or hangs there.
FAULT_ENV = "BENCH_SPARSE_MGPU_TEST_FAULT"


class Stages:
    """A child's progress, answered on stdout as it goes (harness.answer; the parent reads what came before a
    crash too): {"stage": name, "key": the line's key or None} before each stage, {"line": {...}} after each
    finished line. Each stage is watched: one that runs past timeout_s (a hang, in C++ too: a deadlocked
    kernel) dumps the Python stacks to stderr and ends the process (faulthandler)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        faulthandler.enable()

    def __call__(self, name: str, key: dict | None = None):
        harness.answer({"stage": name, "key": key})
        faulthandler.dump_traceback_later(self.timeout_s, exit=True)
        for fault in json.loads(os.environ.get(FAULT_ENV, "[]")):  # tests: a crash or a hang here
            if fault["stage"] == name and all((key or {}).get(k) == v for k, v in fault.get("key", {}).items()):
                os.abort() if fault["fault"] == "abort" else time.sleep(1e9)

    def done(self, line: dict):
        faulthandler.cancel_dump_traceback_later()
        harness.answer({"line": line})


def measure_line(job, key, q, k, v, w, fwd, fwd_bwd, stages, cache) -> dict:
    """One line (a sparsity and a source of blocks) of a sparse row: its selection, how it reads the blocks,
    the sampled check, then its times (see the module docstring). Never raises: an error is recorded."""
    seq, impl = job["seq"], job["impl"]
    options = {k_: v_ for k_, v_ in job.get("options", {}).items() if k_ not in GEOMETRY_KEYS}
    top_k = kept_blocks(seq, key["sparsity"], KV_BLOCK, job.get("keep_multiple", 1))
    line = {**key, "top_k": top_k, "kept_keys": top_k * KV_BLOCK}
    t0 = time.perf_counter()
    try:
        stages("selection", key)
        if key["blocks"] == "uniform":
            index, count = uniform_selection(seq, top_k)
        elif key["blocks"] == "selector":
            if "lowrank" not in cache:
                cache["lowrank"] = lowrank_inputs(seq)
            index = _select(top_k, Q_TILE, KV_BLOCK)(*cache["lowrank"])
            count = jnp.full(index.shape[:3], top_k, jnp.int32)
        else:
            raise ValueError(f"blocks={key['blocks']!r} is not one of {SOURCES}")
        line["reads"] = block_reads(index, count, seq // KV_BLOCK)
        if job.get("check", True):
            stages("compile and check", key)
            o, grads = fwd_bwd(q, k, v, index, count, w)
            line["check"] = sampled_check(q, k, v, w, index, count, (o, *grads), **CHECK)
            del o, grads
            if not line["check"]["correct"]:  # a wrong kernel is reported, not timed
                line["status"] = "FAILED check: not timed"
                return line
        stages("time", key)
        line["fwd"] = timed(fwd, q, k, v, index, count)
        line["fwd_bwd"] = timed(fwd_bwd, q, k, v, index, count, w)
        flops = attention_flops(seq, q.shape[2], q.shape[3], line["kept_keys"], q.shape[0])
        line["fwd_tflops"] = flops / line["fwd"]["median_ms"] / 1e9
        line["fwd_bwd_tflops"] = ATTENTION_FWD_BWD * flops / line["fwd_bwd"]["median_ms"] / 1e9
    except Exception as e:
        line["error"] = error_text(e, trace=True)
        return line
    if job.get("parts") and impl == "mgpu":  # their own failure must not cost the line's timings
        stages("parts", key)
        try:
            line["parts"] = parts(q, k, v, w, index, count, options, interpret=not harness.on_gpu())
        except Exception as e:
            line["parts_error"] = error_text(e, trace=True)
    if job.get("select") and key["blocks"] == "selector" and impl in ("mgpu", "auto"):
        try:
            stages("selection timed", key)
            line["select"] = timed(_select(top_k, Q_TILE, KV_BLOCK), *cache["lowrank"])
            stages("selection + fwd + bwd", key)
            step = _select_attend(top_k, impl, json.dumps(options, sort_keys=True), Q_TILE, KV_BLOCK)
            line["select_fwd_bwd"] = timed(step, q, k, v, w, *cache["lowrank"])
        except Exception as e:
            line["select_error"] = error_text(e, trace=True)
    line["wall_s"] = time.perf_counter() - t0
    return line


def measure_job(job, stages: Stages):
    """Child process: a job's lines in order, each answered when done; stops starting lines at job["deadline"]."""
    global HEADS, HEAD_DIM
    HEADS, HEAD_DIM = job.get("heads", HEADS), job.get("head_dim", HEAD_DIM)
    TIMING.update(job.get("timing", {}))
    CHECK.update(job.get("check_sample", {}))
    impl, seq = job["impl"], job["seq"]
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    if impl == "small_check":
        stages("small check", job["lines"][0])
        cases = [tuple(c) for c in job["cases"]] if "cases" in job else None
        stages.done({**job["lines"][0], **info, "cases": small_check(job.get("options"), cases, seq)})
        return
    set_geometry(job.get("options", {}))
    stages("inputs")
    q, k, v, w = harness.random_qkv(jax.random.key(0), seq, HEADS, HEAD_DIM)
    if impl == "cudnn":
        key = job["lines"][0]
        stages("time", key)
        line = {**key, **info, "kept_keys": seq}
        try:
            fwd, fwd_bwd = dense_fns()
            line["fwd"], line["fwd_bwd"] = timed(fwd, q, k, v), timed(fwd_bwd, q, k, v, w)
            flops = attention_flops(seq, HEADS, HEAD_DIM, seq, 1)
            line["fwd_tflops"] = flops / line["fwd"]["median_ms"] / 1e9
            line["fwd_bwd_tflops"] = ATTENTION_FWD_BWD * flops / line["fwd_bwd"]["median_ms"] / 1e9
        except Exception as e:
            line["error"] = error_text(e, trace=True)
        stages.done(line)
        return
    if impl == "auto":
        from pallas_kernels.sparse_attention import kernel_path

        x = jax.ShapeDtypeStruct((1, seq, HEADS, HEAD_DIM), jnp.bfloat16)
        info["path"] = kernel_path(x, x, x, q_tile=Q_TILE, kv_block=KV_BLOCK)[0]
    options = {k_: v_ for k_, v_ in job.get("options", {}).items() if k_ not in GEOMETRY_KEYS}
    fwd, fwd_bwd = attention_fns(impl, options)
    cache = {}
    for key in job["lines"]:
        if time.time() + 20 > job.get("deadline", float("inf")):
            return  # the parent records the lines left as skipped
        stages.done({**measure_line(job, key, q, k, v, w, fwd, fwd_bwd, stages, cache), **info})


# -- the parent: jobs in child processes, line by line --------------------------------------------------------

WATCHDOG = re.compile(r"Timeout \(\d+:\d\d:\d\d\)!")  # faulthandler's words when a stage ran past its limit
JOB_KEYS = ("seq", "impl", "options", "row", "keep_multiple")  # what a result line keeps of its job


def run_child(job, timeout_s):
    """One job in a child process: (what it answered, why it ended: "" after a clean exit)."""
    return harness.in_child_answers("experiments.bench_sparse_mgpu", ["--job", json.dumps(job)], timeout_s)


def line_key(line: dict) -> dict:
    return {k: line[k] for k in ("sparsity", "blocks") if k in line}


def is_line(line: dict, key: dict) -> bool:
    return all(line.get(k) == v for k, v in key.items())


def run_job(job, budget, stage_timeout_s, runner=None) -> list[dict]:
    """Every line of `job`, child after child: one result per line ({"job": its job's keys, **line}). A child
    that crashes or runs out of time loses the line it was in (recorded with `status` "crashed" / "timed out",
    the `stage` and the child's `error`; every line left, if it died outside a line) and a new child goes on
    with the rest. Lines that no child could start within the budget are recorded as skipped."""
    runner = runner or run_child
    head = {k: job[k] for k in JOB_KEYS if k in job}
    out, pending = [], list(job["lines"])
    while pending:
        if not budget.allows(30):
            break
        t0 = time.perf_counter()
        left = min(budget.left(), 1e6)  # without a budget: no deadline to speak of
        child = {**job, "lines": pending, "deadline": time.time() + left, "stage_timeout_s": stage_timeout_s}
        answers, error = runner(child, left + 30)  # the stages' watchdog ends a stuck child before this
        wall = time.perf_counter() - t0
        done = [a["line"] for a in answers if "line" in a]
        out += [{"job": head, **line} for line in done]
        pending = [key for key in pending if not any(is_line(line, key) for line in done)]
        print(
            f"[{budget.elapsed():5.0f} s] {json.dumps(head)}: {len(done)} lines in {wall:.0f} s"
            + (f"; {error.splitlines()[0][:160]}" if error else ""),
            flush=True,
        )
        if not error:
            break  # finished, or stopped at its deadline (the rest: skipped below)
        last = max((i for i, a in enumerate(answers) if "line" in a), default=-1)
        stage = next((a for a in reversed(answers[last + 1 :]) if "stage" in a), None)
        status = "timed out" if error.startswith(harness.NO_ANSWER) or WATCHDOG.search(error) else "crashed"
        current = stage["key"] if stage and stage["key"] in pending else None
        hit = [current] if current is not None else list(pending)
        for key in hit:
            out.append(
                {"job": head, **key, "status": status, "stage": stage["stage"] if stage else "start", "error": error}
            )
        pending = [key for key in pending if key not in hit]
    out += [{"job": head, **key, "skipped": "time budget"} for key in pending]
    return out


def lines_of(sparsities, sources):
    return [{"sparsity": s, "blocks": b} for s in sparsities for b in sources]


def plan(seqs, sparsities, variants, small_check=True, triton=True, sources=SOURCES):
    """Jobs in order: the small check of each distinct tuning, then per S cuDNN, each variant (tuning or
    geometry of the Mosaic GPU path) at every sparsity and source of blocks, timed in pieces and with the
    selection, and the Triton path on uniform blocks."""
    tunings = []  # the small check compiles each distinct tuning once (it has its own geometries)
    for options in variants:
        tuning = {k: v for k, v in options.items() if k not in GEOMETRY_KEYS}
        if tuning not in tunings:
            tunings.append(tuning)
    small = [{"blocks": "small_check"}]
    jobs = [{"seq": 1536, "impl": "small_check", "options": t, "lines": small} for t in tunings] if small_check else []
    for seq in seqs:
        jobs.append({"seq": seq, "impl": "cudnn", "lines": [{"blocks": "dense"}]})
        for options in variants:
            job = {"seq": seq, "impl": "mgpu", "options": options, "lines": lines_of(sparsities, sources)}
            jobs.append({**job, "parts": True, "select": True})
        if triton:
            jobs.append({"seq": seq, "impl": "triton", "options": {}, "lines": lines_of(sparsities, ["uniform"])})
    return jobs


GRANULARITY_ROWS = {  # --rows: KV granularity -> the path and geometry it is benchmarked on
    64: {"impl": "mgpu", "options": {"q_tile": 128, "kv_block": 64}},
    32: {"impl": "mgpu", "options": {"q_tile": 128, "kv_block": 32}},
    16: {"impl": "mgpu", "options": {"q_tile": 128, "kv_block": 16}},
    1: {"impl": "auto", "options": {"q_tile": 32, "kv_block": 1}, "keep_multiple": 256},
}


def plan_rows(seqs, sparsities, rows, small_check=True, sources=SOURCES, small_seq=1536):
    """Jobs of a --rows run, in the order of `rows` (KV granularities, keys of GRANULARITY_ROWS): the small
    check of the geometries the Mosaic GPU rows use, then per sequence length cuDNN and each row, one job
    (one child process) with a line per sparsity and source of blocks, in pieces where the path has them,
    the selector's lines with the selection."""
    unknown = [r for r in rows if r not in GRANULARITY_ROWS]
    if unknown:
        raise ValueError(f"--rows {unknown}: known rows are {sorted(GRANULARITY_ROWS)}")
    jobs = []
    cases = [c for c in SMALL_CASES_FINE if c[1] in rows]  # kv_block 64's kernels: checked at their size
    if small_check and cases:
        jobs.append(
            {
                "seq": small_seq,
                "impl": "small_check",
                "options": {},
                "cases": [list(c) for c in cases],
                "lines": [{"blocks": "small_check"}],
            }
        )
    for seq in seqs:
        jobs.append({"seq": seq, "impl": "cudnn", "lines": [{"blocks": "dense"}]})
        for row in rows:
            spec = GRANULARITY_ROWS[row]
            job = {"seq": seq, "impl": spec["impl"], "options": dict(spec["options"]), "row": row}
            job.update(lines=lines_of(sparsities, sources), parts=True, select=True)
            if "keep_multiple" in spec:
                job["keep_multiple"] = spec["keep_multiple"]
            jobs.append(job)
    return jobs


def spread(t: dict) -> str:
    return f"{t['min_ms']:.3g}-{t['max_ms']:.3g}"


def summarise(results):
    """One flat row per line: its place (S, sparsity, blocks, geometry, path), status, check, reads, times,
    rates and ratios against the cuDNN line of the same S."""
    dense = {r["job"]["seq"]: r for r in results if r["job"]["impl"] == "cudnn" and "fwd_bwd" in r}
    rows = []
    for r in results:
        job = r["job"]
        if job["impl"] == "small_check":
            continue
        options = job.get("options", {})
        row = {
            "seq": job["seq"],
            "sparsity": r.get("sparsity", 0.0),
            "blocks": r.get("blocks"),
            "impl": job["impl"],
            "options": json.dumps(options),
        }
        if job["impl"] != "cudnn":
            row["kv_block"] = options.get("kv_block", KV_BLOCK)
            row["q_tile"] = options.get("q_tile", Q_TILE)
            row["path"] = r.get("path", job["impl"])
        for name in ("top_k", "kept_keys"):
            if name in r:
                row[name] = r[name]
        if "skipped" in r:
            row["status"] = f"skipped: {r['skipped']}"
        elif "status" in r:
            row["status"] = r["status"] + (f" ({r['stage']})" if "stage" in r else "")
        if "error" in r:
            row["error"] = r["error"].strip().splitlines()[0][:160]
            row.setdefault("status", "error")
        if "check" in r:
            row["correct"] = r["check"]["correct"]
            row["max_err"] = r["check"]["max_err"]
        for name, value in r.get("reads", {}).items():
            row[f"reads_{name}"] = value
        for name, value in r.get("parts", {}).items():
            row[name] = value
        base = dense.get(job["seq"])
        if "fwd_bwd" in r:
            row["fwd_ms"] = r["fwd"]["median_ms"]
            row["fwd_spread"] = spread(r["fwd"])
            row["fwd_bwd_ms"] = r["fwd_bwd"]["median_ms"]
            row["bwd_ms"] = r["fwd_bwd"]["median_ms"] - r["fwd"]["median_ms"]
            row["fb_spread"] = spread(r["fwd_bwd"])
            row["calls_per_rep"] = r["fwd_bwd"].get("calls_per_run")
            row["fwd_tflops"], row["fwd_bwd_tflops"] = r["fwd_tflops"], r["fwd_bwd_tflops"]
            if base is not None:
                row["fwd_vs_cudnn_rate"] = r["fwd_tflops"] / base["fwd_tflops"]
                row["fwd_bwd_vs_cudnn_rate"] = r["fwd_bwd_tflops"] / base["fwd_bwd_tflops"]
                row["fwd_bwd_speedup"] = base["fwd_bwd"]["median_ms"] / r["fwd_bwd"]["median_ms"]
        for name in ("parts_error", "select_error"):
            if name in r:
                row[name] = r[name].strip().splitlines()[0][:160]
        if "select_fwd_bwd" in r:
            row["select_ms"] = r["select"]["median_ms"]
            row["select_fwd_bwd_ms"] = r["select_fwd_bwd"]["median_ms"]
            row["sfb_spread"] = spread(r["select_fwd_bwd"])
            if base is not None:
                row["select_fwd_bwd_speedup"] = base["fwd_bwd"]["median_ms"] / row["select_fwd_bwd_ms"]
        rows.append(row)
    return rows


COLUMNS = [  # one line per (row or variant, sparsity, source of blocks), the pieces and selection beside
    "seq",
    "sparsity",
    "kv_block",
    "q_tile",
    "blocks",
    "options",
    "path",
    "status",
    "max_err",
    "reads_cv_vs_uniform",
    "reads_effective_share",
    "select_ms",
    "fwd_ms",
    "bwd_ms",
    "fwd_bwd_ms",
    "fb_spread",
    "fwd_bwd_speedup",
    "fwd_bwd_vs_cudnn_rate",
    "select_fwd_bwd_ms",
    "sfb_spread",
    "select_fwd_bwd_speedup",
]
PART_COLUMNS = [
    "seq",
    "sparsity",
    "kv_block",
    "blocks",
    "options",
    "fwd_kernel_ms",
    "worklist_kernel_ms",
    "dq_kernel_ms",
    "dkdv_kernel_ms",
    "fused_kernel_ms",
    "fwd_of_ceiling",
    "dq_of_ceiling",
    "dkdv_of_ceiling",
    "fused_of_ceiling",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU: tiny sizes, the kernels in jax's GPU interpreter")
    parser.add_argument("--seqs", type=int, nargs="+")
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.9, 0.95])
    parser.add_argument(
        "--variants",
        default="[{}]",
        help="JSON list of option dicts for the Mosaic GPU path "
        "(its tuning, e.g. fwd_stages; or the geometry: q_tile, kv_block)",
    )
    parser.add_argument(
        "--rows",
        help="comma-separated KV granularities to benchmark side by side with cuDNN, in this order "
        f"(of {sorted(GRANULARITY_ROWS)}; e.g. 64,16,32,1); replaces --variants",
    )
    parser.add_argument("--blocks", default=",".join(SOURCES), help="sources of blocks, comma-separated")
    parser.add_argument("--budget-s", type=float, default=540.0, help="start no line after this (process start)")
    parser.add_argument(
        "--job-timeout-s", type=float, default=150.0, help="a child's stage (compile and check, time, ...) past this"
    )
    parser.add_argument("--warmup", type=int, help=f"blocked calls before timing (default {TIMING['warmup']})")
    parser.add_argument("--reps", type=int, help=f"timed repetitions (default {TIMING['reps']})")
    parser.add_argument("--calls", type=int, help=f"back-to-back calls per repetition (default {TIMING['calls']})")
    parser.add_argument("--no-small-check", action="store_true", help="skip the small-shape check of all geometries")
    parser.add_argument("--no-parts", action="store_true", help="do not time the Mosaic GPU kernels one by one")
    parser.add_argument("--no-triton", action="store_true", help="leave the Triton path out")
    parser.add_argument("--name", help="results file name (default bench_sparse_mgpu, with --rows _granularity)")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job = json.loads(args.job)
        measure_job(job, Stages(job.get("stage_timeout_s", 150.0)))
        return

    budget = harness.Budget(args.budget_s)
    timing = {**TIMING, **(QUICK["timing"] if args.quick else {})}
    timing.update({k: getattr(args, k) for k in ("warmup", "reps", "calls") if getattr(args, k) is not None})
    sources = [s for s in args.blocks.split(",") if s]
    if set(sources) - set(SOURCES):
        parser.error(f"--blocks {args.blocks}: sources are {', '.join(SOURCES)}")
    seqs = args.seqs or (QUICK["seqs"] if args.quick else [32768, 65536])
    rows_run = [int(r) for r in (args.rows or (QUICK["rows"] if args.quick else "")).split(",") if r]
    if rows_run:
        small_seq = 256 if args.quick else 1536
        jobs = plan_rows(seqs, args.sparsities, rows_run, not args.no_small_check, sources, small_seq)
    else:
        jobs = plan(
            seqs, args.sparsities, json.loads(args.variants), not args.no_small_check, not args.no_triton, sources
        )
    shape = {"heads": QUICK["heads"], "head_dim": QUICK["head_dim"]} if args.quick else {}
    for job in jobs:
        job.update(shape, timing=timing)
        if args.no_parts:
            job["parts"] = False
        if args.quick and job["impl"] in ("mgpu", "triton"):
            # jax's GPU interpreter takes minutes a call even at 256 tokens: a CPU run checks the plumbing on
            # the XLA reference (sparse_attention's path off a GPU); tests/ run the kernels interpreted
            job.update(impl="auto", parts=False)
    results = []
    for job in jobs:
        results += run_job(job, budget, args.job_timeout_s)

    rows = summarise(results)
    name = args.name or ("bench_sparse_mgpu_granularity" if rows_run else "bench_sparse_mgpu")
    path = harness.write_results(
        name + ("_quick" if args.quick else ""),  # a CPU smoke run never replaces a GPU run's file
        {
            "config": {
                "batch": 1,
                "heads": shape.get("heads", HEADS),
                "head_dim": shape.get("head_dim", HEAD_DIM),
                "dtype": "bfloat16",
                "geometry": f"q_tile {Q_TILE}, kv_block {KV_BLOCK} unless a variant or row sets its own",
                "blocks": {
                    "uniform": "uniformly random blocks, full counts (token rows: rounded up to a multiple of 256)",
                    "selector": f"lowrank_topk (rank {RANK}) on random normal q_lr, k_lr, full counts",
                },
                "seqs": seqs,
                "sparsities": args.sparsities,
                "variants": None if rows_run else json.loads(args.variants),
                "rows": {r: GRANULARITY_ROWS[r] for r in rows_run} if rows_run else None,
                "flops": "fwd 4*B*H*S*kept*D, fwd+bwd 3.5x",
                "timing": f"harness.time_fn, every program alike: {timing['warmup']} blocked warm-up calls, then "
                f"the median (min, max) of {timing['reps']} repetitions of {timing['calls']} back-to-back calls "
                "blocked once",
                "check": f"sampled, every line before it is timed: {CHECK}",
                "argv": " ".join(__import__("sys").argv[1:]),
            },
            "results": results,
            "summary": rows,
            "wall_s": budget.elapsed(),
        },
    )
    for r in results:
        if "error" in r:
            print(f"\nERROR {json.dumps(r['job'])} {json.dumps(line_key(r))}:\n{r['error'][-1200:]}")
        for case in r.get("cases", []):
            shown = {k_: (f"{v_:.2e}" if isinstance(v_, float) else v_) for k_, v_ in case.items() if k_ != "error"}
            print("small check", json.dumps(r["job"].get("options", {})), shown, case.get("error", "")[:600])
    print(f"\nwrote {path}")
    harness.print_table(rows, COLUMNS)
    part_rows = [r for r in rows if "fwd_kernel_ms" in r]
    if part_rows:
        print(
            f"\nMosaic GPU pieces (of_ceiling: the kernel's executed TFLOP/s over {harness.H200_BF16_MAX_TFLOPS:.0f}, "
            "the bf16 matmul ceiling):"
        )
        harness.print_table(part_rows, PART_COLUMNS)


if __name__ == "__main__":
    main()
