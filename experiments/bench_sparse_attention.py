"""DSV kernels on the GPU: selection (lowrank_topk) + block-sparse attention fwd/bwd against cuDNN dense.

    python -m experiments.bench_sparse_attention            # H200, ~6 min
    python -m experiments.bench_sparse_attention --quick    # CPU, interpret mode, tiny sizes
    python -m experiments.bench_sparse_attention --sections padded,lse   # only the new rows

Per sequence length S (B=1, H=16, D=128, bf16): cuDNN full attention fwd and fwd+bwd; per kv_block
(1 = token level, 64 = 3D tiles): one compiled sparse forward and fwd+bwd whose index capacity K is
that of the densest selection (80%), reused for every sparsity through the runtime counts (what DSV's
keep-ratio ladder does); random but realistic selections (harness.random_selection: a fifth of each list
the blocks around the tile, the rest random; per-head keep ratios from 0.6x to 1.4x of the target) at
each sparsity; selections from
lowrank_topk on smooth ("real-looking") q_lr, k_lr at 90% and 95%. The headline (S=64k, kv_block=64,
90% / 95%) is also compiled with the exact K. Every compiled function is checked against the
reference before it is timed (full reference at S=16k, sampled query tiles above); a failed check or
an exception is recorded in the JSON and the run goes on. A time guard skips what does not fit.

Sections (--sections, default all): "main" is the above; "padded" times a padded video grid (21 x 30 x 52
tokens in 4x4x4 tiles, padded to 24 x 32 x 52 = 39936 positions, kv_valid masking the padding) against the
same call without kv_valid (equal kept work: the same selection, 90%), plus the selection with and without
kv_valid; "lse" times return_lse=True (fwd, and fwd+bwd with an lse cotangent) against the plain call.
Both check against the reference first (full fwd+bwd at <= full_check_max tokens, else sampled query
tiles forward), and write rows to the "padded" and "lse" lists of the JSON with ratios to their baselines
(goal: within 5%). A run of some sections only writes bench_sparse_attention_<sections>.json.
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv_jax.model.flops import ATTENTION_FWD_BWD, attention_flops
from experiments import harness
from experiments.harness import compile_timed, error_text
from pallas_kernels.lowrank_topk import lowrank_topk_reference
from pallas_kernels.lowrank_topk_triton import lowrank_topk_pallas
from pallas_kernels.sparse_attention import sparse_attention_reference
from pallas_kernels.sparse_attention_triton import LaunchConfig, prepare_index, sparse_attention_pallas
from pallas_kernels.sparse_index import dkdv_worklist
from pallas_kernels.tuning import for_device, generation

FULL = dict(
    sizes=[16384, 65536, 131072, 32768],
    sparsities=[0.8, 0.9, 0.95, 0.98],
    kv_blocks=[64, 1],
    select_sparsities=[0.9, 0.95],
    heads=16,
    head_dim=128,
    q_tile=64,
    rank=16,
    token_group=16,
    full_check_max=16384,
    iters=3,
    calls=2,  # back-to-back calls per timed repetition of cuDNN and the sparse programs alike (`timed`)
    budget_s=235.0,
    mosaic_timeout_s=60,
    sweep_seq=32768,
    padded_grid=(21, 30, 52),
    padded_check_grid=(5, 30, 52),
    tile=(4, 4, 4),
    lse_sizes=[16384, 65536],
    extra_sparsity=0.9,
    extra_iters=10,
    extra_budget_s=180.0,
)
QUICK = dict(
    sizes=[256],
    sparsities=[0.75],
    kv_blocks=[32, 1],
    select_sparsities=[0.75],
    heads=2,
    head_dim=64,
    q_tile=64,
    rank=16,
    token_group=16,
    full_check_max=256,
    iters=1,
    calls=1,
    budget_s=120.0,
    sweep_seq=256,
    padded_grid=(5, 7, 9),
    padded_check_grid=(3, 7, 9),
    tile=(2, 4, 8),
    lse_sizes=[256],
    extra_sparsity=0.75,
    extra_iters=1,
    extra_budget_s=900.0,
)
SECTIONS = ("main", "padded", "lse")
HEADLINE = (65536, 64)  # (S, kv_block) of the goals
LOCAL_SHARE = 0.2  # of a selection: the blocks around the query tile (about the +-1% band of earlier runs at 90%)


def timed(fn, *args, cfg):
    """harness.time_fn with cfg's warmup, iters and calls: how cuDNN and the sparse programs whose times are
    compared (speedups, rates against cuDNN's) are all timed, with the same number of back-to-back calls per
    repetition whatever their length."""
    return harness.time_fn(fn, *args, warmup=1, iters=cfg["iters"], calls=cfg["calls"])


def budget_from_now(seconds: float) -> harness.Budget:
    """A time budget counted from now."""
    return harness.Budget(seconds, start=time.time())


# --------------------------------------------------------------------------------------------------
# inputs


def random_selection(key, *, seq, heads, q_tile, group, keep):
    """Blocks of `group` tokens per query tile (harness.random_selection), with per-head keep ratios spread
    from 0.6x to 1.4x of `keep` (heads differ in sparsity, as DSV measures). Returns (index [1, H, T, K],
    count [1, H, T]) with K = the largest count."""
    k_heads, k_blocks = jax.random.split(key)
    head_keep = keep * jax.random.permutation(k_heads, jnp.linspace(0.6, 1.4, heads))
    return harness.random_selection(
        k_blocks, seq=seq, heads=heads, q_tile=q_tile, kv_block=group, keep=head_keep, local_share=LOCAL_SHARE
    )


def to_tokens(index, count, group):
    """Expand block ids of `group` tokens to token ids (kv_block = 1), still ascending."""
    b, h, t, k = index.shape
    tok = (index[..., None] * group + jnp.arange(group, dtype=jnp.int32)).reshape(b, h, t, k * group)
    return tok, count * group


def pad_to(index, cap):
    k = index.shape[-1]
    return index if k == cap else jnp.pad(index, ((0, 0), (0, 0), (0, 0), (0, cap - k)))


def lowrank_inputs(key, seq, heads, rank):
    """q_lr, k_lr that vary smoothly along the (tile-major) sequence, plus noise: nearby tokens score alike."""
    ks = jax.random.split(key, 3)
    walk = jnp.cumsum(jax.random.normal(ks[0], (1, seq, heads, rank)), axis=1)
    walk = walk / jnp.sqrt(jnp.arange(1, seq + 1, dtype=jnp.float32))[None, :, None, None] * 3.0
    q_lr = walk + 0.5 * jax.random.normal(ks[1], walk.shape)
    k_lr = walk + 0.5 * jax.random.normal(ks[2], walk.shape)
    return q_lr.astype(jnp.bfloat16), k_lr.astype(jnp.bfloat16)


# --------------------------------------------------------------------------------------------------
# functions under test


def sparse_fns(q_tile, kv_block, tuning, interpret, *, kv_valid=None, with_lse=False):
    """Compiled-to-be fwd(q, k, v, index, count) and fwd_bwd(..., do): the Pallas path, optionally masking
    padded keys (kv_valid, a constant of the call) and returning lse (then fwd_bwd takes (do, dlse))."""
    attend = functools.partial(
        sparse_attention_pallas,
        q_tile=q_tile,
        kv_block=kv_block,
        sm_scale=None,
        tuning=tuning,
        interpret=interpret,
        kv_valid=kv_valid,
        return_lse=with_lse,
    )

    def fwd(q, k, v, index, count):
        return attend(q, k, v, index, count, sm_scale=q.shape[-1] ** -0.5)

    return fwd, harness.fwd_bwd(fwd, 3)


def dense_fns(implementation):
    def fwd(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation=implementation)

    return fwd, harness.fwd_bwd(fwd)


def time_worklist(index, count, q_tile, kv_block, tuning, seq, head_dim):
    """The dK/dV work list alone (part of the backward): how much of the backward the index transpose costs."""
    launch = LaunchConfig(
        q_tile=q_tile, kv_block=kv_block, seq_len=seq, head_dim=head_dim, sm_scale=1.0, tuning=tuning, interpret=True
    )

    def build(index, count):
        index, count = prepare_index(index, count, launch, seq)
        return dkdv_worklist(index, count, kv_block=kv_block, rows=launch.dkdv_rows, seq_len=seq)

    build_c, _ = compile_timed(build, index, count)
    return harness.time_fn(build_c, index, count, warmup=1, iters=3)["median_ms"]


# --------------------------------------------------------------------------------------------------
# correctness


def sampled_reference(q, k, v, index, count, tiles, q_tile, kv_block, kv_valid=None, with_lse=False):
    """Reference output rows of query tiles `tiles` (same for every head): gather, softmax, weighted sum;
    padded keys (kv_valid) masked; with_lse: also their lse [n * q_tile, H]."""
    _, s, h, d = q.shape
    rows = (tiles[:, None] * q_tile + jnp.arange(q_tile)).ravel()
    qs = q[0, rows].astype(jnp.float32).reshape(len(tiles), q_tile, h, d).transpose(2, 0, 1, 3)  # [H, n, qt, D]
    sel, cnt = index[0][:, tiles], count[0][:, tiles]  # [H, n, K], [H, n]
    live = jnp.arange(sel.shape[-1]) < cnt[..., None]
    key_rows = (jnp.where(live, sel, 0)[..., None] * kv_block + jnp.arange(kv_block)).reshape(h, len(tiles), -1)
    key_live = jnp.repeat(live, kv_block, axis=-1)
    if kv_valid is not None:
        row_ok = (jnp.arange(kv_block) < kv_valid[0][:, None]).reshape(-1)  # [S]
        key_live = key_live & row_ok[key_rows]
    kh, vh = k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2)  # [H, S, D]
    ks = jax.vmap(lambda kk, r: kk[r])(kh, key_rows).astype(jnp.float32)  # [H, n, R, D]
    vs = jax.vmap(lambda vv, r: vv[r])(vh, key_rows).astype(jnp.float32)
    logits = jnp.einsum("hnqd,hnrd->hnqr", qs, ks, precision="highest") * d**-0.5
    logits = jnp.where(key_live[:, :, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("hnqr,hnrd->hnqd", p, vs, precision="highest")
    out = out.transpose(1, 2, 0, 3).reshape(len(tiles) * q_tile, h, d)
    if not with_lse:
        return out, rows
    lse = jax.nn.logsumexp(logits, axis=-1).transpose(1, 2, 0).reshape(len(tiles) * q_tile, h)
    return out, lse, rows


def exact_scores(q_lr, k_lr, *, q_tile, kv_block, tiles):
    """The reference's block scores (block_scores, "mean" reduce) in fp32 at 'highest' precision, for the
    sampled query tiles only so that the score matrix stays small: [B, H, len(tiles), S // kv_block]."""
    b, s, h, r = q_lr.shape
    rows = (tiles[:, None] * q_tile + jnp.arange(q_tile)).ravel()
    proxy = jnp.mean(q_lr[:, rows].astype(jnp.float32).reshape(b, len(tiles), q_tile, h, r), axis=2)
    with jax.default_matmul_precision("highest"):
        scores = jnp.einsum("bthr,bshr->bhts", proxy, k_lr.astype(jnp.float32))
    return jnp.mean(scores.reshape(b, h, len(tiles), s // kv_block, kv_block), axis=-1)


def exact_topk(q_lr, k_lr, top_k, *, q_tile, kv_block, tiles):
    """The exact top-k ids of the sampled tiles (exact_scores + lax.top_k), ascending: [B, H, len(tiles), K]."""
    scores = exact_scores(q_lr, k_lr, q_tile=q_tile, kv_block=kv_block, tiles=tiles)
    return jnp.sort(jax.lax.top_k(scores, top_k)[1], axis=-1)


def check_selection(ids, q_lr, k_lr, top_k, *, q_tile, kv_block, tiles):
    """On sampled tiles: agreement with an exact (fp32 'highest') top-k, and whether the picks are a top-k."""
    scores = exact_scores(q_lr, k_lr, q_tile=q_tile, kv_block=kv_block, tiles=tiles)
    exact = jnp.sort(jax.lax.top_k(scores, top_k)[1], axis=-1)
    got = ids[:, :, tiles]
    picked = jnp.take_along_axis(scores, got, axis=-1)
    kth = jax.lax.top_k(scores, top_k)[0][..., -1]
    slack = 1e-5 * (jnp.abs(kth) + 1.0)
    return {
        "id_agreement": float(jnp.mean(got == exact)),
        "picks_are_top_k": bool(jnp.all(picked >= (kth - slack)[..., None])),
        "ascending": bool(jnp.all(jnp.diff(got, axis=-1) > 0)),
    }


# --------------------------------------------------------------------------------------------------


def run_size(seq, cfg, budget, tunings, interpret, out):
    h, d, q_tile = cfg["heads"], cfg["head_dim"], cfg["q_tile"]
    iters = cfg["iters"]
    q, k, v, do = harness.random_qkv(jax.random.key(seq), seq, h, d)
    dense_impl = "cudnn" if harness.on_gpu() else "xla"
    dense_fwd, dense_fwd_bwd = dense_fns(dense_impl)
    entry = {"seq": seq, "dense_impl": dense_impl}
    try:
        f_c, _ = compile_timed(dense_fwd, q, k, v)
        fb_c, _ = compile_timed(dense_fwd_bwd, q, k, v, do)
        entry["dense_fwd_ms"] = timed(f_c, q, k, v, cfg=cfg)["median_ms"]
        entry["dense_fwd_bwd_ms"] = timed(fb_c, q, k, v, do, cfg=cfg)["median_ms"]
        flops = ATTENTION_FWD_BWD * attention_flops(seq, h, d, seq)
        entry["dense_tflops"] = flops / entry["dense_fwd_bwd_ms"] / 1e9
        del f_c, fb_c
    except Exception as e:
        entry["dense_error"] = error_text(e, trace=True)
    out["dense"].append(entry)
    dense_ms = entry.get("dense_fwd_bwd_ms")
    q_lr, k_lr = lowrank_inputs(jax.random.key(seq + 1), seq, h, cfg["rank"])
    sample_tiles = jnp.asarray(np.random.default_rng(1).choice(seq // q_tile, min(8, seq // q_tile), replace=False))

    for kv_block in cfg["kv_blocks"]:
        if budget.left() < 20:
            out["skipped"].append(f"S={seq} kv_block={kv_block}: time budget")
            continue
        group = kv_block if kv_block > 1 else cfg["token_group"]
        # Random selections at every sparsity, all padded to the capacity of the densest one.
        selections = {}
        for sp in cfg["sparsities"]:
            idx, cnt = random_selection(
                jax.random.key(int(sp * 1000) + seq), seq=seq, heads=h, q_tile=q_tile, group=group, keep=1.0 - sp
            )
            if kv_block == 1:
                idx, cnt = to_tokens(idx, cnt, group)
            selections[sp] = (idx, cnt)
        cap = max(i.shape[-1] for i, _ in selections.values())
        selections = {sp: (pad_to(i, cap), c) for sp, (i, c) in selections.items()}
        tuning = tunings.get(kv_block, for_device()[0])
        base = {"seq": seq, "kv_block": kv_block, "capacity_K": cap}
        try:
            fwd_c, fwd_bwd_c, part = checked_pair(
                q_tile,
                kv_block,
                tuning,
                interpret,
                inputs=(q, k, v, do, None),
                selection=selections[cfg["sparsities"][0]],
                full=seq <= cfg["full_check_max"],
            )
            base.update(part)
        except Exception as e:
            out["runs"].append({**base, "error": error_text(e, trace=True)})
            continue
        if not base["correct"]:
            out["runs"].append({**base, "error": "failed the reference check; not timed"})
            continue

        def time_sparse(idx, cnt, label, extra=None):
            keys_per_query = float(jnp.mean(cnt.astype(jnp.float32))) * kv_block
            f_ms = timed(fwd_c, q, k, v, idx, cnt, cfg=cfg)["median_ms"]
            fb_ms = timed(fwd_bwd_c, q, k, v, idx, cnt, do, cfg=cfg)["median_ms"]
            flops = attention_flops(seq, h, d, keys_per_query)
            row = {
                **base,
                "selection": label,
                "kept_fraction": keys_per_query / seq,
                "fwd_ms": f_ms,
                "bwd_ms": fb_ms - f_ms,
                "fwd_bwd_ms": fb_ms,
                "fwd_tflops": flops / f_ms / 1e9,
                "fwd_bwd_tflops": ATTENTION_FWD_BWD * flops / fb_ms / 1e9,
                **(extra or {}),
            }
            if dense_ms:
                row["speedup_vs_dense"] = dense_ms / fb_ms
                row["tflops_vs_dense"] = row["fwd_bwd_tflops"] / entry["dense_tflops"]
            out["runs"].append(row)
            return row

        for sp in cfg["sparsities"]:
            if budget.left() < 10:
                out["skipped"].append(f"S={seq} kv_block={kv_block} sparsity={sp}: time budget")
                continue
            try:
                row = time_sparse(*selections[sp], f"random {sp}", {"target_sparsity": sp})
                if sp == cfg["select_sparsities"][0]:
                    row["worklist_ms"] = time_worklist(*selections[sp], q_tile, kv_block, tuning, seq, d)
            except Exception as e:
                out["runs"].append({**base, "target_sparsity": sp, "error": error_text(e, trace=True)})

        # Selection by lowrank_topk, then the same compiled attention on its output.
        for sp in cfg["select_sparsities"]:
            if budget.left() < 15:
                out["skipped"].append(f"S={seq} kv_block={kv_block} select {sp}: time budget")
                continue
            top_k = max(1, round((1.0 - sp) * seq / kv_block))
            sel_row = {"seq": seq, "kv_block": kv_block, "sparsity": sp, "top_k": top_k}
            try:
                select = functools.partial(
                    lowrank_topk_pallas,
                    top_k=top_k,
                    q_tile=q_tile,
                    kv_block=kv_block,
                    block_reduce="mean",
                    tuning=tunings.get("select", for_device()[1]),
                    interpret=interpret,
                )
                sel_c, t_c = compile_timed(select, q_lr, k_lr)
                ids = sel_c(q_lr, k_lr)
                sel_row.update(
                    check_selection(ids, q_lr, k_lr, top_k, q_tile=q_tile, kv_block=kv_block, tiles=sample_tiles)
                )
                sel_row["select_ms"] = harness.time_fn(sel_c, q_lr, k_lr, warmup=1, iters=iters)["median_ms"]
                mem = sel_c.memory_analysis()
                sel_row["select_temp_bytes"] = int(mem.temp_size_in_bytes) if mem else None
                sel_row["select_output_bytes"] = int(mem.output_size_in_bytes) if mem else None
                if kv_block > 1 and sp == cfg["select_sparsities"][0] and budget.left() > 30:
                    naive = functools.partial(lowrank_topk_reference, top_k=top_k, q_tile=q_tile, kv_block=kv_block)
                    naive_c, _ = compile_timed(naive, q_lr, k_lr)
                    sel_row["naive_select_ms"] = harness.time_fn(naive_c, q_lr, k_lr, warmup=1, iters=2)["median_ms"]
                    nmem = naive_c.memory_analysis()
                    sel_row["naive_temp_bytes"] = int(nmem.temp_size_in_bytes) if nmem else None
                    del naive_c
                count = jnp.full(ids.shape[:3], top_k, jnp.int32)
                if top_k <= cap:
                    att = time_sparse(pad_to(ids, cap), count, f"lowrank_topk {sp}", {"target_sparsity": sp})
                    sel_row["attention_fwd_bwd_ms"] = att["fwd_bwd_ms"]
                    sel_row["select_share_of_attention"] = sel_row["select_ms"] / att["fwd_bwd_ms"]
            except Exception as e:
                sel_row["error"] = error_text(e, trace=True)
            out["selection"].append(sel_row)
        # free this kv_block's executables before the next one compiles (time_sparse holds them too)
        fwd_c = fwd_bwd_c = time_sparse = None

        if (seq, kv_block) == HEADLINE and harness.on_gpu():
            headline(
                q, k, v, do, q_lr, k_lr, cfg, tuning, tunings.get("select", for_device()[1]), dense_ms, budget, out
            )


def headline(q, k, v, do, q_lr, k_lr, cfg, tuning, select_tuning, dense_ms, budget, out):
    """Selection + fwd + bwd with the exact K (no capacity slack) at the goal's size."""
    seq, kv_block = HEADLINE
    q_tile = cfg["q_tile"]
    fwd, fwd_bwd = sparse_fns(q_tile, kv_block, tuning, False)
    for sp in (0.9, 0.95):
        if budget.left() < 20:
            out["skipped"].append(f"headline {sp}: time budget")
            continue
        top_k = round((1.0 - sp) * seq / kv_block)
        row = {"seq": seq, "kv_block": kv_block, "sparsity": sp, "top_k": top_k}
        try:
            select = functools.partial(
                lowrank_topk_pallas,
                top_k=top_k,
                q_tile=q_tile,
                kv_block=kv_block,
                block_reduce="mean",
                tuning=select_tuning,
                interpret=False,
            )

            def step(q, k, v, q_lr, k_lr, do):
                ids = select(q_lr, k_lr)
                count = jnp.full(ids.shape[:3], top_k, jnp.int32)
                return fwd_bwd(q, k, v, ids, count, do)

            step_c, _ = compile_timed(step, q, k, v, q_lr, k_lr, do)
            row["select_fwd_bwd_ms"] = timed(step_c, q, k, v, q_lr, k_lr, do, cfg=cfg)["median_ms"]
            if dense_ms:
                row["speedup_vs_dense"] = dense_ms / row["select_fwd_bwd_ms"]
        except Exception as e:
            row["error"] = error_text(e, trace=True)
        out["headline"].append(row)


def tuning_sweep(cfg, interpret, out, budget):
    """A few launch variants at S=32k, 90%: attention per kv_block (fwd+bwd time) and the token-level
    selection; returns the fastest per kernel ({64: ..., 1: ..., "select": ...})."""
    seq, q_tile = cfg["sweep_seq"], cfg["q_tile"]
    h, d = cfg["heads"], cfg["head_dim"]
    q, k, v, do = harness.random_qkv(jax.random.key(5), seq, h, d)
    base = for_device()[0]
    candidates = {
        64: [base, dataclasses.replace(base, rows_per_step=128, fwd_warps=8, dq_warps=8)],
        1: [base, dataclasses.replace(base, dkdv_rows=32)],
    }
    best = {}
    for kv_block, variants in candidates.items():
        group = kv_block if kv_block > 1 else cfg["token_group"]
        idx, cnt = random_selection(jax.random.key(6), seq=seq, heads=h, q_tile=q_tile, group=group, keep=0.1)
        if kv_block == 1:
            idx, cnt = to_tokens(idx, cnt, group)
        best_ms = None
        for tuning in variants:
            if budget.left() < 190:
                out["skipped"].append(f"tuning sweep kv_block={kv_block}: time budget")
                break
            row = {"kv_block": kv_block, "tuning": str(tuning)}
            try:
                _, fwd_bwd = sparse_fns(q_tile, kv_block, tuning, interpret)
                fb_c, _ = compile_timed(fwd_bwd, q, k, v, idx, cnt, do)
                row["fwd_bwd_ms"] = harness.time_fn(fb_c, q, k, v, idx, cnt, do, warmup=1, iters=3)["median_ms"]
                if best_ms is None or row["fwd_bwd_ms"] < best_ms:
                    best[kv_block], best_ms = tuning, row["fwd_bwd_ms"]
            except Exception as e:
                row["error"] = error_text(e, trace=True)
            out["tuning_sweep"].append(row)
    # Selection kernel: token level (the expensive case), 90%.
    q_lr, k_lr = lowrank_inputs(jax.random.key(7), seq, h, cfg["rank"])
    base_sel = for_device()[1]
    best_ms = None
    for tuning in [
        base_sel,
        dataclasses.replace(base_sel, warps=4),
        dataclasses.replace(base_sel, tiles_per_program=32, keys_per_step=32),
    ]:
        if budget.left() < 180:
            out["skipped"].append("tuning sweep selection: time budget")
            break
        row = {"kernel": "lowrank_topk kv_block=1", "tuning": str(tuning)}
        try:
            select = functools.partial(
                lowrank_topk_pallas,
                top_k=seq // 10,
                q_tile=q_tile,
                kv_block=1,
                block_reduce="mean",
                tuning=tuning,
                interpret=interpret,
            )
            sel_c, _ = compile_timed(select, q_lr, k_lr)
            row["select_ms"] = harness.time_fn(sel_c, q_lr, k_lr, warmup=1, iters=3)["median_ms"]
            if best_ms is None or row["select_ms"] < best_ms:
                best["select"], best_ms = tuning, row["select_ms"]
        except Exception as e:
            row["error"] = error_text(e, trace=True)
        out["tuning_sweep"].append(row)
    out["tuning_used"] = {str(kb): str(t) for kb, t in best.items()}
    return best


# --------------------------------------------------------------------------------------------------
# padded video grids and lse output (sections "padded" and "lse")


def padded_kv_valid(grid, tile, kv_block):
    """(kv_valid int32 [1, S // kv_block], S, real tokens) of a token grid padded to whole tiles in tile-major
    order with each tile's real tokens first (the model's layout); kv_block divides the tile size."""
    tile = [min(t, g) for t, g in zip(tile, grid)]
    n_tiles = [-(-g // t) for g, t in zip(grid, tile)]
    extent = [np.minimum(t, g - np.arange(n) * t) for g, t, n in zip(grid, tile, n_tiles)]  # real extent per tile
    real = (extent[0][:, None, None] * extent[1][None, :, None] * extent[2][None, None, :]).reshape(-1)
    size = int(np.prod(tile))
    per_block = np.clip(real[:, None] - np.arange(size // kv_block) * kv_block, 0, kv_block).reshape(-1)
    return jnp.asarray(per_block[None], jnp.int32), len(real) * size, int(real.sum())


def checked_pair(
    q_tile, kv_block, tuning, interpret, *, kv_valid=None, with_lse=False, full=False, inputs=None, selection=None
):
    """Compile fwd and fwd+bwd of one variant and check them against the reference (the whole call, or
    sampled query tiles) on `inputs` (q, k, v, do, dlse) and `selection` (index, count).
    -> (fwd_c, fwd_bwd_c, {"compile_s", "check", "correct"})."""
    q, k, v, do, dlse = inputs
    idx, cnt = selection
    fwd, fwd_bwd = sparse_fns(q_tile, kv_block, tuning, interpret, kv_valid=kv_valid, with_lse=with_lse)
    cot = (do, dlse) if with_lse else do
    fwd_c, t_f = compile_timed(fwd, q, k, v, idx, cnt)
    fwd_bwd_c, t_fb = compile_timed(fwd_bwd, q, k, v, idx, cnt, cot)
    row = {"compile_s": t_f + t_fb}
    if full:

        def ref(q, k, v):
            return sparse_attention_reference(
                q, k, v, idx, cnt, q_tile=q_tile, kv_block=kv_block, kv_valid=kv_valid, return_lse=with_lse
            )

        ref_out, ref_vjp = jax.vjp(ref, q, k, v)
        out, grads = fwd_bwd_c(q, k, v, idx, cnt, cot)
        o, ref_o = (out[0], ref_out[0]) if with_lse else (out, ref_out)
        check = {"mode": "full", "o": harness.rel_error(o, ref_o)}
        if with_lse:
            check["lse"] = harness.rel_error(out[1], ref_out[1])
        check.update({n: harness.rel_error(g, rg) for n, g, rg in zip(("dq", "dk", "dv"), grads, ref_vjp(cot))})
    else:
        tiles = jnp.asarray(
            np.random.default_rng(0).choice(q.shape[1] // q_tile, min(4, q.shape[1] // q_tile), replace=False)
        )
        ref = sampled_reference(q, k, v, idx, cnt, tiles, q_tile, kv_block, kv_valid, with_lse=True)
        out = fwd_c(q, k, v, idx, cnt)
        o = out[0] if with_lse else out
        check = {"mode": "sampled 4 tiles x all heads", "o": harness.rel_error(o[0, ref[2]], ref[0])}
        if with_lse:
            check["lse"] = harness.rel_error(out[1][0][:, ref[2]].T, ref[1])
    row["check"] = check
    row["correct"] = all(v_ < 2e-2 for k_, v_ in check.items() if k_ != "mode")
    return fwd_c, fwd_bwd_c, row


def time_pair(fwd_c, fwd_bwd_c, inputs, selection, iters, with_lse):
    q, k, v, do, dlse = inputs
    idx, cnt = selection
    cot = (do, dlse) if with_lse else do
    f_ms = harness.time_fn(fwd_c, q, k, v, idx, cnt, warmup=2, iters=iters)["median_ms"]
    fb_ms = harness.time_fn(fwd_bwd_c, q, k, v, idx, cnt, cot, warmup=2, iters=iters)["median_ms"]
    return f_ms, fb_ms


def extra_inputs(key, seq, cfg):
    q, k, v, do = harness.random_qkv(key, seq, cfg["heads"], cfg["head_dim"])
    dlse = jax.random.normal(jax.random.fold_in(key, 1), (1, cfg["heads"], seq), jnp.float32)
    return q, k, v, do, dlse


def compare_variants(cfg, interpret, seq, kv_block, selection, inputs, variant, baseline, full, budget):
    """Check and time two variants of the same call (equal kept work): {"baseline": ..., "variant": ...,
    "fwd_ratio", "fwd_bwd_ratio"} (variant time / baseline time)."""
    q_tile, tuning = cfg["q_tile"], for_device()[0]
    row = {
        "seq": seq,
        "kv_block": kv_block,
        "target_sparsity": cfg["extra_sparsity"],
        "kept_fraction": float(jnp.mean(selection[1].astype(jnp.float32))) * kv_block / seq,
    }
    timed = {}
    for name, opts in (("baseline", baseline), ("variant", variant)):
        if budget.left() < 15:
            row["error"] = f"time budget before {name}"
            return row
        try:
            fwd_c, fwd_bwd_c, part = checked_pair(
                q_tile, kv_block, tuning, interpret, full=full, inputs=inputs, selection=selection, **opts
            )
            if part["correct"]:
                part["fwd_ms"], part["fwd_bwd_ms"] = time_pair(
                    fwd_c, fwd_bwd_c, inputs, selection, cfg["extra_iters"], opts.get("with_lse", False)
                )
                timed[name] = part
            row[name] = part
            del fwd_c, fwd_bwd_c
        except Exception as e:
            row[name] = {"error": error_text(e, trace=True)}
    if len(timed) == 2:
        for key in ("fwd", "fwd_bwd"):
            row[f"{key}_ratio"] = timed["variant"][f"{key}_ms"] / timed["baseline"][f"{key}_ms"]
        row["within_5pct"] = row["fwd_bwd_ratio"] <= 1.05
    return row


def run_padded(cfg, interpret, out, budget):
    """The padded grid with kv_valid against the same call without (same S and selection), the selection
    with and without kv_valid, and a full fwd+bwd check of the padded call on a smaller padded grid."""
    kv_block = int(np.prod(cfg["tile"]))  # tile-sized blocks (what DSV selects on video)
    h, q_tile = cfg["heads"], cfg["q_tile"]
    if q_tile != kv_block:
        out["skipped"].append(f"padded rows: q_tile {q_tile} is not the tile size {kv_block}")
        return
    for label, grid, full in (("check", cfg["padded_check_grid"], True), ("timed", cfg["padded_grid"], False)):
        kv_valid, seq, real = padded_kv_valid(grid, cfg["tile"], kv_block)
        inputs = extra_inputs(jax.random.key(seq), seq, cfg)
        selection = random_selection(
            jax.random.key(seq + 1), seq=seq, heads=h, q_tile=q_tile, group=kv_block, keep=1.0 - cfg["extra_sparsity"]
        )
        row = compare_variants(
            cfg, interpret, seq, kv_block, selection, inputs, {"kv_valid": kv_valid}, {}, full=full, budget=budget
        )
        row.update(
            {
                "rows": label,
                "grid": list(grid),
                "tile": list(cfg["tile"]),
                "real_tokens": real,
                "valid_blocks": int(jnp.sum(kv_valid > 0)),
                "blocks": int(kv_valid.shape[1]),
            }
        )
        out["padded"].append(row)

    # selection on the timed grid: lowrank_topk with kv_valid (masked means, proxies of valid rows) vs without
    top_k = max(1, round((1.0 - cfg["extra_sparsity"]) * seq / kv_block))
    sel = {"rows": "selection", "grid": list(cfg["padded_grid"]), "seq": seq, "kv_block": kv_block, "top_k": top_k}
    if budget.left() < 15:
        out["skipped"].append("padded selection: time budget")
        return
    try:
        q_lr, k_lr = lowrank_inputs(jax.random.key(seq + 2), seq, h, cfg["rank"])
        for name, valid in (("select_ms", None), ("select_padded_ms", kv_valid)):
            select = functools.partial(
                lowrank_topk_pallas,
                top_k=top_k,
                q_tile=q_tile,
                kv_block=kv_block,
                block_reduce="mean",
                tuning=for_device()[1],
                interpret=interpret,
                kv_valid=valid,
            )
            sel_c, _ = compile_timed(select, q_lr, k_lr)
            ids = sel_c(q_lr, k_lr)
            if valid is not None:
                ref = lowrank_topk_reference(q_lr, k_lr, top_k, q_tile=q_tile, kv_block=kv_block, kv_valid=valid)
                sel["padded_id_agreement"] = float(jnp.mean(ids == ref))
                usable = jnp.broadcast_to(valid[:, None, None] > 0, (*ids.shape[:3], valid.shape[1]))
                sel["picks_padding"] = not bool(jnp.all(jnp.take_along_axis(usable, ids, -1)))
            sel[name] = harness.time_fn(sel_c, q_lr, k_lr, warmup=1, iters=cfg["extra_iters"])["median_ms"]
        sel["select_ratio"] = sel["select_padded_ms"] / sel["select_ms"]
    except Exception as e:
        sel["error"] = error_text(e, trace=True)
    out["padded"].append(sel)


def run_lse(cfg, interpret, out, budget):
    """return_lse=True (fwd; fwd+bwd with an lse cotangent) against the plain call, same selection."""
    kv_block, h, q_tile = 64, cfg["heads"], cfg["q_tile"]
    for seq in cfg["lse_sizes"]:
        inputs = extra_inputs(jax.random.key(seq + 3), seq, cfg)
        selection = random_selection(
            jax.random.key(seq + 4), seq=seq, heads=h, q_tile=q_tile, group=kv_block, keep=1.0 - cfg["extra_sparsity"]
        )
        row = compare_variants(
            cfg,
            interpret,
            seq,
            kv_block,
            selection,
            inputs,
            {"with_lse": True},
            {},
            full=seq <= cfg["full_check_max"],
            budget=budget,
        )
        out["lse"].append(row)


def mosaic_check_main():
    """Child process: the Mosaic GPU forward at S=32k, kv_block=64, 90% against the Triton one, answered to
    try_mosaic_gpu (experiments/bench_sparse_mgpu.py measures that path in full)."""
    result = {}
    try:
        from experiments import bench_sparse_mgpu

        seq, kv_block, heads, head_dim = 32768, 64, FULL["heads"], FULL["head_dim"]
        q, k, v, _ = harness.random_qkv(jax.random.key(9), seq, heads, head_dim)
        idx, cnt = random_selection(jax.random.key(10), seq=seq, heads=heads, q_tile=64, group=kv_block, keep=0.1)
        result = {"seq": seq, "kv_block": kv_block, "device": harness.device_info()}
        result.update(bench_sparse_mgpu.forward_vs_triton(q, k, v, idx, cnt))
    except Exception as e:
        result.update(ok=False, error=error_text(e, trace=True))
    harness.answer(result)


def try_mosaic_gpu(timeout_s):
    """Runs mosaic_check_main in a child process (before this one claims the GPU), so that a crash or a
    barrier deadlock in the experimental kernel costs at most timeout_s and never the benchmark."""
    result = harness.in_child(
        "experiments.bench_sparse_attention",
        ["--mosaic-check"],
        timeout_s,
        env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"},
    )
    return result if "ok" in result else {"ok": False, **result}


def goals(out):
    g = {}
    for row in out["headline"]:
        if "speedup_vs_dense" in row:
            goal = 5 if row["sparsity"] == 0.9 else 9
            g[f"select+fwd+bwd speedup S=64k {int(row['sparsity'] * 100)}% (goal {goal}x)"] = row["speedup_vs_dense"]
    for key, section in (("padded kv_valid / unpadded", "padded"), ("return_lse / plain", "lse")):
        for r in out.get(section, []):
            if "fwd_bwd_ratio" in r:
                g[f"{key} fwd+bwd time S={r['seq']} (goal <= 1.05)"] = r["fwd_bwd_ratio"]
    ratios = [r["tflops_vs_dense"] for r in out["runs"] if "tflops_vs_dense" in r]
    if ratios:
        g["sparse fwd+bwd TFLOP/s / cuDNN, median over runs (goal 0.7)"] = float(np.median(ratios))
        g["sparse fwd+bwd TFLOP/s / cuDNN, best (goal 0.7)"] = float(np.max(ratios))
    shares = {
        f"kv_block={r['kv_block']} {r['sparsity']}": r["select_share_of_attention"]
        for r in out["selection"]
        if r["seq"] == max(FULL["sizes"]) and "select_share_of_attention" in r
    }
    if shares:
        g["selection / sparse attention at S=128k (goal <= 0.1)"] = shares
    out["goals"] = g


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes on CPU (Pallas interpret mode)")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)} (default: all)"
    )
    parser.add_argument("--mosaic-check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        parser.error(f"--sections {args.sections!r}: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    if args.mosaic_check:
        return mosaic_check_main()
    cfg = QUICK if args.quick else FULL
    main_rows = "main" in sections
    mosaic = try_mosaic_gpu(cfg["mosaic_timeout_s"]) if main_rows and not args.quick else None  # before we hold the GPU
    interpret = not harness.on_gpu()
    start = time.perf_counter()
    budget = budget_from_now(cfg["budget_s"])
    out = {
        "config": {k_: v_ for k_, v_ in cfg.items()},
        "sections": sections,
        "generation": generation(),
        "dense": [],
        "runs": [],
        "selection": [],
        "headline": [],
        "tuning_sweep": [],
        "padded": [],
        "lse": [],
        "skipped": [],
    }
    if mosaic is not None:
        out["mosaic_gpu"] = mosaic
    if main_rows:
        tunings = tuning_sweep(cfg, interpret, out, budget) if harness.on_gpu() else {}
        for seq in cfg["sizes"]:
            if budget.left() < 25:
                out["skipped"].append(f"S={seq}: time budget")
                continue
            run_size(seq, cfg, budget, tunings, interpret, out)
    extra_budget = budget_from_now(cfg["extra_budget_s"])
    if "padded" in sections:
        run_padded(cfg, interpret, out, extra_budget)
    if "lse" in sections:
        run_lse(cfg, interpret, out, extra_budget)
    goals(out)
    out["wall_s"] = time.perf_counter() - start
    name = "bench_sparse_attention" + ("" if main_rows and len(sections) == len(SECTIONS) else "_" + "_".join(sections))
    path = harness.write_results(name + ("_quick" if args.quick else ""), out)

    if main_rows:
        print(f"dense ({out['dense'][0].get('dense_impl') if out['dense'] else '-'}):")
        harness.print_table(out["dense"], ["seq", "dense_fwd_ms", "dense_fwd_bwd_ms", "dense_tflops"])
        print("\nsparse attention:")
        harness.print_table(
            out["runs"],
            [
                "seq",
                "kv_block",
                "selection",
                "kept_fraction",
                "fwd_ms",
                "bwd_ms",
                "worklist_ms",
                "fwd_bwd_tflops",
                "speedup_vs_dense",
                "tflops_vs_dense",
                "correct",
            ],
        )
        print("\nselection (lowrank_topk):")
        harness.print_table(
            out["selection"],
            [
                "seq",
                "kv_block",
                "sparsity",
                "top_k",
                "select_ms",
                "naive_select_ms",
                "select_share_of_attention",
                "id_agreement",
                "picks_are_top_k",
            ],
        )
    for key in ("padded", "lse"):
        if out[key]:
            print(f"\n{key} (variant / baseline at equal kept work):")
            harness.print_table(
                [
                    {
                        **r,
                        **{
                            f"{n}_{m}": r.get(n, {}).get(m)
                            for n in ("baseline", "variant")
                            for m in ("fwd_ms", "fwd_bwd_ms", "correct")
                        },
                    }
                    for r in out[key]
                ],
                [
                    "rows",
                    "seq",
                    "kv_block",
                    "kept_fraction",
                    "baseline_fwd_bwd_ms",
                    "variant_fwd_bwd_ms",
                    "fwd_ratio",
                    "fwd_bwd_ratio",
                    "variant_correct",
                    "select_ratio",
                ],
            )
    if out["headline"]:
        print("\nheadline:")
        harness.print_table(out["headline"], ["seq", "kv_block", "sparsity", "select_fwd_bwd_ms", "speedup_vs_dense"])
    errors = [r for r in out["runs"] + out["selection"] + out["headline"] + out["padded"] + out["lse"] if "error" in r]
    errors += [r[n] for r in out["padded"] + out["lse"] for n in ("baseline", "variant") if "error" in r.get(n, {})]
    for r in errors:
        print(f"\nERROR at { ({k_: r[k_] for k_ in ('seq', 'kv_block') if k_ in r}) }: {r['error'][:300]}")
    if "mosaic_gpu" in out:
        print(f"\nMosaic GPU forward: { ({k_: v_ for k_, v_ in out['mosaic_gpu'].items() if k_ != 'error'}) }")
    print(f"\ngoals: {out['goals']}\nskipped: {out['skipped']}\nwrote {path} in {out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
