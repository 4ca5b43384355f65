"""Several GPUs (issue 8): attention strategies, 2.7B training with context parallelism, and
data-parallel training of the 0.8B width with dual-constraint vs equal-token bucketing.

    python -m experiments.bench_multigpu                    # every GPU of this host
    python -m experiments.bench_multigpu --quick            # 8 fake CPU devices, tiny sizes
    python -m experiments.bench_multigpu --quick --spawn 2  # 2 processes x 4 CPU devices (jax.distributed)
    # several hosts: on each, ... --coordinator HOST:PORT --processes N --process-id I
    ... --budget-s 550 --train-tokens 65536 --order attention data train   # a time-limited run

1. Attention alone, S in {64k, 128k, 256k}, H=16, D=128, bf16, B=1, context axis = all devices:
   dense (ulysses, ring, allgather, hybrid-as-planned) and sparse with mean sparsity 0.9 over
   heterogeneous heads (ulysses in head order / rebalanced / uneven head slots, allgather,
   selective with the exact capacity `selective_capacity` reports, hybrid-as-planned with and without
   rebalancing). The selection comes from `select_kv_blocks` on low-rank features with positional
   structure (nearby blocks score high, as video attention's do). Fwd+bwd median time, bytes per
   device per call (formula and traced collectives), error against single-device attention at the
   smallest S (before timing).
2. Training steps of the 2.7B preset at 128k tokens (latents 32x128x128, one sample) with the context
   axis over all devices: full attention (cuDNN inside context parallelism, planner's dense plan) vs
   DSV-style sparse attention (per-head top-k from low-rank features of q and k, standing in for the
   learned predictor); tokens/s and the ratio. --train-tokens sets the size (a multiple of 16384:
   latents T x 128 x 128, e.g. 65536 -> 16x128x128); progress is printed after the compile, the
   warm-up step and every timed step, so a run cut short shows where its time went.
3. Data-parallel training (mesh data axis = all devices, context 1) on the mixed image/video set of
   experiments/load_balance.py (its bucket mix, shape benchmark + cost fit, batch rules and interleaved
   measurement are imported from there): the 0.8B preset's width at --data-depth layers (default 8, as
   load_balance; 28 is the full preset), M_mem = 4 of the longest clips per device. Per mode
   (equal_tokens, dual): --data-steps timed steps after every program is compiled and warmed up;
   step-time median and CV (std/mean), tokens/s, distinct compiled (B, shape) programs, OOMs,
   compiles during the timed steps; and tokens/s of dual over equal. --quick: load_balance's tiny model.

Parts run in --order (default attention train data); --skip-* drop one. Results: after every measured
row, experiments/results/bench_multigpu[_<parts>][_quick][_<N>proc].json (parts named when not all run).

--budget-s T: a wall-clock budget counted from process start. Before each part / size / variant the
time left is compared with an estimate and the item is skipped, with the reason recorded in its row,
when it does not fit. Estimates: from this run's own measurements where there are some (part 1: the
same variant's first call and median at the previous size, times scaled by (S/S_prev)^2; part 2: the
first variant's compile and step time for the second; part 3: before it, the fit's programs and 4
steps per mode; after the fit, its compile time per program and its cost model for the dual rule's
extra programs and the timed steps, which are cut to what fits, 4 at least), else the constants of
ESTIMATES below: compile times that are conservative guesses for H200 (part 2's 2.7B program is the
largest) and step times from the step's FLOPs (dsv_jax.model.flops) at 30% of the bf16 ceiling (2.7B,
2 GPUs: ~56 s per step at 128k tokens, ~15 s at 64k). In multi-process runs process 0 decides for all.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import socket
import subprocess
import sys
import time

from experiments import STARTED
from experiments.quick_cpu import use_cpu

# wall-clock start of the run (--budget-s counts from here; processes of --spawn inherit the parent's)
T0 = float(os.environ.get("BENCH_MULTIGPU_T0", STARTED))
PARTS = ("attention", "train", "data")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes on fake CPU devices")
    ap.add_argument("--sizes", type=int, nargs="*", help="sequence lengths of part 1 (default 64k 128k 256k)")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per measurement")
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-data", action="store_true")
    ap.add_argument(
        "--order",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="parts to run, in this order (default: attention train data)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock seconds from process start: skip (and record) what does not fit",
    )
    ap.add_argument("--train-steps", type=int, default=None, help="timed training steps per variant")
    ap.add_argument(
        "--train-tokens",
        type=int,
        default=None,
        help="part 2 tokens per sample (default 131072: latents 32x128x128; 65536: 16x128x128)",
    )
    ap.add_argument("--data-steps", type=int, default=None, help="part 3 timed steps per mode (default 60; quick 8)")
    ap.add_argument("--data-depth", type=int, default=8, help="part 3 layers of the 0.8B preset (28: all)")
    ap.add_argument("--results-dir", default=None, help="where the results JSON goes (default experiments/results)")
    ap.add_argument(
        "--kernel-model",
        default=None,
        help="cp_model results JSON for the planner (default: experiments/results/cp_model.json when it exists)",
    )
    ap.add_argument("--spawn", type=int, default=0, help="launch this many local processes (CPU test of multi-process)")
    ap.add_argument("--coordinator", help="HOST:PORT of process 0 (multi-process)")
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    return ap.parse_args(argv)


def spawn(args) -> int:
    """Run this script in args.spawn local processes sharing 8 CPU devices; print process 0's output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rest, skip = [], False
    for a in sys.argv[1:]:  # the same arguments without --spawn N
        if skip or a.startswith("--spawn="):
            skip = False
            continue
        skip = a == "--spawn"
        if not skip:
            rest.append(a)
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // args.spawn}",
        JAX_PLATFORMS="cpu",
        BENCH_MULTIGPU_T0=repr(T0),
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "experiments.bench_multigpu",
                *rest,
                "--coordinator",
                f"127.0.0.1:{port}",
                "--processes",
                str(args.spawn),
                "--process-id",
                str(i),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(args.spawn)
    ]
    outs = [p.communicate()[0] for p in procs]
    print(outs[0])
    for i, (p, out) in enumerate(zip(procs, outs)):
        if p.returncode:
            print(f"--- process {i} failed (exit {p.returncode}) ---\n{out[-4000:]}")
            return p.returncode
    return 0


