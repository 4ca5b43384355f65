"""Time the selection kernel (lowrank_topk, Pallas Triton lowering) per tuning, at token level and 3D blocks,
and measure the attention mass its selection captures against an exact top-k's.

    python -m experiments.bench_topk                                   # one GPU, <= ~4 min (--budget-s 240)
    python -m experiments.bench_topk --variants '[{}, {"sample": 0}, {"warps": 8}]'
    python -m experiments.bench_topk --quick                           # CPU, interpret mode, tiny sizes
    python -m experiments.bench_topk --seqs 65536 131072 --kv-blocks 1 --q-tile 32 \
        --attention-seqs 65536 131072 --name bench_topk_token   # issue 38: the share of token attention

Per sequence length S (B=1, H=16, rank 16, q_tile 64 or --q-tile) and kv_block (1 = token level, 16 / 32 / 64 =
3D blocks), the selection at each sparsity (top_k = (1 - sparsity) * S / kv_block) with every tuning variant
(overrides of the device's TopkTuning, `{}` = the default; the default run compares the score dot's precision, tf32 /
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
                precision variant may not: that is what it is for); compared by ids_fingerprint.

Inputs (--inputs): "projected" (default): q, k [1, S, H, 128] drawn as video attention's mix of local and
global keys (a component shared by neighbouring tokens, smooth over ~64 positions of the tile-major sequence,
plus independent noise; logits scaled so that the top 10% of keys hold ~80% of a query's mass) and q_lr, k_lr
their fixed random rank-16 projection (one per head, scaled so that q_lr k_lr^T / sqrt(16) estimates
q k^T / sqrt(128)): a predictor that correlates with the true logits as a learnt one does, less well (at 10%
of the keys its tile selection holds ~40% of the true mass at 32k). "walk": bench_sparse_attention's smooth
low-rank q_lr, k_lr alone (the earlier runs' inputs; no full q, k, so no _full mass).

Why the time is what it is: every counting pass recomputes each score (a rank-16 dot) and counts it into one of
2**radix_bits buckets. `passes` is how many counting passes the select needs, from a numpy model of the
kernel's bracketing on the sampled tiles' scores (seeded or not, as the variant is); `score_passes_per_ns`
is S/q_tile * H * S/kv_block scores times (passes + 1 compaction pass) per nanosecond of the kernel.

With --attention-seqs, the token-level sparse attention (random 16-token groups) fwd+bwd is timed too at
those S, on the path `sparse_attention(impl="auto")` picks (recorded as `path`: with the `token` extra on a
GPU, the jax-triton token kernels), so that each selection's share of it (issue 38's goal: <= 0.3 at 128k)
comes from one run. Writes experiments/results/bench_topk.json (and $OUT/ when set).

Each job runs in a child process (this one never starts jax's backend), so that a crash costs its row, not the
run: per S the first variant's rows (the default `{}`, put first: the key result), then the attention, then
per S the other variants' rows, variant by variant, precision variants last (`plan`). A child records each
stage before it starts it (`Progress`); one that dies (an abort in XLA's compile) or spends more than
--job-timeout-s in a stage leaves its rows in that stage's scope with `status` "crashed" / "timed out", the
`stage` and the tail of its stderr (`error`), and a new child goes on with the rest. --budget-s: no row starts
past it (rows left: `skipped`); the last jobs, the precision variants at the largest S, go first.
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import dataclasses
import faulthandler
import functools
import json
import os
import re
import tempfile
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
    to_tokens,
)
from pallas_kernels.lowrank_topk_triton import SEED_MIN_RATIO, first_bracket, lowrank_topk_pallas, sortable_key
from pallas_kernels.tuning import TopkTuning, for_device

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


def bracket_passes(row, top_k: int, bits: int, seed=None) -> int:
    """Counting passes the kernel's select spends on one tile: a numpy replay of its bracketing over the tile's
    sort keys `row` (int64, ascending). Each pass counts at base + i * 2**m, the least m that spans [base, top)
    in 2**bits steps; a seeded first pass spans the sample's bracket `seed` (low, high) instead of [lo, hi)."""
    n = 1 << bits
    lo, hi, passes = -(2**31), 2**31 - 1, 0
    while True:
        base, top = (
            (int(seed[0]), max(int(seed[1]), int(seed[0]) + 1)) if passes == 0 and seed is not None else (lo, hi)
        )
        span, m = top - base - 1, 0
        while span >> m >= n:
            m += 1
        t = base + (np.arange((span >> m) + 1, dtype=np.int64) << m)
        c = len(row) - np.searchsorted(row, t, side="left")  # keys >= t
        passes += 1
        enough = c >= top_k
        lo = max(lo, int(t[enough].max())) if enough.any() else lo
        hi = min(hi, int(t[~enough].min())) if (~enough).any() else hi
        if (enough & (c == top_k)).any() or hi - lo == 1 or passes > 40:
            return passes


