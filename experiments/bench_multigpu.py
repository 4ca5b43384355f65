"""Context parallelism on several GPUs (issue 8): attention strategies, then 2.7B training with CP.

    PYTHONPATH=. python experiments/bench_multigpu.py                    # every GPU of this host
    PYTHONPATH=. python experiments/bench_multigpu.py --quick            # 8 fake CPU devices, tiny sizes
    PYTHONPATH=. python experiments/bench_multigpu.py --quick --spawn 2  # 2 processes x 4 CPU devices (jax.distributed)
    # several hosts: on each, ... --coordinator HOST:PORT --processes N --process-id I

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
   learned predictor); tokens/s and the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import socket
import subprocess
import sys


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes on fake CPU devices")
    ap.add_argument("--sizes", type=int, nargs="*", help="sequence lengths of part 1 (default 64k 128k 256k)")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per measurement")
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--train-steps", type=int, default=None, help="timed training steps per variant")
    ap.add_argument("--kernel-model", default=None, help="cp_model results JSON for the planner (default: "
                    "experiments/results/cp_model.json when it exists)")
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
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // args.spawn}", JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *rest, "--coordinator", f"127.0.0.1:{port}",
                               "--processes", str(args.spawn), "--process-id", str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(args.spawn)]
    outs = [p.communicate()[0] for p in procs]
    print(outs[0])
    for i, (p, out) in enumerate(zip(procs, outs)):
        if p.returncode:
            print(f"--- process {i} failed (exit {p.returncode}) ---\n{out[-4000:]}")
            return p.returncode
    return 0


ARGS = parse_args()
if ARGS.spawn:
    sys.exit(spawn(ARGS))
if ARGS.quick and ARGS.processes == 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

if ARGS.processes > 1:
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        try:  # CPU collectives across processes (the default in newer jax)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (AttributeError, ValueError):
            pass
    jax.distributed.initialize(coordinator_address=ARGS.coordinator, num_processes=ARGS.processes,
                               process_id=ARGS.process_id)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from experiments import harness  # noqa: E402
from dsv_jax.attention import attention  # noqa: E402
from dsv_jax.config import ParallelConfig, get_config  # noqa: E402
from dsv_jax.parallel import ContextPlan, context_attention, make_mesh, select_kv_blocks, selective_capacity  # noqa: E402
from dsv_jax.parallel.comm import collective_bytes, context_bytes  # noqa: E402
from dsv_jax.parallel.context import OVERFLOW_EVENTS  # noqa: E402
from dsv_jax.parallel.planner import Hardware, KernelModel, Workload, candidate_cost, plan_attention  # noqa: E402
from pallas_kernels.sparse_attention import sparse_attention  # noqa: E402

SKEWED = (0.6, 0.7, 0.8, 0.85) + (0.9541666666666667,) * 12  # mean 0.9 (as experiments/cp_model.py)
MAIN = jax.process_index() == 0


def profile(heads):
    """Per-head sparsity of `heads` heads: SKEWED repeated."""
    return tuple(SKEWED[i % len(SKEWED)] for i in range(heads))


def say(*a):
    if MAIN:
        print(*a, flush=True)


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
    for si, s in enumerate(sizes):
        shape = (1, s, heads, head_dim)
        gen = jax.jit(lambda key: jax.random.normal(key, shape, dtype), out_shardings=seq)
        q, k, v, do = (gen(jax.random.key(i)) for i in range(4))
        nb = s // tile
        top_k = tuple(max(1, round((1 - x) * nb)) for x in profile(heads))
        q_lr, k_lr = jax.jit(lambda key: structured_lowrank(key, shape, tile), out_shardings=(seq, seq))(jax.random.key(9))
        idx, cnt = jax.jit(lambda a, b: select_kv_blocks(a, b, top_k, mesh=mesh, q_tile=tile, kv_block=tile))(q_lr, k_lr)
        keep = np.array([t / nb for t in top_k])
        sparsity = tuple(float(1 - x) for x in keep)
        dense_w = Workload(seq_len=s, heads=heads, head_dim=head_dim, q_tile=tile, kv_block=tile, recompute_forward=False)
        sparse_w = dataclasses.replace(dense_w, head_sparsity=sparsity)
        plan_d, plan_s = plan_attention(dense_w, n, kernels=km), plan_attention(sparse_w, n, kernels=km)
        ulysses_slots = None
        if heads % n == 0:  # the planner's best head-slot count for pure HCP
            costs = [candidate_cost(sparse_w, n, 1, "allgather", Hardware(), km, slots=m)
                     for m in range(heads // n, min(heads, 2 * heads // n) + 1)]
            ulysses_slots = min(costs, key=lambda c: c.time_s).hcp_slots

        variants = []  # (name, sparse, context_attention keywords)
        if heads % n == 0:
            variants.append(("ulysses", False, dict(strategy="ulysses")))
        variants += [("ring", False, dict(strategy="ring")), ("allgather", False, dict(strategy="allgather")),
                     (f"hybrid-planned {plan_d.hcp}x{plan_d.scp} {plan_d.scp_strategy}", False,
                      dict(strategy="hybrid", degrees=(plan_d.hcp, plan_d.scp), scp=plan_d.scp_strategy))]
        if heads % n == 0:
            variants += [("ulysses, heads in order", True, dict(strategy="ulysses", head_perm=None)),
                         ("ulysses, rebalanced", True, dict(strategy="ulysses")),
                         (f"ulysses, rebalanced, {ulysses_slots} slots", True,
                          dict(strategy="ulysses", hcp_slots=ulysses_slots))]
        variants += [("allgather", True, dict(strategy="allgather")), ("selective", True, dict(strategy="selective"))]
        hp = dict(strategy="hybrid", degrees=(plan_s.hcp, plan_s.scp), scp=plan_s.scp_strategy,
                  hcp_slots=plan_s.hcp_slots if plan_s.hcp > 1 else None)
        slots_note = f", {plan_s.hcp_slots} slots" if plan_s.hcp > 1 else ""
        variants.append((f"hybrid-planned {plan_s.hcp}x{plan_s.scp} {plan_s.scp_strategy}{slots_note}", True, hp))
        if plan_s.hcp > 1:
            variants.append(("hybrid-planned, heads in order", True, {**hp, "head_perm": None, "hcp_slots": None}))

        refs = None
        if si == 0:  # correctness first, at the smallest size: single-device attention, replicated
            def ref_fn(q, k, v, do, idx, cnt, sparse):
                # the single-device sparse kernel (itself checked against the reference by
                # bench_sparse_attention); the plain-JAX reference's backward does not fit at 64k
                f = ((lambda q, k, v: sparse_attention(q, k, v, idx, cnt, q_tile=tile, kv_block=tile))
                     if sparse else (lambda q, k, v: attention(q, k, v)))
                out, vjp = jax.vjp(f, q, k, v)
                return (out, *vjp(do))
            # replicated inputs: cuDNN attention refuses operands sharded along the sequence
            whole = [jax.device_put(x, rep) for x in (q, k, v, do, idx, cnt)]
            refs = {sp: jax.jit(ref_fn, static_argnums=6, out_shardings=rep)(*whole, sp) for sp in (False, True)}
            del whole

        for name, sparse, kw in variants:
            if kw.get("scp") == "selective" or kw.get("strategy") == "selective":
                ph, ps = kw.get("degrees", (1, n))
                kw = {**kw, "capacity": int(selective_capacity(
                    idx, cnt, mesh=mesh, degrees=(ph, ps), head_perm="auto" if kw.get("head_perm", "auto") is not None
                    else None, hcp_slots=kw.get("hcp_slots"), q_tile=tile, kv_block=tile))}

            def call(q, k, v, idx, cnt, kw=kw, sparse=sparse):
                extra = dict(kv_index=idx, kv_count=cnt, q_tile=tile, kv_block=tile) if sparse else {}
                return context_attention(q, k, v, mesh=mesh, **kw, **extra)

            def fwd_bwd(q, k, v, do, idx, cnt, call=call):
                out, vjp = jax.vjp(lambda q, k, v: call(q, k, v, idx, cnt), q, k, v)
                return (out, *vjp(do))

            step = jax.jit(fwd_bwd)
            row = {"seq_len": s, "attention": "sparse" if sparse else "dense", "variant": name}
            try:
                got = step(q, k, v, do, idx, cnt)
                if refs is not None:
                    err = jax.jit(lambda a, b: jnp.max(jnp.stack([
                        jnp.linalg.norm((x - y).astype(jnp.float32)) / jnp.linalg.norm(y.astype(jnp.float32))
                        for x, y in zip(a, b)])), out_shardings=rep)(got, refs[sparse])
                    row["rel_error_max"] = float(err)
                t = harness.time_fn(step, q, k, v, do, idx, cnt, warmup=1, iters=iters)
                row.update(median_ms=t["median_ms"], spread_pct=t["spread_pct"])
            except Exception as e:  # one variant failing (e.g. memory) must not lose the others
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            ph, ps = kw.get("degrees", (n, 1) if kw["strategy"] == "ulysses" else (1, n))
            scp = kw.get("scp") or ("allgather" if kw["strategy"] == "ulysses" else kw["strategy"])
            formula = context_bytes(hcp=ph, scp=ps, scp_strategy=scp, batch=1, seq_len=s, heads=heads,
                                    head_dim=head_dim, itemsize=jnp.dtype(dtype).itemsize, sparse=sparse,
                                    top_k=int(idx.shape[-1]), q_tile=tile, kv_block=tile,
                                    capacity=kw.get("capacity", 0), mesh_devices=n, hcp_slots=kw.get("hcp_slots"))
            traced = collective_bytes(fwd_bwd, q, k, v, do, idx, cnt)
            row.update(hcp=ph, scp=ps, scp_strategy=scp, capacity=kw.get("capacity"), hcp_slots=kw.get("hcp_slots"),
                       bytes_per_device=formula["total"], bytes_traced=traced["total"],
                       bytes_match=abs(traced["total"] - formula["total"]) <= 1e-6 * formula["total"] + 64)
            rows.append(row)
            say(f"  S={s} {row['attention']:6s} {name:48s} {row.get('median_ms', float('nan')):10.2f} ms  "
                f"{row['bytes_per_device'] / 1e6:9.1f} MB{'' if row['bytes_match'] else ' (traced ' + str(row['bytes_traced']) + ')'}"
                f"  err {row.get('rel_error_max', '')} {row.get('error', '')}")
            save()
        base = min((r["median_ms"] for r in rows if r["seq_len"] == s and r["attention"] == "dense"
                    and "median_ms" in r), default=None)
        for r in rows:
            if r["seq_len"] == s and base and "median_ms" in r:
                r["speedup_over_best_dense"] = base / r["median_ms"]
        save()


# -- part 2: training with context parallelism -------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DSVStylePlan(ContextPlan):
    """Sparse context-parallel attention for the benchmark: each head keeps its top (1 - s_h) KV blocks
    scored by the first `rank` dims of q and k (stop-gradient; stands in for DSV's learned predictor)."""

    head_sparsity: tuple[float, ...] = SKEWED
    rank: int = 16
    tile: int = 64

    def __call__(self, q, k, v, *, kv_lens=None, sm_scale=None, **options):
        if kv_lens is not None:
            raise ValueError("DSVStylePlan needs token grids without padding (kv_lens=None)")
        nb = q.shape[1] // self.tile
        top_k = tuple(max(1, round((1 - s) * nb)) for s in self.head_sparsity)
        q_lr, k_lr = (jax.lax.stop_gradient(x[..., :self.rank]) for x in (q, k))
        idx, cnt = select_kv_blocks(q_lr, k_lr, top_k, mesh=self.mesh, q_tile=self.tile, kv_block=self.tile)
        return super().__call__(q, k, v, sm_scale=sm_scale, kv_index=idx, kv_count=cnt, q_tile=self.tile,
                                kv_block=self.tile, sparsity=self.head_sparsity, **options)


def bench_training(mesh, quick, steps, rows, save):
    from dsv_jax.parallel.mesh import batch_sharding, state_shardings
    from dsv_jax.train.step import abstract_model, init_state, make_train_step

    n = mesh.shape["context"]
    if quick:
        overrides = ["model.hidden=64", "model.heads=8", "model.depth=2", "model.text_dim=16", "model.patch=[1,2,2]",
                     "model.tile=[2,4,4]", "text.max_len=8", "text.hash_buckets=8"]
        latent, tile = (4, 32, 32), 16
        cfg = get_config("tiny", overrides + [f"parallel.context={n}", "parallel.fsdp=1"])
    else:
        latent, tile = (32, 128, 128), 64  # 32 x 64 x 64 = 131072 tokens, whole 4x4x4 tiles
        cfg = get_config("2.7b", [f"parallel.context={n}", "parallel.fsdp=1", "model.dtype=bfloat16"])
    heads = cfg.model.heads
    sparsity = profile(heads)
    graphdef, _ = abstract_model(cfg)
    abstract = jax.eval_shape(lambda: init_state(cfg))
    shardings = state_shardings(abstract, mesh)
    state = jax.jit(lambda: init_state(cfg), out_shardings=shardings)()
    t, h, w = latent
    rng = np.random.default_rng(0)
    host = {"latents": rng.standard_normal((1, t, h, w, cfg.model.in_channels)).astype(np.float32),
            "text_ids": rng.integers(1, 50, (1, cfg.text.max_len)).astype(np.int32),
            "text_mask": np.ones((1, cfg.text.max_len), bool)}
    batch = {k: jax.make_array_from_callback(x.shape, NamedSharding(mesh, P()), lambda i, x=x: x[i])
             for k, x in host.items()}
    tokens = t * (h // cfg.model.patch[1]) * (w // cfg.model.patch[2]) // cfg.model.patch[0]
    plans = {"full (cuDNN / XLA inside CP)": ContextPlan(mesh, "hybrid"),
             "DSV-style sparse": DSVStylePlan(mesh, "hybrid", head_sparsity=sparsity, tile=tile,
                                              options=(("capacity", 0.5),))}
    for name, plan in plans.items():
        step = jax.jit(make_train_step(cfg, graphdef, plan), donate_argnums=(0,), out_shardings=(shardings, None))
        lr = jnp.float32(1e-5)
        row = {"variant": name, "tokens": tokens, "devices": n, "preset": cfg.name}
        try:
            compiled = step.lower(state, batch, lr).compile()
            state, m = compiled(state, batch, lr)  # warm-up
            jax.block_until_ready(m)
            import time

            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                state, m = compiled(state, batch, lr)
                jax.block_until_ready(m)
                times.append(time.perf_counter() - t0)
            med = float(np.median(times))
            row.update(step_s=med, tokens_per_s=tokens / med, loss=float(m["loss"]),
                       overflow_calls=OVERFLOW_EVENTS["calls"])
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        say(f"  {name:32s} {row.get('step_s', float('nan')):8.3f} s/step  {row.get('tokens_per_s', 0):10.0f} tok/s "
            f"{row.get('error', '')}")
        if len(rows) == 2 and all("step_s" in r for r in rows):
            rows[1]["speedup_over_full"] = rows[0]["step_s"] / rows[1]["step_s"]
        save()


def main():
    quick = ARGS.quick or not harness.on_gpu()
    n = jax.device_count()
    mesh = make_mesh(ParallelConfig(data=1, fsdp=1, context=n))
    km = kernel_model(ARGS.kernel_model)
    say(f"{n} devices over {jax.process_count()} process(es): {jax.devices()[0].device_kind}; planner kernels: {km.source}")
    payload = {"quick": quick, "devices": n, "processes": jax.process_count(), "kernel_model": km.source,
               "head_sparsity": SKEWED}
    parts = "_attention" if ARGS.skip_train else "_training" if ARGS.skip_attention else ""
    name = ("bench_multigpu" + parts + ("_quick" if quick else "")
            + (f"_{jax.process_count()}proc" if jax.process_count() > 1 else ""))

    def save():  # after every measurement, so that a run stopped by its time limit keeps what it measured
        if MAIN:
            harness.write_results(name, payload)

    if not ARGS.skip_attention:
        if quick:
            sizes, heads, head_dim, dtype, tile = ARGS.sizes or [512], 8, 16, jnp.float32, 16
        else:
            sizes, heads, head_dim, dtype, tile = ARGS.sizes or [65536, 131072, 262144], 16, 128, jnp.bfloat16, 64
        say("part 1: attention fwd+bwd")
        payload["attention_shapes"] = {"heads": heads, "head_dim": head_dim, "dtype": jnp.dtype(dtype).name,
                                       "tile": tile}
        payload["attention"] = []
        bench_attention(mesh, sizes, heads, head_dim, dtype, ARGS.iters or (1 if quick else 5), tile, km,
                        payload["attention"], save)
    if not ARGS.skip_train:
        say("part 2: training steps with context parallelism")
        payload["training"] = []
        bench_training(mesh, quick, ARGS.train_steps or (1 if quick else 3), payload["training"], save)
    save()
    say("wrote", os.path.join(harness.RESULTS_DIR, name + ".json"))


if __name__ == "__main__":
    main()