# Arguments first: they decide the processes and, before jax starts, its devices.
ARGS = parse_args()
if ARGS.spawn:
    sys.exit(spawn(ARGS))
if ARGS.quick and ARGS.processes == 1:
    use_cpu(devices=8)

import jax  # noqa: E402

if ARGS.processes > 1:
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        try:  # CPU collectives across processes (the default in newer jax)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (AttributeError, ValueError):
            pass
    jax.distributed.initialize(
        coordinator_address=ARGS.coordinator, num_processes=ARGS.processes, process_id=ARGS.process_id
    )

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from dsv_jax.attention import attention  # noqa: E402
from dsv_jax.config import ParallelConfig, get_config  # noqa: E402
from dsv_jax.data.cost_model import predict_schedule  # noqa: E402
from dsv_jax.model.flops import parameter_count, train_step_flops  # noqa: E402
from dsv_jax.parallel import ContextAttention, context_attention, make_mesh, select_kv_blocks, selective_capacity  # noqa: E402
from dsv_jax.parallel.comm import collective_bytes, context_bytes  # noqa: E402
from dsv_jax.parallel.planner import Hardware, KernelModel, Workload, candidate_cost, plan_attention  # noqa: E402
from experiments import harness  # noqa: E402
from experiments.training import time_train_step  # noqa: E402
from pallas_kernels.sparse_attention import sparse_attention  # noqa: E402

SKEWED = (0.6, 0.7, 0.8, 0.85) + (0.9541666666666667,) * 12  # mean 0.9 (as experiments/cp_model.py)
MAIN = jax.process_index() == 0


def profile(heads):
    """Per-head sparsity of `heads` heads: SKEWED repeated."""
    return tuple(SKEWED[i % len(SKEWED)] for i in range(heads))


def say(*a):
    if MAIN:
        print(*a, flush=True)


def clock() -> str:
    return f"[{time.time() - T0:5.0f} s]"


# -- the --budget-s guard ---------------------------------------------------------------------

# Estimates (seconds) used until the run has measured its own. GPU: conservative guesses for H200
# (load_balance measured ~18 s per 0.8B depth-8 program on one H200; the 2.7B program at 128k tokens
# with context parallelism is the largest); CPU: the --quick sizes on a busy 2-core machine.
ESTIMATES = {
    "gpu": {
        "attention_setup": 30.0,
        "attention_refs": 60.0,
        "attention_variant": 60.0,
        "train_compile": 180.0,
        "data_compile": 30.0,
        "mfu": 0.3,
    },
    "cpu": {
        "attention_setup": 5.0,
        "attention_refs": 5.0,
        "attention_variant": 10.0,
        "train_compile": 20.0,
        "train_step": 2.0,
        "data_compile": 8.0,
        "data_step": 0.2,
    },
}


def estimates() -> dict:
    return ESTIMATES["gpu" if harness.on_gpu() else "cpu"]