def passes_model(sampled: dict, top_k, *, tuning) -> float:
    """Mean counting passes per sampled tile of the kernel's select (`bracket_passes`; a program of 16 tiles runs
    as many as its slowest)."""
    proxy, k = sampled["proxy"], sampled["keys"]
    ordered = sampled["ordered"]
    num_keys = k.shape[1]
    seeded = tuning.sample > 0 and num_keys >= SEED_MIN_RATIO * tuning.sample
    seeds = None
    if seeded:
        p = np.transpose(proxy, (0, 2, 1, 3))
        seeds = np.asarray(first_bracket(p, np.transpose(k, (0, 2, 1, 3)), top_k, tuning.sample))
    counts = [
        bracket_passes(ordered[idx], top_k, tuning.radix_bits, None if seeds is None else seeds[idx])
        for idx in np.ndindex(ordered.shape[:3])
    ]
    return float(np.mean(counts))


def recall(ids, sampled: dict, top_k, *, tiles) -> float:
    """Share of the exact fp32 top-k ids (sampled tiles) that the selection holds. On the GPU the kernel's
    scores are dot products at TopkTuning.precision (TF32 by default), so near-ties at the k-th score may swap:
    recall, not position, measures that."""
    exact = np.argpartition(-sampled["scores"], top_k - 1, axis=-1)[..., :top_k]
    got = np.asarray(ids)[:, :, tiles]
    hits = [np.intersect1d(exact[i], got[i]).size for i in np.ndindex(got.shape[:3])]
    return float(np.sum(hits) / (len(hits) * top_k))


def ids_fingerprint(ids) -> str:
    """64 bits that stand for a whole id array: two sums (mod 2**32) of a 32-bit hash of each id with its
    position. Equal arrays give equal fingerprints; arrays that differ anywhere, in an id or an order, differ but
    with chance ~2**-64. Rows measured in different processes compare their ids bit for bit by it, without
    moving them (1.7 GB at 128k, token level)."""

    @jax.jit
    def fingerprint(ids):
        x = ids.reshape(-1).astype(jnp.uint32)
        pos = jax.lax.iota(jnp.uint32, x.size)

        def mix(seed):  # a bijection of x at each position, then murmur3's finaliser
            h = (x * jnp.uint32(0x9E3779B1)) ^ ((pos + jnp.uint32(seed)) * jnp.uint32(0x85EBCA77))
            h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
            h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
            return jnp.sum(h ^ (h >> 16), dtype=jnp.uint32)

        return jnp.stack([mix(0), mix(0x5BD1E995)])

    return "".join(f"{int(v):08x}" for v in np.asarray(fingerprint(ids)))


def top_k_of(seq, kv_block, sparsity) -> int:
    return max(1, round((1 - sparsity) * seq / kv_block))


# -- a child process: one job's rows, stage by stage -------------------------------------------------------

# Test hook (tests/experiments/test_bench_topk.py): a JSON list of {"fault": "abort" | "hang", **row key items};
# a child aborts (as XLA's fatal checks do) or hangs at the "compile" stage of each row whose key has the items.
FAULT_ENV = "BENCH_TOPK_TEST_FAULT"


