"""Time the selection kernel (lowrank_topk, Pallas Triton lowering) per tuning, at token level and 3D blocks,
and measure the attention mass its selection captures against an exact top-k's.

    python -m experiments.bench_topk                                   # H200, ~3 min
    python -m experiments.bench_topk --variants '[{}, {"sample": 0}, {"warps": 8}]'
    python -m experiments.bench_topk --quick                           # CPU, interpret mode, tiny sizes

Per sequence length S (B=1, H=16, rank 16, q_tile 64) and kv_block (1 = token level, 16 / 32 / 64 = 3D blocks),
the selection at each sparsity (top_k = (1 - sparsity) * S / kv_block) with every tuning variant (overrides of
the device's TopkTuning, `{}` = the default; the default run compares the score dot's precision, tf32 /
tf32x3 / ieee), checked on 8 sampled query tiles against an exact top-k of the same proxies and block scores
(fp32 at 'highest' precision, then lax.top_k: bench_sparse_attention.exact_topk), then the median of timed runs:
  id_agreement  share of positions where the ascending id lists agree (one swapped id shifts all after it)
  recall        share of the exact top-k's ids that the selection holds (set overlap)
  mass_captured_lowrank / _full   the attention mass inside the kernel's selection over the mass inside the
                the exact top-k's, per sampled (head, tile), mean (and _min: the worst): under the softmax
                of the rank-16 scores (q_lr k_lr^T / sqrt(r)) and of the full q, k (q k^T / sqrt(D)), each
                tile's mass the mean over its 64 query rows; exact_mass_* is what the exact top-k holds.
                Goal (issue 38): >= 0.99. Near-ties at the k-th score (TF32 dots) swap ids but cost little
                mass, as the swapped keys score (nearly) alike.
  same_ids_as_first  a tuning that changes only the speed picks the first variant's ids bit for bit (a
                precision variant may not: that is what it is for).

Inputs (--inputs): "projected" (default): q, k [1, S, H, 128] drawn as video attention's mix of local and
global keys (a component shared by neighbouring tokens, smooth over ~64 positions of the tile-major sequence,
plus independent noise; logits scaled so that the top 10% of keys hold ~80% of a query's mass) and q_lr, k_lr
their fixed random rank-16 projection (one per head, scaled so that q_lr k_lr^T / sqrt(16) estimates
q k^T / sqrt(128)): a predictor that correlates with the true logits as a learnt one does, less well (at 10%
of the keys its tile selection holds ~40% of the true mass at 32k). "walk": bench_sparse_attention's smooth
low-rank q_lr, k_lr alone (the earlier runs' inputs; no full q, k, so no _full mass).

Why the time is what it is: every counting pass recomputes each score (a rank-16 dot) and compares it with
2**radix_bits thresholds. `passes` is how many counting passes the select needs, from a numpy model of the
kernel's bracketing on the sampled tiles' scores (seeded or not, as the variant is); `score_passes_per_ns`
is S/q_tile * H * S/kv_block scores times (passes + 1 compaction pass) per nanosecond of the kernel.

With --attention-seqs, the token-level sparse attention (Triton path, random 16-token groups) fwd+bwd is
timed too at those S, so that each selection's share of it (issue 16's goal: <= 0.15 at 128k) comes from
one run. Writes experiments/results/bench_topk.json (and $OUT/ when set).
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from experiments.bench_sparse_attention import (
    check_selection,
    exact_topk,
    lowrank_inputs,
    random_selection,
    sparse_fns,
    to_tokens,
)
from pallas_kernels.lowrank_topk_triton import SEED_MIN_RATIO, first_thresholds, lowrank_topk_pallas, sortable_key
from pallas_kernels.tuning import for_device

FULL = dict(
    seqs=[32768, 131072],
    sparsities=[0.9, 0.95],
    kv_blocks=[1, 16, 32, 64],
    inputs="projected",
    heads=16,
    rank=16,
    q_tile=64,
    head_dim=128,
    token_group=16,
    iters=5,
    attention_seqs=[131072],
    variants=[{}, {"precision": "tf32x3"}, {"precision": "ieee"}],
)
QUICK = dict(
    seqs=[512],
    sparsities=[0.9],
    kv_blocks=[1, 16, 32, 64],
    inputs="projected",
    heads=2,
    rank=16,
    q_tile=64,
    head_dim=64,
    token_group=16,
    iters=1,
    attention_seqs=[512],
    variants=[{}, {"sample": 16}, {"precision": "tf32x3"}],
)


def projected_inputs(key, seq, heads, head_dim, rank, *, length=64, local=0.5, logit_var=1.5):
    """q, k [1, S, H, head_dim] and their rank-`rank` projections q_lr, k_lr (bf16; see the module docstring).
    Per coordinate q = a (sqrt(local) smooth + sqrt(1 - local) noise_q), k likewise with its own noise, a^2 =
    logit_var (the variance of a far key's logit); `smooth` interpolates unit normals drawn every `length`
    positions. The projection P [H, head_dim, rank] has entries N(0, 1 / sqrt(rank head_dim)), so that
    E[q_lr . k_lr] / sqrt(rank) = q . k / sqrt(head_dim)."""
    ks = jax.random.split(key, 4)
    coarse = jax.random.normal(ks[0], (1, seq // length + 2, heads, head_dim))
    pos = np.arange(seq) / length
    i0 = np.floor(pos).astype(np.int32)
    f = jnp.asarray(pos - i0, jnp.float32)[None, :, None, None]
    smooth = ((1 - f) * coarse[:, i0] + f * coarse[:, i0 + 1]) / jnp.sqrt((1 - f) ** 2 + f**2)
    a = logit_var**0.5
    q = a * (local**0.5 * smooth + (1 - local) ** 0.5 * jax.random.normal(ks[1], smooth.shape))
    k = a * (local**0.5 * smooth + (1 - local) ** 0.5 * jax.random.normal(ks[2], smooth.shape))
    proj = jax.random.normal(ks[3], (heads, head_dim, rank)) * (rank * head_dim) ** -0.25
    lr = lambda x: jnp.einsum("bshd,hdr->bshr", x, proj, precision="highest").astype(jnp.bfloat16)
    return q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), lr(q), lr(k)


def mass_table(q, k, *, q_tile, tiles):
    """fp32 [B, H, len(tiles), S]: the attention mass (softmax of q k^T / sqrt(D) over all S keys) that each key
    gets, averaged over the query rows of each sampled tile; one head at a time (lax.map)."""
    b, s, h, d = q.shape
    rows = (np.asarray(tiles)[:, None] * q_tile + np.arange(q_tile)).ravel()

    def one(args):
        qh, kh = args  # [B, n * q_tile, D], [B, S, D]
        z = jnp.einsum("bqd,bsd->bqs", qh.astype(jnp.float32), kh.astype(jnp.float32), precision="highest")
        p = jax.nn.softmax(z * d**-0.5, axis=-1)
        return jnp.mean(p.reshape(b, len(tiles), q_tile, s), axis=2)

    per_head = (jnp.moveaxis(q[:, rows], 2, 0), jnp.moveaxis(k, 2, 0))
    return jnp.moveaxis(jax.lax.map(one, per_head), 0, 1)


def block_mass(table, kv_block: int):
    """[B, H, n, S] per-key masses -> [B, H, n, S // kv_block] per KV block."""
    b, h, n, s = table.shape
    return jnp.sum(table.reshape(b, h, n, s // kv_block, kv_block), axis=-1)


def mass_captured(ids, exact, masses) -> dict:
    """The mass in a selection's blocks over the mass in the exact top-k's, per sampled (batch, head, tile):
    ids, exact int [B, H, n, K] (the sampled tiles' rows); masses [B, H, n, blocks] (block_mass). Returns
    mean and min of the ratio, and the exact selection's mean mass."""
    got = jnp.sum(jnp.take_along_axis(masses, jnp.asarray(ids), axis=-1), axis=-1)
    best = jnp.sum(jnp.take_along_axis(masses, jnp.asarray(exact), axis=-1), axis=-1)
    ratio = got / jnp.maximum(best, 1e-30)
    return {"mean": float(jnp.mean(ratio)), "min": float(jnp.min(ratio)), "exact_mass": float(jnp.mean(best))}


def sampled_scores(q_lr, k_lr, *, q_tile, kv_block, tiles) -> dict:
    """fp32 numpy pieces of the sampled tiles' selection, shared by every variant and sparsity: their proxies
    [B, n, H, r], the block-mean keys [B, S // kv_block, H, r] ("mean" reduce), the scores [B, H, n, blocks] and
    their sort keys, ascending per tile (int64: the replay's thresholds may pass int32's range)."""
    b, s, h, r = q_lr.shape
    q = np.asarray(q_lr, np.float32)
    k = np.asarray(k_lr, np.float32).reshape(b, s // kv_block, kv_block, h, r).mean(2)
    proxy = q.reshape(b, s // q_tile, q_tile, h, r).mean(2)[:, tiles]
    scores = np.einsum("bthr,bshr->bhts", proxy, k)
    ordered = np.sort(np.asarray(sortable_key(scores)).astype(np.int64), axis=-1)
    return {"proxy": proxy, "keys": k, "scores": scores, "ordered": ordered}


def passes_model(sampled: dict, top_k, *, tuning) -> float:
    """Mean counting passes per sampled tile of the kernel's select (a numpy replay of its bracketing; a
    program of 16 tiles runs as many as its slowest)."""
    proxy, k = sampled["proxy"], sampled["keys"]
    ordered = sampled["ordered"]
    num_keys, bits = k.shape[1], tuning.radix_bits
    n = 1 << bits
    seeded = tuning.sample > 0 and num_keys >= SEED_MIN_RATIO * tuning.sample
    seeds = None
    if seeded:
        p = np.transpose(proxy, (0, 2, 1, 3))
        seeds = np.asarray(first_thresholds(p, np.transpose(k, (0, 2, 1, 3)), top_k, tuning.sample, n))
    counts = []
    for idx in np.ndindex(ordered.shape[:3]):
        row = ordered[idx]
        lo, hi, passes = -(2**31), 2**31 - 1, 0
        while True:
            if passes == 0 and seeded:
                t = seeds[idx].astype(np.int64)
            else:
                w = max((hi >> bits) - (lo >> bits), 1)
                t = lo + w * np.arange(n)
            c = len(row) - np.searchsorted(row, t, side="left")  # keys >= t
            passes += 1
            enough = c >= top_k
            lo = max(lo, int(t[enough].max())) if enough.any() else lo
            hi = min(hi, int(t[~enough].min())) if (~enough).any() else hi
            if (enough & (c == top_k)).any() or hi - lo == 1 or passes > 40:
                break
        counts.append(passes)
    return float(np.mean(counts))


def recall(ids, sampled: dict, top_k, *, tiles) -> float:
    """Share of the exact fp32 top-k ids (sampled tiles) that the selection holds. On the GPU the kernel's
    scores are dot products at TopkTuning.precision (TF32 by default), so near-ties at the k-th score may swap:
    recall, not position, measures that."""
    exact = np.argpartition(-sampled["scores"], top_k - 1, axis=-1)[..., :top_k]
    got = np.asarray(ids)[:, :, tiles]
    hits = [np.intersect1d(exact[i], got[i]).size for i in np.ndindex(got.shape[:3])]
    return float(np.sum(hits) / (len(hits) * top_k))


def run(cfg, variants, budget, interpret):
    rows, attention = [], []
    base = for_device()[1]
    q_tile, h = cfg["q_tile"], cfg["heads"]
    for seq in cfg["seqs"]:
        tiles = np.sort(np.random.default_rng(seq).choice(seq // q_tile, min(8, seq // q_tile), replace=False))
        if cfg["inputs"] == "walk":
            q_lr, k_lr = lowrank_inputs(jax.random.key(seq), seq, h, cfg["rank"])
            tables = {"lowrank": mass_table(q_lr, k_lr, q_tile=q_tile, tiles=tiles)}
        else:
            q, k, q_lr, k_lr = projected_inputs(jax.random.key(seq), seq, h, cfg["head_dim"], cfg["rank"])
            tables = {
                "lowrank": mass_table(q_lr, k_lr, q_tile=q_tile, tiles=tiles),
                "full": mass_table(q, k, q_tile=q_tile, tiles=tiles),
            }
            del q, k
        for kv_block in cfg["kv_blocks"]:
            sampled = sampled_scores(q_lr, k_lr, q_tile=q_tile, kv_block=kv_block, tiles=tiles)
            masses = {name: block_mass(t, kv_block) for name, t in tables.items()}
            for sparsity in cfg["sparsities"]:
                top_k = max(1, round((1 - sparsity) * seq / kv_block))
                exact = exact_topk(q_lr, k_lr, top_k, q_tile=q_tile, kv_block=kv_block, tiles=tiles)
                first_ids = None  # of the first variant: a speed-only tuning must pick the same ids, bit for bit
                for variant in variants:
                    tuning = dataclasses.replace(base, **variant)
                    row = {
                        "seq": seq,
                        "kv_block": kv_block,
                        "sparsity": sparsity,
                        "top_k": top_k,
                        "variant": json.dumps(variant),
                        "tuning": str(tuning),
                    }
                    if not budget.allows(30):
                        row["skipped"] = "time budget"
                        rows.append(row)
                        continue
                    try:
                        select = functools.partial(
                            lowrank_topk_pallas,
                            top_k=top_k,
                            q_tile=q_tile,
                            kv_block=kv_block,
                            block_reduce="mean",
                            tuning=tuning,
                            interpret=interpret,
                        )
                        compiled, row["compile_s"] = harness.compile_timed(select, q_lr, k_lr)
                        ids = compiled(q_lr, k_lr)
                        row.update(
                            check_selection(ids, q_lr, k_lr, top_k, q_tile=q_tile, kv_block=kv_block, tiles=tiles)
                        )
                        row["recall"] = recall(ids, sampled, top_k, tiles=tiles)
                        for name, m in masses.items():
                            got = mass_captured(ids[:, :, tiles], exact, m)
                            row[f"mass_captured_{name}"] = got["mean"]
                            row[f"mass_captured_{name}_min"] = got["min"]
                            row[f"exact_mass_{name}"] = got["exact_mass"]
                        if first_ids is None:
                            first_ids = ids
                        else:
                            row["same_ids_as_first"] = bool(jax.numpy.array_equal(ids, first_ids))
                        t = harness.time_fn(compiled, q_lr, k_lr, warmup=1, iters=cfg["iters"])
                        row.update(select_ms=t["median_ms"], min_ms=t["min_ms"], max_ms=t["max_ms"])
                        row["passes"] = passes_model(sampled, top_k, tuning=tuning)
                        scores = (seq // q_tile) * h * (seq // kv_block)
                        row["score_passes_per_ns"] = scores * (row["passes"] + 1) / (row["select_ms"] * 1e6)
                    except Exception as e:  # recorded; the run goes on
                        row["error"] = harness.error_text(e, trace=True)
                    rows.append(row)
                    print(json.dumps({k_: v for k_, v in row.items() if k_ not in ("tuning", "error")}), flush=True)
    for seq in cfg["attention_seqs"]:
        q, k, v, do = harness.random_qkv(jax.random.key(seq + 1), seq, h, cfg["head_dim"])
        _, fwd_bwd = sparse_fns(q_tile, 1, for_device()[0], interpret)
        for sparsity in cfg["sparsities"]:
            row = {"seq": seq, "sparsity": sparsity, "kv_block": 1}
            if not budget.allows(60):
                row["skipped"] = "time budget"
                attention.append(row)
                continue
            try:
                idx, cnt = random_selection(
                    jax.random.key(seq + 2),
                    seq=seq,
                    heads=h,
                    q_tile=q_tile,
                    group=cfg["token_group"],
                    keep=1 - sparsity,
                )
                idx, cnt = to_tokens(idx, cnt, cfg["token_group"])
                compiled, row["compile_s"] = harness.compile_timed(fwd_bwd, q, k, v, idx, cnt, do)
                t = harness.time_fn(compiled, q, k, v, idx, cnt, do, warmup=1, iters=3)
                row.update(fwd_bwd_ms=t["median_ms"], min_ms=t["min_ms"], max_ms=t["max_ms"])
            except Exception as e:
                row["error"] = harness.error_text(e, trace=True)
            attention.append(row)
            print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "error"}), flush=True)
    for row in rows:  # the selection's share of the token-level attention it feeds, same run
        match = [
            a for a in attention if a["seq"] == row["seq"] and a["sparsity"] == row["sparsity"] and "fwd_bwd_ms" in a
        ]
        if row["kv_block"] == 1 and match and "select_ms" in row:
            row["share_of_attention"] = row["select_ms"] / match[0]["fwd_bwd_ms"]
    return rows, attention


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU, interpret mode, tiny sizes")
    parser.add_argument("--seqs", type=int, nargs="+")
    parser.add_argument("--sparsities", type=float, nargs="+")
    parser.add_argument("--kv-blocks", type=int, nargs="+")
    parser.add_argument("--attention-seqs", type=int, nargs="*", help="token-level attention at these S ([] none)")
    parser.add_argument("--variants", help="JSON list of TopkTuning overrides ({} = the device default)")
    parser.add_argument("--inputs", choices=["projected", "walk"], help="q_lr, k_lr (see the module docstring)")
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument("--name", default="bench_topk")
    args = parser.parse_args()

    cfg = dict(QUICK if args.quick else FULL)
    for key in ("seqs", "sparsities", "kv_blocks", "attention_seqs", "inputs"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    variants = json.loads(args.variants) if args.variants else cfg["variants"]
    known = {f.name for f in dataclasses.fields(for_device()[1])}
    for variant in variants:
        if not isinstance(variant, dict) or set(variant) - known:
            parser.error(f"--variants: {variant!r} is not a dict of TopkTuning fields ({sorted(known)})")
    budget = harness.Budget(args.budget_s, reserve=10.0, start=time.time())
    interpret = not harness.on_gpu()
    rows, attention = run(cfg, variants, budget, interpret)
    harness.write_results(
        args.name,
        {"config": cfg, "variants": variants, "rows": rows, "attention": attention, "wall_s": budget.elapsed()},
    )
    print()
    harness.print_table(
        [r for r in rows if "select_ms" in r],
        [
            "seq",
            "kv_block",
            "sparsity",
            "variant",
            "select_ms",
            "min_ms",
            "max_ms",
            "passes",
            "score_passes_per_ns",
            "share_of_attention",
            "same_ids_as_first",
        ],
    )
    print()
    harness.print_table(
        [r for r in rows if "select_ms" in r],
        [
            "seq",
            "kv_block",
            "sparsity",
            "variant",
            "id_agreement",
            "recall",
            "mass_captured_lowrank",
            "mass_captured_lowrank_min",
            "mass_captured_full",
            "mass_captured_full_min",
            "exact_mass_full",
        ],
    )
    if attention:
        harness.print_table(attention, ["seq", "sparsity", "fwd_bwd_ms", "min_ms", "max_ms"])


if __name__ == "__main__":
    main()