BUDGET = harness.Budget(ARGS.budget_s, start=T0)


def agree(x: int) -> int:
    """Process 0's value on every process: what runs must be the same everywhere, or collectives hang."""
    if jax.process_count() == 1:
        return int(x)
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(x)))


def over_budget(estimate_s: float, what: str) -> str | None:
    """None when `estimate_s` fits in the time left (process 0 decides for all), else the reason to skip
    `what` (printed)."""
    reason = BUDGET.skip_reason(estimate_s, fits=bool(agree(BUDGET.allows(estimate_s))))
    if reason:
        say(f"  {clock()} skip {what}: {reason}")
    return reason


def flops_step_s(cfg, shape, batch: int, devices: int) -> float:
    """Estimated step time: the work of the step (dsv_jax.model.flops) at ESTIMATES' share of the bf16 ceiling."""
    work = train_step_flops(cfg, shape, batch)["work"]
    return work / (devices * harness.H200_BF16_TFLOPS * 1e12 * estimates()["mfu"])


# -- part 1: attention alone ------------------------------------------------------------------


def structured_lowrank(key, shape, kv_block, rank=16, noise=0.5):
    """q_lr, k_lr [B, S, H, r]: sin/cos of the block position at r/2 frequencies plus per-head noise,
    so a tile's best blocks are mostly its neighbourhood plus a spread of far ones."""
    b, s, h = shape[:3]
    pos = (jnp.arange(s) // kv_block).astype(jnp.float32)
    nb = s // kv_block
    freqs = 2 * jnp.pi / (nb / 2.0 ** jnp.arange(rank // 2))
    pe = jnp.concatenate([jnp.cos(pos[:, None] * freqs), jnp.sin(pos[:, None] * freqs)], -1)  # [S, r]
    kq, kk = jax.random.split(key)
    q_lr = pe[None, :, None] + noise * jax.random.normal(kq, (b, s, h, rank))
    k_lr = pe[None, :, None] + noise * jax.random.normal(kk, (b, s, h, rank))
    return q_lr, k_lr


def kernel_model(path):
    path = path or os.path.join(harness.RESULTS_DIR, "cp_model.json")
    return KernelModel.from_json(path) if os.path.exists(path) else KernelModel()


def bench_attention(mesh, sizes, heads, head_dim, dtype, iters, tile, km, rows, save):
    """Appends one row per (size, variant) to `rows`, calling save() after each (a run cut short keeps them)."""
    n = mesh.shape["context"]
    seq = NamedSharding(mesh, P(None, "context"))
    rep = NamedSharding(mesh, P())
    est = estimates()
    seen = {}  # variant name -> (S, first call s, median s): the budget guard's estimates

    def variant_estimate(name, s):
        if name in seen:
            s0, first, med = seen[name]
            return 1.25 * (first + (2 + iters) * med * (s / s0) ** 2)
        here = [variant_estimate(v, s) for v in seen]
        return max(here) if here else est["attention_variant"]

    for si, s in enumerate(sizes):
        setup = est["attention_setup"] + (est["attention_refs"] if si == 0 else 0.0)
        reason = over_budget(
            setup + min([variant_estimate(v, s) for v in seen] or [est["attention_variant"]]), f"S={s}"
        )
        if reason:
            rows.append({"seq_len": s, "variant": "all", "skipped": reason})
            save()
            continue
        shape = (1, s, heads, head_dim)
        gen = jax.jit(lambda key: jax.random.normal(key, shape, dtype), out_shardings=seq)
        q, k, v, do = (gen(jax.random.key(i)) for i in range(4))
        nb = s // tile
        top_k = tuple(max(1, round((1 - x) * nb)) for x in profile(heads))
        lowrank = jax.jit(lambda key: structured_lowrank(key, shape, tile), out_shardings=(seq, seq))
        q_lr, k_lr = lowrank(jax.random.key(9))
        select = jax.jit(lambda a, b: select_kv_blocks(a, b, top_k, mesh=mesh, q_tile=tile, kv_block=tile))
        idx, cnt = select(q_lr, k_lr)
        keep = np.array([t / nb for t in top_k])
        sparsity = tuple(float(1 - x) for x in keep)
        dense_w = Workload(
            seq_len=s, heads=heads, head_dim=head_dim, q_tile=tile, kv_block=tile, recompute_forward=False
        )
        sparse_w = dataclasses.replace(dense_w, head_sparsity=sparsity)
        dense_place = plan_attention(dense_w, n, kernels=km)
        sparse_place = plan_attention(sparse_w, n, kernels=km)
        ulysses_slots = None
        if heads % n == 0:  # the planner's best head-slot count for pure HCP
            costs = [
                candidate_cost(sparse_w, n, 1, "allgather", Hardware(), km, slots=m)
                for m in range(heads // n, min(heads, 2 * heads // n) + 1)
            ]
            ulysses_slots = min(costs, key=lambda c: c.time_s).hcp_slots

        variants = []  # (name, sparse, context_attention keywords)
        if heads % n == 0:
            variants.append(("ulysses", False, dict(strategy="ulysses")))
        variants += [
            ("ring", False, dict(strategy="ring")),
            ("allgather", False, dict(strategy="allgather")),
            (
                f"hybrid-planned {dense_place.hcp}x{dense_place.scp} {dense_place.scp_strategy}",
                False,
                dict(strategy="hybrid", degrees=(dense_place.hcp, dense_place.scp), scp=dense_place.scp_strategy),
            ),
        ]
        if heads % n == 0:
            variants += [
                ("ulysses, heads in order", True, dict(strategy="ulysses", head_perm=None)),
                ("ulysses, rebalanced", True, dict(strategy="ulysses")),
                (
                    f"ulysses, rebalanced, {ulysses_slots} slots",
                    True,
                    dict(strategy="ulysses", hcp_slots=ulysses_slots),
                ),
            ]
        variants += [("allgather", True, dict(strategy="allgather")), ("selective", True, dict(strategy="selective"))]
        hp = dict(
            strategy="hybrid",
            degrees=(sparse_place.hcp, sparse_place.scp),
            scp=sparse_place.scp_strategy,
            hcp_slots=sparse_place.hcp_slots if sparse_place.hcp > 1 else None,
        )
        slots_note = f", {sparse_place.hcp_slots} slots" if sparse_place.hcp > 1 else ""
        variants.append(
            (f"hybrid-planned {sparse_place.hcp}x{sparse_place.scp} {sparse_place.scp_strategy}{slots_note}", True, hp)
        )
        if sparse_place.hcp > 1:
            variants.append(("hybrid-planned, heads in order", True, {**hp, "head_perm": None, "hcp_slots": None}))

        refs = None
        if si == 0:  # correctness first, at the smallest size: single-device attention, replicated

            def ref_fn(q, k, v, idx, cnt, do, sparse):
                # the single-device sparse kernel (itself checked against the reference by
                # bench_sparse_attention); the plain-JAX reference's backward does not fit at 64k
                f = (
                    (lambda q, k, v: sparse_attention(q, k, v, idx, cnt, q_tile=tile, kv_block=tile))
                    if sparse
                    else (lambda q, k, v: attention(q, k, v))
                )
                return harness.fwd_bwd(f)(q, k, v, do)

            # replicated inputs: cuDNN attention refuses operands sharded along the sequence
            whole = [jax.device_put(x, rep) for x in (q, k, v, idx, cnt, do)]
            refs = {sp: jax.jit(ref_fn, static_argnums=6, out_shardings=rep)(*whole, sp) for sp in (False, True)}
            del whole

        for name, sparse, kw in variants:
            if kw.get("scp") == "selective" or kw.get("strategy") == "selective":
                ph, ps = kw.get("degrees", (1, n))
                kw = {
                    **kw,
                    "capacity": int(
                        selective_capacity(
                            idx,
                            cnt,
                            mesh=mesh,
                            degrees=(ph, ps),
                            head_perm="auto" if kw.get("head_perm", "auto") is not None else None,
                            hcp_slots=kw.get("hcp_slots"),
                            q_tile=tile,
                            kv_block=tile,
                        )
                    ),
                }

            def call(q, k, v, idx, cnt, kw=kw, sparse=sparse):
                extra = dict(kv_index=idx, kv_count=cnt, q_tile=tile, kv_block=tile) if sparse else {}
                return context_attention(q, k, v, mesh=mesh, **kw, **extra)

            fwd_bwd = harness.fwd_bwd(call, 3)  # (q, k, v, idx, cnt, do) -> (out, (dq, dk, dv))
            step = jax.jit(fwd_bwd)
            row = {"seq_len": s, "attention": "sparse" if sparse else "dense", "variant": name}
            key = f"{row['attention']} {name}"
            reason = over_budget(variant_estimate(key, s), f"S={s} {row['attention']} {name}")
            if reason:
                rows.append({**row, "skipped": reason})
                save()
                continue
            try:
                t_first = time.perf_counter()
                got = step(q, k, v, idx, cnt, do)
                jax.block_until_ready(got)
                t_first = time.perf_counter() - t_first
                if refs is not None:
                    err = jax.jit(
                        lambda a, b: jnp.max(
                            jnp.stack(
                                [
                                    jnp.linalg.norm((x - y).astype(jnp.float32))
                                    / jnp.linalg.norm(y.astype(jnp.float32))
                                    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
                                ]
                            )
                        ),
                        out_shardings=rep,
                    )(got, refs[sparse])
                    row["rel_error_max"] = float(err)
                t = harness.time_fn(step, q, k, v, idx, cnt, do, warmup=1, iters=iters, agree=agree)
                row.update(median_ms=t["median_ms"], spread_pct=t["spread_pct"], first_call_s=t_first)
                seen[key] = (s, t_first, t["median_ms"] / 1e3)
            except Exception as e:  # one variant failing (e.g. memory) must not lose the others
                row["error"] = harness.error_text(e)
            ph, ps = kw.get("degrees", (n, 1) if kw["strategy"] == "ulysses" else (1, n))
            scp = kw.get("scp") or ("allgather" if kw["strategy"] == "ulysses" else kw["strategy"])
            formula = context_bytes(
                hcp=ph,
                scp=ps,
                scp_strategy=scp,
                batch=1,
                seq_len=s,
                heads=heads,
                head_dim=head_dim,
                itemsize=jnp.dtype(dtype).itemsize,
                sparse=sparse,
                top_k=int(idx.shape[-1]),
                q_tile=tile,
                kv_block=tile,
                capacity=kw.get("capacity", 0),
                mesh_devices=n,
                hcp_slots=kw.get("hcp_slots"),
            )
            traced = collective_bytes(fwd_bwd, q, k, v, idx, cnt, do)
            row.update(
                hcp=ph,
                scp=ps,
                scp_strategy=scp,
                capacity=kw.get("capacity"),
                hcp_slots=kw.get("hcp_slots"),
                bytes_per_device=formula["total"],
                bytes_traced=traced["total"],
                bytes_match=abs(traced["total"] - formula["total"]) <= 1e-6 * formula["total"] + 64,
            )
            rows.append(row)
            say(
                f"  S={s} {row['attention']:6s} {name:48s} {row.get('median_ms', float('nan')):10.2f} ms  "
                f"{row['bytes_per_device'] / 1e6:9.1f} MB"
                f"{'' if row['bytes_match'] else ' (traced ' + str(row['bytes_traced']) + ')'}"
                f"  err {row.get('rel_error_max', '')} {row.get('error', '')}"
            )
            save()
        base = min(
            (r["median_ms"] for r in rows if r["seq_len"] == s and r.get("attention") == "dense" and "median_ms" in r),
            default=None,
        )
        for r in rows:
            if r["seq_len"] == s and base and "median_ms" in r:
                r["speedup_over_best_dense"] = base / r["median_ms"]
        save()


# -- part 2: training with context parallelism -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DSVStyleAttention(ContextAttention):
    """Sparse context-parallel attention for the benchmark: each head keeps its top (1 - s_h) KV blocks
    scored by the first `rank` dims of q and k (stop-gradient; stands in for DSV's learned predictor).
    A bare backend, not a DSV plan, so the step records no cp/ exchange statistics: blocks over the
    selective capacity take the exact all-gather path, which the library logs as a warning."""

    head_sparsity: tuple[float, ...] = SKEWED
    rank: int = 16
    tile: int = 64

    def __call__(self, q, k, v, *, kv_lens=None, sm_scale=None, **options):
        if kv_lens is not None:
            raise ValueError("DSVStyleAttention needs token grids without padding (kv_lens=None)")
        nb = q.shape[1] // self.tile
        top_k = tuple(max(1, round((1 - s) * nb)) for s in self.head_sparsity)
        q_lr, k_lr = (jax.lax.stop_gradient(x[..., : self.rank]) for x in (q, k))
        idx, cnt = select_kv_blocks(q_lr, k_lr, top_k, mesh=self.mesh, q_tile=self.tile, kv_block=self.tile)
        return super().__call__(
            q,
            k,
            v,
            sm_scale=sm_scale,
            kv_index=idx,
            kv_count=cnt,
            q_tile=self.tile,
            kv_block=self.tile,
            sparsity=self.head_sparsity,
            **options,
        )


def train_latent(tokens: int, patch, tile, prefer=(64, 32, 128, 16, 8)) -> tuple[int, int, int]:
    """Latent (T, H, W) of one sample with `tokens` tokens: a square token grid g x g (the first of
    `prefer` that works: T = tokens / g^2 whole attention tiles, g a multiple of the tile)."""
    for g in prefer:
        t = tokens // (g * g)
        if t * g * g == tokens and t % tile[0] == 0 and g % tile[1] == 0 and g % tile[2] == 0:
            return t * patch[0], g * patch[1], g * patch[2]
    raise ValueError(
        f"--train-tokens {tokens}: no T x g x g token grid with g in {prefer} and whole {tile} tiles "
        f"(use a multiple of 16384 for 128 x 128 latents)"
    )


def bench_training(mesh, quick, steps, tokens, rows, save):
    n = mesh.shape["context"]
    if quick:
        overrides = [
            "model.hidden=64",
            "model.heads=8",
            "model.depth=2",
            "model.text_dim=16",
            "model.patch=[1,2,2]",
            "model.tile=[2,4,4]",
            "text.max_len=8",
            "text.hash_buckets=8",
        ]
        tokens, tile = tokens or 1024, 16  # latents 4x32x32
        cfg = get_config("tiny", overrides + [f"parallel.context={n}", "parallel.fsdp=1"])
    else:
        tokens, tile = tokens or 131072, 64  # latents 32x128x128: 32 x 64 x 64 tokens, whole 4x4x4 tiles
        cfg = get_config("2.7b", [f"parallel.context={n}", "parallel.fsdp=1", "model.dtype=bfloat16"])
    if tokens % (n * tile):
        raise ValueError(f"--train-tokens {tokens} is not a multiple of {n} devices x the {tile}-token tile")
    latent = train_latent(tokens, cfg.model.patch, cfg.model.tile)
    heads = cfg.model.heads
    sparsity = profile(heads)
    n_params = parameter_count(cfg)
    est = estimates()
    compile_est = est["train_compile"]
    step_est = est["train_step"] if "train_step" in est else flops_step_s(cfg, latent, 1, n)
    say(
        f"  {cfg.name}: {n_params / 1e9:.2f}B params, latents {'x'.join(map(str, latent))} = {tokens} tokens, "
        f"{steps} timed steps per variant; estimates: compile {compile_est:.0f} s, step {step_est:.1f} s"
    )
    backends = {
        "full (cuDNN / XLA inside CP)": ContextAttention(mesh, "hybrid"),
        "DSV-style sparse": DSVStyleAttention(
            mesh, "hybrid", head_sparsity=sparsity, tile=tile, options=(("capacity", 0.5),)
        ),
    }
    for name, backend in backends.items():
        row = {"variant": name, "tokens": tokens, "latent": list(latent), "devices": n, "preset": cfg.name}
        reason = over_budget(compile_est + (steps + 1) * step_est, f"part 2 {name}")
        if reason:
            rows.append({**row, "skipped": reason})
            save()
            continue
        try:  # progress after the compile, the warm-up and every step: a run cut short shows where its time went
            r = time_train_step(
                cfg,
                latent,
                steps,
                attention=backend,
                mesh=mesh,
                lr=1e-5,
                on_event=lambda what, sec, name=name: say(f"  {clock()} {name}: {what} {sec:.3f} s"),
            )
            row.update(
                compile_s=r["compile_s"],
                warmup_s=r["warmup_s"],
                step_s=r["step_s"],
                step_times_s=r["step_times_s"],
                tokens_per_s=r["tokens_per_s"],
                loss=r["loss"],
            )
            compile_est, step_est = r["compile_s"], r["step_s"]  # the sparse variant's estimates: no slower than full
        except Exception as e:
            row["error"] = harness.error_text(e)
        rows.append(row)
        say(
            f"  {name:32s} {row.get('step_s', float('nan')):8.3f} s/step  {row.get('tokens_per_s', 0):10.0f} tok/s "
            f"{row.get('error', '')}"
        )
        if len(rows) == 2 and all("step_s" in r for r in rows):
            rows[1]["speedup_over_full"] = rows[0]["step_s"] / rows[1]["step_s"]
        save()


# -- part 3: data-parallel training, dual-constraint vs equal-token bucketing --------------------


def bench_data_parallel(n, quick, steps, depth, rows, setup, save):
    """Part 3 (see the module doc): load_balance's experiment on a data-parallel mesh over `n` devices.
    One row per mode in `rows` (updated and saved after every block of timed steps); the fit, batch
    sizes and buckets in `setup`."""
    from experiments import load_balance as lb

    t_part = time.time()
    cfg = lb.make_config(quick, depth=depth, overrides=[f"parallel.data={n}", "parallel.context=1", "parallel.fsdp=1"])
    buckets = lb.mix(quick)
    bench = lb.StepBench(cfg)
    seq = np.array([bench.seq_len(b.shape) for b in buckets])
    shares = np.array([b.share for b in buckets])
    m_mem = 4 * int(seq.max()) * bench.dp  # load_balance's cap (4 of the longest clips) per device
    eq_b = lb.equal_batches(bench, seq, m_mem)
    n_params = parameter_count(cfg)
    iters = 3 if quick else 5
    est = estimates()
    step_est = (
        est["data_step"] if "data_step" in est else flops_step_s(cfg, buckets[int(seq.argmax())].shape, 4 * bench.dp, n)
    )
    programs = len(buckets) + 1  # the fit's: equal-token batch per bucket and the shortest at half batch
    fit_steps = programs * (2 + iters)
    setup.update(
        preset=cfg.name,
        depth=cfg.model.depth,
        hidden=cfg.model.hidden,
        params=n_params,
        data_parallel=bench.dp,
        m_mem_tokens=m_mem,
        buckets=[
            {"name": b.name, "shape": list(b.shape), "seq_len": int(s), "share": b.share} for b, s in zip(buckets, seq)
        ],
    )
    say(
        f"  {cfg.name} depth {cfg.model.depth} hidden {cfg.model.hidden} ({n_params / 1e6:.0f}M params), data "
        f"parallel over {bench.dp}; M_mem = {m_mem} tokens per global batch; estimates: compile "
        f"{est['data_compile']:.0f} s x {programs}, step {step_est:.2f} s"
    )
    # the fit and 4 timed steps per mode: the dual rule's extra programs and the timed steps are checked
    # again once the fit has measured compile and step times
    reason = over_budget(programs * est["data_compile"] + (fit_steps + 2 * 4) * step_est, "part 3")
    if reason:
        rows += [{"mode": m, "skipped": reason} for m in ("equal_tokens", "dual")]
        save()
        return

    fit, points, compile_s = lb.shape_benchmark(bench, buckets, eq_b, iters)
    modes, target, _ = lb.batch_modes(fit, seq, shares, eq_b, m_mem, bench.dp)
    predicted = {m: predict_schedule(fit, seq, shares, bb) for m, bb in modes.items()}
    setup.update(
        fit={"a": fit.a, "b": fit.b, "p": fit.p, "r2": fit.r2, "max_rel_error": fit.max_rel_error, "points": points},
        target_step_s=target,
        batch_sizes={m: bb.tolist() for m, bb in modes.items()},
        predicted=predicted,
    )
    say(
        f"  {clock()} fit: t = {fit.a * 1e3:.2f} ms + {fit.b:.3g} * B * S^{fit.p:.3f} (R^2 {fit.r2:.3f}); "
        f"batches equal {modes['equal_tokens'].tolist()} dual {modes['dual'].tolist()}"
    )
    save()
    missing = {(int(b), bk.shape) for bb in modes.values() for b, bk in zip(bb, buckets)} - set(bench._compiled)
    per_program = compile_s / max(1, len(points))
    reason = over_budget(
        1.25
        * (
            len(missing) * per_program
            + sum(p["mean_step_s"] for p in predicted.values()) * (len(modes) * len(buckets) + 2 * 4)
        )
        + 5,
        "part 3 dual programs and timed steps",
    )
    if reason:
        rows += [{"mode": m, "skipped": reason} for m in modes]
        save()
        return
    batches, more = lb.compile_modes(bench, buckets, modes)
    setup["compile_s"] = compile_s + more
    setup["programs_compiled"] = len(bench._compiled)
    say(f"  {clock()} {len(bench._compiled)} programs compiled in {compile_s + more:.0f} s and warmed up")

    per_pair = 1.25 * sum(p["mean_step_s"] for p in predicted.values())  # one step of each mode, with margin
    fit_in = int((BUDGET.left() - 5) / per_pair) if math.isfinite(BUDGET.left()) else steps
    n_steps = agree(min(steps, fit_in))
    if n_steps < min(steps, 4):
        reason = over_budget(4 * per_pair + 5, "part 3 timed steps")
        rows += [{"mode": m, "skipped": reason or "budget"} for m in modes]
        save()
        return
    if n_steps < steps:
        say(f"  {clock()} part 3: {n_steps} of {steps} steps per mode fit the budget")
        setup["steps_cut_by_budget"] = {"asked": steps, "run": n_steps}
    rows += [{"mode": m} for m in modes]
    first = len(rows) - len(modes)

    def record(measured):
        for i, (m, r) in enumerate(measured.items()):
            rows[first + i].update(
                mode=m,
                steps=r["steps"],
                median_step_ms=r["median_step_ms"],
                step_cv=r["step_cv"],
                tokens_per_s=r["tokens_per_s"],
                programs=r["programs"],
                ooms=r["ooms"],
                predicted_cv=predicted[m]["cv"],
                predicted_tokens_per_s=predicted[m]["tokens_per_s"],
                compiled_peak_bytes=r["compiled_peak_bytes"],
                step_times_s=r["step_times_s"],
            )
        eq, du = measured["equal_tokens"]["tokens_per_s"], measured["dual"]["tokens_per_s"]
        if eq > 0 and math.isfinite(du):
            rows[first + 1]["tokens_per_s_ratio_dual_over_equal"] = du / eq
        save()

    measured, n_compiles, losses = lb.measure_modes(bench, buckets, seq, modes, batches, n_steps, on_block=record)
    record(measured)
    for r in rows[first:]:
        r.update(compiles_during_timed_steps=n_compiles, losses_finite=all(math.isfinite(x) for x in losses))
    setup["wall_s"] = time.time() - t_part
    for r in rows[first:]:
        say(
            f"  {r['mode']:13s} median {r['median_step_ms']:8.1f} ms  CV {100 * r['step_cv']:5.1f}%  "
            f"{r['tokens_per_s']:10.0f} tok/s  {r['programs']} programs  {r['ooms']} OOMs"
        )
    say(
        f"  dual / equal tokens/s: {rows[first + 1].get('tokens_per_s_ratio_dual_over_equal', float('nan')):.3f}; "
        f"compiles during the timed steps: {n_compiles}"
    )
    save()


def main():
    quick = ARGS.quick or not harness.on_gpu()
    n = jax.device_count()
    mesh = make_mesh(ParallelConfig(data=1, fsdp=1, context=n))
    km = kernel_model(ARGS.kernel_model)
    say(
        f"{n} devices over {jax.process_count()} process(es): {jax.devices()[0].device_kind}; "
        f"planner kernels: {km.source}" + (f"; budget {ARGS.budget_s:.0f} s" if ARGS.budget_s is not None else "")
    )
    payload = {
        "quick": quick,
        "devices": n,
        "processes": jax.process_count(),
        "kernel_model": km.source,
        "head_sparsity": SKEWED,
        "budget_s": ARGS.budget_s,
    }
    skip = {"attention": ARGS.skip_attention, "train": ARGS.skip_train, "data": ARGS.skip_data}
    order = [p for p in dict.fromkeys(ARGS.order) if not skip[p]]
    parts = (
        "" if set(order) == set(PARTS) else "".join("_" + {"train": "training"}.get(p, p) for p in PARTS if p in order)
    )
    name = (
        "bench_multigpu"
        + parts
        + ("_quick" if quick else "")
        + (f"_{jax.process_count()}proc" if jax.process_count() > 1 else "")
    )

    def save():  # after every measurement, so that a run stopped by its time limit keeps what it measured
        if MAIN:
            payload["wall_s"] = time.time() - T0
            harness.write_results(name, payload, ARGS.results_dir)

    for part in order:
        if part == "attention":
            if quick:
                sizes, heads, head_dim, dtype, tile = ARGS.sizes or [512], 8, 16, jnp.float32, 16
            else:
                sizes, heads, head_dim, dtype, tile = ARGS.sizes or [65536, 131072, 262144], 16, 128, jnp.bfloat16, 64
            say(f"{clock()} part 1: attention fwd+bwd")
            payload["attention_shapes"] = {
                "heads": heads,
                "head_dim": head_dim,
                "dtype": jnp.dtype(dtype).name,
                "tile": tile,
            }
            payload["attention"] = []
            bench_attention(
                mesh,
                sizes,
                heads,
                head_dim,
                dtype,
                ARGS.iters or (1 if quick else 5),
                tile,
                km,
                payload["attention"],
                save,
            )
        elif part == "train":
            say(f"{clock()} part 2: training steps with context parallelism")
            payload["training"] = []
            bench_training(
                mesh, quick, ARGS.train_steps or (1 if quick else 3), ARGS.train_tokens, payload["training"], save
            )
        else:
            say(f"{clock()} part 3: data-parallel training, equal-token vs dual-constraint bucketing")
            payload["data_parallel"], payload["data_parallel_setup"] = [], {}
            bench_data_parallel(
                n,
                quick,
                ARGS.data_steps or (8 if quick else 60),
                ARGS.data_depth,
                payload["data_parallel"],
                payload["data_parallel_setup"],
                save,
            )
    save()
    say(f"{clock()} wrote", os.path.join(ARGS.results_dir or harness.RESULTS_DIR, name + ".json"))


if __name__ == "__main__":
    main()