class Progress:
    """A child's progress, as JSON lines in a file that the parent reads however the child ends:
    {"running": stage, "scope": {...}, "row": {...} or null} before each stage (the scope: the row key items
    whose rows a crash there takes down, e.g. {"seq": S} for the inputs), {"row": {...}} after each finished
    row. Every stage is watched: one that runs past timeout_s (a hang, in C++ too) dumps the Python stacks to
    stderr and ends the process (faulthandler), as a fatal signal (XLA's abort) dumps them."""

    def __init__(self, path: str, timeout_s: float):
        self.file = open(path, "a")
        self.timeout_s = timeout_s
        self.faults = json.loads(os.environ.get(FAULT_ENV, "[]"))
        faulthandler.enable()

    def _write(self, record):
        self.file.write(json.dumps(record, default=float) + "\n")
        self.file.flush()  # in the kernel's hands before the stage starts: an abort cannot lose it

    def stage(self, name: str, scope: dict, row: dict | None = None):
        self._write({"running": name, "scope": scope, "row": row})
        faulthandler.dump_traceback_later(self.timeout_s, exit=True)
        for fault in self.faults if name == "compile" else ():
            if all(scope.get(k) == v for k, v in fault.items() if k != "fault"):
                os.abort() if fault["fault"] == "abort" else time.sleep(1e9)

    def done(self, row: dict):
        faulthandler.cancel_dump_traceback_later()
        self._write({"row": row})
        print(json.dumps({k: v for k, v in row.items() if k not in ("tuning", "error")}), flush=True)

    def close(self):
        faulthandler.cancel_dump_traceback_later()
        self.file.close()


def sampled_tiles(seq, q_tile):
    return np.sort(np.random.default_rng(seq).choice(seq // q_tile, min(8, seq // q_tile), replace=False))


def measure_select(job, progress: Progress) -> dict:
    """A select job's rows (one S): the inputs and mass tables once, each kv_block's sampled scores and each
    sparsity's exact top-k when first needed, then per row the kernel compiled, checked, measured and timed."""
    cfg, seq = job["cfg"], job["seq"]
    q_tile, h = cfg["q_tile"], cfg["heads"]
    base, interpret = for_device()[1], not harness.on_gpu()
    tiles = sampled_tiles(seq, q_tile)
    progress.stage("inputs and mass tables", {"seq": seq})
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
    jax.block_until_ready(tables)
    per_block, exacts = {}, {}  # kv_block -> (sampled scores, masses); (kv_block, sparsity) -> exact top-k
    for key in job["rows"]:
        if time.time() + 30 > job["deadline"]:
            return {"stopped": "time budget"}
        kv_block, sparsity = key["kv_block"], key["sparsity"]
        top_k = top_k_of(seq, kv_block, sparsity)
        if kv_block not in per_block:
            progress.stage("sampled scores and block masses", {"seq": seq, "kv_block": kv_block})
            sampled = sampled_scores(q_lr, k_lr, q_tile=q_tile, kv_block=kv_block, tiles=tiles)
            per_block[kv_block] = sampled, {name: block_mass(t, kv_block) for name, t in tables.items()}
        sampled, masses = per_block[kv_block]
        if (kv_block, sparsity) not in exacts:
            progress.stage("exact top-k", {"seq": seq, "kv_block": kv_block, "sparsity": sparsity})
            exacts[kv_block, sparsity] = jax.block_until_ready(
                exact_topk(q_lr, k_lr, top_k, q_tile=q_tile, kv_block=kv_block, tiles=tiles)
            )
        exact = exacts[kv_block, sparsity]
        tuning = dataclasses.replace(base, **json.loads(key["variant"]))  # its values: checked by main
        row = {**key, "top_k": top_k, "tuning": str(tuning)}
        progress.stage("compile", key, row)
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
            progress.stage("check", key, row)
            ids = compiled(q_lr, k_lr)
            row.update(check_selection(ids, q_lr, k_lr, top_k, q_tile=q_tile, kv_block=kv_block, tiles=tiles))
            row["recall"] = recall(ids, sampled, top_k, tiles=tiles)
            for name, m in masses.items():
                got = mass_captured(ids[:, :, tiles], exact, m)
                row[f"mass_captured_{name}"] = got["mean"]
                row[f"mass_captured_{name}_min"] = got["min"]
                row[f"exact_mass_{name}"] = got["exact_mass"]
            row["ids_fingerprint"] = ids_fingerprint(ids)
            del ids
            progress.stage("time", key, row)
            t = harness.time_fn(compiled, q_lr, k_lr, warmup=1, iters=cfg["iters"])
            row.update(select_ms=t["median_ms"], min_ms=t["min_ms"], max_ms=t["max_ms"])
            row["passes"] = passes_model(sampled, top_k, tuning=tuning)
            scores = (seq // q_tile) * h * (seq // kv_block)
            row["score_passes_per_ns"] = scores * (row["passes"] + 1) / (row["select_ms"] * 1e6)
        except Exception as e:  # recorded; the job goes on
            row["error"] = harness.error_text(e, trace=True)
        progress.done(row)
    return {"finished": True}


def measure_attention(job, progress: Progress) -> dict:
    """An attention job's rows: the token-level sparse attention (random 16-token groups) fwd+bwd at one S,
    per sparsity, on the path sparse_attention picks (recorded: the rows' `path`)."""
    from pallas_kernels.sparse_attention import kernel_path, sparse_attention

    cfg, seq = job["cfg"], job["seq"]
    h, q_tile, group = cfg["heads"], cfg["q_tile"], cfg["token_group"]
    progress.stage("inputs", {"seq": seq})
    q, k, v, do = harness.random_qkv(jax.random.key(seq + 1), seq, h, cfg["head_dim"])
    path = kernel_path(q, k, v, q_tile=q_tile, kv_block=1)[0]
    fwd_bwd = harness.fwd_bwd(
        lambda q, k, v, index, count: sparse_attention(q, k, v, index, count, q_tile=q_tile, kv_block=1), 3
    )
    for key in job["rows"]:
        if time.time() + 60 > job["deadline"]:
            return {"stopped": "time budget"}
        row = {**key, "kv_block": 1, "path": path}
        progress.stage("compile", key, row)
        try:
            selection = random_selection(
                jax.random.key(seq + 2), seq=seq, heads=h, q_tile=q_tile, group=group, keep=1 - key["sparsity"]
            )
            idx, cnt = to_tokens(*selection, group)
            compiled, row["compile_s"] = harness.compile_timed(fwd_bwd, q, k, v, idx, cnt, do)
            progress.stage("time", key, row)
            t = harness.time_fn(compiled, q, k, v, idx, cnt, do, warmup=1, iters=3)
            row.update(fwd_bwd_ms=t["median_ms"], min_ms=t["min_ms"], max_ms=t["max_ms"])
        except Exception as e:
            row["error"] = harness.error_text(e, trace=True)
        progress.done(row)
    return {"finished": True}


def child_main(job: dict, progress_path: str):
    progress = Progress(progress_path, job["stage_timeout_s"])
    measure = measure_select if job["kind"] == "select" else measure_attention
    answer = measure(job, progress)
    progress.close()
    harness.answer(answer)


# -- the parent: jobs in child processes, crash by crash ---------------------------------------------------


def ordered_variants(variants: list[dict]) -> list[dict]:
    """The default ({}) first, precision variants last, the others between (in the order given)."""
    return sorted(variants, key=lambda v: 0 if v == {} else 2 if "precision" in v else 1)


def plan(cfg: dict, variants: list[dict]) -> list[dict]:
    """Jobs in the order they run, each in its own child process with its rows in order: per S the first
    variant's rows (the default's: the key result), then the token-level attention, then per S the other
    variants' rows, variant by variant (precision variants last)."""

    def select_job(seq, some):
        rows = [
            {"seq": seq, "kv_block": kv_block, "sparsity": sparsity, "variant": json.dumps(v)}
            for v in some
            for kv_block in cfg["kv_blocks"]
            for sparsity in cfg["sparsities"]
        ]
        return {"kind": "select", "seq": seq, "cfg": cfg, "rows": rows}

    jobs = [select_job(seq, variants[:1]) for seq in cfg["seqs"]]
    for seq in cfg["attention_seqs"]:
        rows = [{"seq": seq, "sparsity": sparsity} for sparsity in cfg["sparsities"]]
        jobs.append({"kind": "attention", "seq": seq, "cfg": cfg, "rows": rows})
    if len(variants) > 1:
        jobs += [select_job(seq, variants[1:]) for seq in cfg["seqs"]]
    return jobs


def run_child(job: dict, timeout_s: float) -> tuple[dict, list[dict]]:
    """One job in a child process: (its answer, or harness.in_child's {"error": ...} where it crashed or ran
    out of time, and the progress records it left)."""
    fd, path = tempfile.mkstemp(prefix="bench_topk_", suffix=".jsonl")
    os.close(fd)
    try:
        answer = harness.in_child("experiments.bench_topk", ["--job", json.dumps(job), "--progress", path], timeout_s)
        with open(path) as f:
            lines = f.read().splitlines()
    finally:
        os.remove(path)
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by the crash
            pass
    return answer, records


WATCHDOG = re.compile(r"Timeout \(\d+:\d\d:\d\d\)!")  # faulthandler's words when a stage ran past its limit


def base_row(key: dict) -> dict:
    """What a row holds before it is measured: its key and top_k (a select row) or kv_block 1 (attention)."""
    if "variant" in key:
        return {**key, "top_k": top_k_of(key["seq"], key["kv_block"], key["sparsity"])}
    return {**key, "kv_block": 1}


def run_job(job: dict, budget, job_timeout_s: float, runner=run_child) -> tuple[list[dict], list[dict]]:
    """All rows of `job`, child after child: (rows, one record per child). A child that crashes or times out
    (no answer) takes down the rows in the scope of the stage it was in (one row, or every row sharing the
    inputs that stage made); those rows are recorded with their `status` ("crashed" / "timed out"), the
    `stage` and the tail of the child's stderr (`error`), and a new child goes on with the rest. Rows that the
    budget leaves no time for are recorded as skipped."""
    rows, children, pending = [], [], list(job["rows"])
    while pending:
        if not budget.allows(30):
            break
        t0 = time.time()
        left = min(budget.left(), 1e6)  # the child stops starting rows then; its time limit: a stage more
        child_job = {**job, "rows": pending, "deadline": time.time() + left, "stage_timeout_s": job_timeout_s}
        answer, records = runner(child_job, left + 2 * job_timeout_s)
        finished = [r["row"] for r in records if "running" not in r]
        rows += finished
        done = [{k: r[k] for k in pending[0]} for r in finished]
        pending = [key for key in pending if key not in done]
        child = {"kind": job["kind"], "seq": job["seq"], "rows": len(finished), "wall_s": time.time() - t0}
        children.append(child)
        if "error" not in answer:
            child["ended"] = answer.get("stopped", "finished")
            break
        running = records[-1] if records and "running" in records[-1] else None
        timed_out = answer["error"].startswith("no answer within") or WATCHDOG.search(answer["error"])
        child["ended"] = "timed out" if timed_out else "crashed"
        child["stage"] = running["running"] if running else None
        if running is None and finished:
            continue  # died between rows: the next child goes on
        scope = running["scope"] if running else {}  # none: it died before its first stage, and would again
        hit = [key for key in pending if all(key.get(k) == v for k, v in scope.items())] or pending
        for key in hit:
            row = dict(running["row"]) if running and running["row"] and running["scope"] == key else base_row(key)
            row.update(status=child["ended"], stage=running["running"] if running else "start", error=answer["error"])
            rows.append(row)
        pending = [key for key in pending if key not in hit]
    rows += [{**base_row(key), "skipped": "time budget"} for key in pending]
    return rows, children


def run(cfg, variants, budget, job_timeout_s, runner=run_child):
    """Every job of `plan`, in order: (select rows, attention rows, one record per child process)."""
    rows, attention, children = [], [], []
    for job in plan(cfg, variants):
        got, kids = run_job(job, budget, job_timeout_s, runner)
        (rows if job["kind"] == "select" else attention).extend(got)
        children += kids
        for kid in kids:
            print(f"[{budget.elapsed():5.0f} s] {json.dumps(kid)}", flush=True)
    return summarise(rows, attention, cfg, variants), attention, children


def summarise(rows, attention, cfg, variants):
    """The select rows in the table's order (S, kv_block, sparsity, variant as given), with same_ids_as_first
    (a row's ids against the first variant's at the same S, kv_block and sparsity, by their fingerprints) and
    share_of_attention (a token-level row's time over the same run's token-level attention fwd+bwd)."""
    order = [json.dumps(v) for v in variants]
    place = lambda r: (
        cfg["seqs"].index(r["seq"]),
        cfg["kv_blocks"].index(r["kv_block"]),
        r["sparsity"],
        order.index(r["variant"]),
    )
    rows = sorted(rows, key=place)
    first = {(r["seq"], r["kv_block"], r["sparsity"]): r for r in rows if r["variant"] == order[0]}
    for row in rows:
        ref = first.get((row["seq"], row["kv_block"], row["sparsity"]))
        if row is not ref and "ids_fingerprint" in row and ref and "ids_fingerprint" in ref:
            row["same_ids_as_first"] = row["ids_fingerprint"] == ref["ids_fingerprint"]
        match = [
            a for a in attention if a["seq"] == row["seq"] and a["sparsity"] == row["sparsity"] and "fwd_bwd_ms" in a
        ]
        if row["kv_block"] == 1 and match and "select_ms" in row:
            row["share_of_attention"] = row["select_ms"] / match[0]["fwd_bwd_ms"]
    return rows


TIME_COLUMNS = [
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
]
MASS_COLUMNS = [
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
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU, interpret mode, tiny sizes")
    parser.add_argument("--seqs", type=int, nargs="+")
    parser.add_argument("--sparsities", type=float, nargs="+")
    parser.add_argument("--kv-blocks", type=int, nargs="+")
    parser.add_argument("--attention-seqs", type=int, nargs="*", help="token-level attention at these S ([] none)")
    parser.add_argument("--variants", help="JSON list of TopkTuning overrides ({} = the device default)")
    parser.add_argument("--inputs", choices=["projected", "walk"], help="q_lr, k_lr (see the module docstring)")
    parser.add_argument("--q-tile", type=int, help="queries per selection tile and attention group (default 64)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no row after this (see the docstring)")
    parser.add_argument(
        "--job-timeout-s", type=float, default=60.0, help="a child's stage (setup, compile, check, time) past this"
    )
    parser.add_argument("--name", default="bench_topk")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # a child process: run this job
    parser.add_argument("--progress", help=argparse.SUPPRESS)  # ... writing its progress here
    args = parser.parse_args()
    if args.job:
        child_main(json.loads(args.job), args.progress)
        return

    cfg = dict(QUICK if args.quick else FULL)
    for key in ("seqs", "sparsities", "kv_blocks", "attention_seqs", "inputs", "q_tile"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    variants = json.loads(args.variants) if args.variants else cfg["variants"]
    known = {f.name for f in dataclasses.fields(TopkTuning)}
    for variant in variants:
        if not isinstance(variant, dict) or set(variant) - known:
            parser.error(f"--variants: {variant!r} is not a dict of TopkTuning fields ({sorted(known)})")
        try:
            TopkTuning(**variant)
        except (TypeError, ValueError) as e:
            parser.error(f"--variants: {variant!r}: {e}")
    variants = ordered_variants(variants)
    cfg["variants"] = variants
    budget = harness.Budget(args.budget_s, reserve=10.0, start=time.time())
    rows, attention, children = run(cfg, variants, budget, args.job_timeout_s)  # this process never starts jax
    harness.write_results(
        args.name + ("_quick" if args.quick else ""),  # a CPU smoke run never replaces a GPU run's file
        {
            "config": cfg,
            "variants": variants,
            "rows": rows,
            "attention": attention,
            "children": children,
            "wall_s": budget.elapsed(),
        },
    )
    tables = [
        ([r for r in rows if "select_ms" in r], TIME_COLUMNS),
        ([r for r in rows if "recall" in r], MASS_COLUMNS),  # a row that died while timed has its mass
        ([r for r in attention if "fwd_bwd_ms" in r], ["seq", "sparsity", "path", "fwd_bwd_ms", "min_ms", "max_ms"]),
    ]
    lost = [r for r in rows + attention if {"status", "skipped", "error"} & set(r)]
    if lost:  # what the run could not measure, and why (the whole text in the JSON's "error")
        lost = [
            {
                **r,
                "why": r.get("status") or r.get("skipped") or "error",
                "first_line": (r.get("error", "").strip().splitlines() or [""])[0][:160],
            }
            for r in lost
        ]
        tables.append((lost, ["seq", "kv_block", "sparsity", "variant", "why", "stage", "first_line"]))
    for part, columns in tables:
        if part:
            print()
            harness.print_table(part, columns)


if __name__ == "__main__":
    main()
