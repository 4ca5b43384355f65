"""Check and time the Mosaic GPU (Hopper) block-sparse attention against the Triton path and cuDNN.

    python -m experiments.bench_sparse_mgpu [--seqs 32768 65536] [--sparsities 0.9 0.95] [--budget-s 540]
    python -m experiments.bench_sparse_mgpu --rows 16,1,32,64 --seqs 65536 --budget-s 480

--rows: one row per KV granularity, side by side with cuDNN in one run (written to
bench_sparse_mgpu_granularity.json): 16, 32 and 64 are the Mosaic GPU kernels at 128-row query tiles; 1 is
token level (32-query groups, each keeping a multiple of 256 random tokens, as the DSV authors' kernel),
run on whatever path `sparse_attention(impl="auto")` picks for it (recorded). Rows run in the order given;
each is checked against the reference at its first sparsity before it is timed, and a row whose check fails
is reported as failed and not timed (nor are its other sparsities).

Per sequence length S (B=1, H=16, D=128, bf16, q_tile 64, kv_block 64, uniformly random 64-token blocks,
every tile keeping round((1 - sparsity) * S / 64) of them):
  1. correctness of the Mosaic GPU path at that size: o, dq, dk, dv against the plain-JAX reference
     (run per head on float32 inputs, so it fits), relative Frobenius error;
  2. median time of fwd and fwd+bwd (jax.vjp) of the Mosaic GPU path, the Triton path and cuDNN full
     attention, in the same run; kept-work TFLOP/s (fwd 4 B H S kept D, fwd+bwd 3.5x that) and the
     ratio to cuDNN's rate;
  3. selection (lowrank_topk, rank 16) + fwd + bwd of the Mosaic GPU path as one program, and the
     selection alone, against cuDNN's fwd+bwd of the same run.
Every measurement runs in a child process with a time limit (a barrier deadlock costs that limit, not
the run). Writes experiments/results/bench_sparse_mgpu.json (and $OUT/ when set); prints a table last.
"""

from __future__ import annotations

import argparse
import json
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


def inputs(seq, sparsity, heads=HEADS, head_dim=HEAD_DIM, q_tile=None, kv_block=None, seed=0, multiple=1):
    """q, k, v, cotangent (bf16 normal) and a uniformly random selection (ascending ids, full counts of
    `kept_blocks`)."""
    q_tile, kv_block = q_tile or Q_TILE, kv_block or KV_BLOCK
    k_qkv, k_sel = jax.random.split(jax.random.key(seed))
    q, k, v, w = harness.random_qkv(k_qkv, seq, heads, head_dim)
    keep = kept_blocks(seq, sparsity, kv_block, multiple) / (seq // kv_block)
    index, count = harness.random_selection(
        k_sel, seq=seq, heads=heads, q_tile=q_tile, kv_block=kv_block, keep=keep, local_share=0.0
    )
    return q, k, v, w, index, count


def timed(fn, *args, reps=7, min_ms=200.0):
    """harness.time_fn: ms per call on the device, median of `reps` repetitions of ~min_ms each."""
    return harness.time_fn(fn, *args, warmup=1, iters=reps, min_ms=min_ms)


def attention_fns(impl, index, count, **options):
    """(fwd(q, k, v), fwd_bwd(q, k, v, w)) of one implementation, jitted."""
    if impl == "cudnn":
        attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    elif impl == "auto":  # whatever sparse_attention picks on this device (kernel_path)
        from pallas_kernels.sparse_attention import sparse_attention

        def attend(q, k, v):
            return sparse_attention(q, k, v, index, count, q_tile=Q_TILE, kv_block=KV_BLOCK)
    elif impl == "triton":
        from pallas_kernels.sparse_attention_triton import sparse_attention_pallas
        from pallas_kernels.tuning import for_device

        def attend(q, k, v):
            return sparse_attention_pallas(
                q,
                k,
                v,
                index,
                count,
                q_tile=Q_TILE,
                kv_block=KV_BLOCK,
                sm_scale=q.shape[-1] ** -0.5,
                tuning=for_device()[0],
                interpret=False,
            )
    else:
        from pallas_kernels.sparse_attention_mgpu import sparse_attention_mgpu

        def attend(q, k, v):
            return sparse_attention_mgpu(q, k, v, index, count, q_tile=Q_TILE, kv_block=KV_BLOCK, tuning=options)

    return jax.jit(attend), jax.jit(harness.fwd_bwd(attend))


def check(seq, sparsity, options, impl="mgpu", multiple=1):
    """Relative errors of o, dq, dk, dv of the path `impl` against the reference, at this size."""
    from pallas_kernels.sparse_attention import sparse_attention_reference

    q, k, v, w, index, count = inputs(seq, sparsity, seed=1, multiple=multiple)
    fwd, fwd_bwd = attention_fns(impl, index, count, **options)
    o = np.asarray(fwd(q, k, v), np.float64)
    grads = [np.asarray(g, np.float64) for g in fwd_bwd(q, k, v, w)[1]]

    @jax.jit
    def reference(q, k, v, w, index, count):  # one head: [1, S, 1, D]
        f = lambda q, k, v: sparse_attention_reference(q, k, v, index, count, q_tile=Q_TILE, kv_block=KV_BLOCK).astype(
            jnp.float32
        )
        o, vjp = jax.vjp(f, q, k, v)
        return (o, *vjp(w))

    num = np.zeros(4)
    den = np.zeros(4)
    # the reference walks one head at a time; at token level (thousands of keys per query) 2 of the heads
    # keep the check inside a job's time limit (every head runs the same kernel code)
    for h in range(2 if KV_BLOCK == 1 else q.shape[2]):
        part = lambda x: x[:, :, h : h + 1].astype(jnp.float32)
        ref = reference(part(q), part(k), part(v), part(w), index[:, h : h + 1], count[:, h : h + 1])
        for i, (got, want) in enumerate(zip([o, *grads], ref)):
            want = np.asarray(want, np.float64)
            num[i] += np.sum((got[:, :, h : h + 1] - want) ** 2)
            den[i] += np.sum(want**2)
    errors = dict(zip(["o", "dq", "dk", "dv"], (np.sqrt(num / np.maximum(den, 1e-30))).tolist()))
    finite = all(np.isfinite(x).all() for x in [o, *grads])
    return {
        "errors": errors,
        "finite": bool(finite),
        "correct": bool(finite and errors["o"] < 1e-2 and max(errors.values()) < 2e-2),
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


def small_check(options=None, cases=None):
    """The compiled kernels at S=1536, H=2 against dense_masked_reference: random counts including empty
    tiles, random kv_valid including empty blocks, lse with its cotangent. Errors per case. `options`:
    tuning of the Mosaic GPU path (a variant's); cases: (q_tile, kv_block, D, masked) (default SMALL_CASES)."""
    from pallas_kernels.sparse_attention_mgpu import check_smem, default_config, sparse_attention_mgpu

    b, s, h = 1, 1536, 2
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


def forward_vs_triton(q, k, v, index, count):
    """Forward of the Mosaic GPU path against the Triton path on given inputs (q_tile, kv_block 64):
    relative error of o, then both timed (for experiments/bench_sparse_attention.py)."""
    mgpu, _ = attention_fns("mgpu", index, count)
    triton, _ = attention_fns("triton", index, count)
    err = harness.rel_error(mgpu(q, k, v), triton(q, k, v))
    out = {"ok": bool(err < 1e-2), "o_rel_err_vs_triton": err}
    if out["ok"]:
        b, seq, heads, head_dim = q.shape
        flops = attention_flops(seq, heads, head_dim, float(count.mean()) * KV_BLOCK, b)
        for name, fn in [("mgpu", mgpu), ("triton", triton)]:
            out[f"{name}_fwd_ms"] = timed(fn, q, k, v)["median_ms"]
            out[f"{name}_fwd_tflops"] = flops / out[f"{name}_fwd_ms"] / 1e9
    return out


def pieces(q, k, v, w, index, count, options, interpret=False):
    """The Mosaic GPU path's pieces as separate jitted calls at this process's geometry: [(name, fn, args,
    products)] for the forward kernel, the transposed index and its block order (dkdv_schedule), the dQ
    kernel and the dK/dV kernel, or with a fused backward (options' fused_backward at 16- or 32-row blocks)
    the forward and that one kernel; products: the 64 x 64 x D products each runs per (query tile, KV block)
    pair (the forward 2, dQ 3 as it recomputes S and dP, dK/dV 4, the fused backward 5)."""
    from pallas_kernels import sparse_attention_mgpu as mgpu
    from pallas_kernels import sparse_attention_mgpu_fwd as fwd
    from pallas_kernels.mgpu_common import ROWS
    from pallas_kernels.sparse_index import sanitize_index

    if KV_BLOCK < ROWS:  # 16- or 32-row blocks: their own dK/dV kernel (the forward and dQ are shared)
        from pallas_kernels import sparse_attention_mgpu_fine as dkdv_kernels
    else:
        from pallas_kernels import sparse_attention_mgpu_bwd as dkdv_kernels
    from pallas_kernels import sparse_attention_mgpu_bwd as bwd
    from pallas_kernels import sparse_attention_mgpu_fused as fused

    seq = q.shape[1]
    cfg = mgpu.default_config(Q_TILE, KV_BLOCK, HEAD_DIM, HEAD_DIM**-0.5, interpret=interpret, tuning=options)
    mgpu.check_smem(cfg)
    index, count = sanitize_index(index, count, seq // KV_BLOCK)
    forward = jax.jit(lambda q, k, v: fwd.forward(q, k, v, index, count, None, cfg))
    o, lse2 = forward(q, k, v)
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), w.astype(jnp.float32))
    grads_in = (q, k, v, w, lse2, delta)
    if cfg.fuses_backward:
        backward = jax.jit(
            lambda q, k, v, w, lse2, delta: fused.backward(q, k, v, w, lse2, delta, index, count, None, cfg)
        )
        return [("fwd", forward, (q, k, v), 2), ("fused", backward, grads_in, 5)]

    worklist = jax.jit(lambda index, count: mgpu.dkdv_schedule(index, count, cfg, seq))
    tiles, starts, blocks = worklist(index, count)
    dq = jax.jit(lambda q, k, v, w, lse2, delta: bwd.dq(q, k, v, w, lse2, delta, index, count, None, cfg))
    dkdv = jax.jit(
        lambda q, k, v, w, lse2, delta: dkdv_kernels.dkdv(q, k, v, w, lse2, delta, tiles, starts, blocks, None, cfg)
    )
    return [
        ("fwd", forward, (q, k, v), 2),
        ("worklist", worklist, (index, count), 0),
        ("dq", dq, grads_in, 3),
        ("dkdv", dkdv, grads_in, 4),
    ]


def parts(q, k, v, w, index, count, options):
    """Median ms of each of `pieces`, the kernels' kept-work TFLOP/s as executed and that rate's fraction of the
    bf16 matmul ceiling (harness.H200_BF16_MAX_TFLOPS)."""
    unit = 2.0 * q.shape[0] * HEADS * q.shape[1] * float(count[0, 0, 0]) * KV_BLOCK * HEAD_DIM  # one product
    out = {}
    for name, fn, args, products in pieces(q, k, v, w, index, count, options):
        t = timed(fn, *args, reps=5, min_ms=100.0)
        out[name + "_kernel_ms"] = t["median_ms"]
        if products:
            out[name + "_executed_tflops"] = products * unit / t["median_ms"] / 1e9
            out[name + "_of_ceiling"] = out[name + "_executed_tflops"] / harness.H200_BF16_MAX_TFLOPS
    return out


def select_and_attend(q, k, v, w, top_k, options, impl="mgpu"):
    """Selection (lowrank_topk on random rank-16 q, k: its picks are random blocks) then fwd+bwd of the path
    `impl` ("mgpu": the Mosaic GPU kernels; "auto": sparse_attention's choice) on them, compiled as one
    program: the issue's "selection + fwd + bwd" time. Also the selection alone. Median ms of each."""
    from pallas_kernels.lowering import triton_missing
    from pallas_kernels.lowrank_topk import lowrank_topk
    from pallas_kernels.sparse_attention import sparse_attention
    from pallas_kernels.sparse_attention_mgpu import sparse_attention_mgpu

    b, seq, heads, _ = q.shape
    k_q, k_k = jax.random.split(jax.random.key(7))
    q_lr, k_lr = (jax.random.normal(key, (b, seq, heads, RANK), jnp.bfloat16) for key in (k_q, k_k))

    def select(q_lr, k_lr):
        return lowrank_topk(q_lr, k_lr, top_k, q_tile=Q_TILE, kv_block=KV_BLOCK)

    @jax.jit
    def step(q, k, v, w, q_lr, k_lr):
        ids = select(q_lr, k_lr)
        count = jnp.full(ids.shape[:3], top_k, jnp.int32)
        if impl == "mgpu":
            attend = lambda q, k, v: sparse_attention_mgpu(
                q, k, v, ids, count, q_tile=Q_TILE, kv_block=KV_BLOCK, tuning=options
            )
        else:
            attend = lambda q, k, v: sparse_attention(q, k, v, ids, count, q_tile=Q_TILE, kv_block=KV_BLOCK)
        return harness.fwd_bwd(attend)(q, k, v, w)

    return {
        "top_k": top_k,
        "select_impl": "xla" if triton_missing() else "pallas (Triton)",
        "select": timed(jax.jit(select), q_lr, k_lr),
        "select_fwd_bwd": timed(step, q, k, v, w, q_lr, k_lr),
    }


def measure(job):
    """Child process: one job, returns a dict (never raises)."""
    out = {"job": job, "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    try:
        if job["impl"] == "small_check":
            cases = [tuple(c) for c in job["cases"]] if "cases" in job else None
            out["cases"] = small_check(job.get("options"), cases)
            return out
        seq, impl = job["seq"], job["impl"]
        options = set_geometry(job.get("options", {}))
        multiple = job.get("keep_multiple", 1)
        if impl == "auto":
            from pallas_kernels.sparse_attention import kernel_path

            x = jax.ShapeDtypeStruct((1, seq, HEADS, HEAD_DIM), jnp.bfloat16)
            out["path"] = kernel_path(x, x, x, q_tile=Q_TILE, kv_block=KV_BLOCK)[0]
        if job.get("check"):
            t0 = time.perf_counter()
            out["check"] = check(seq, job["sparsity"], options, impl, multiple)
            out["check_s"] = time.perf_counter() - t0
            if not out["check"]["correct"]:  # a wrong kernel is reported, not timed
                return out
        q, k, v, w, index, count = inputs(seq, job.get("sparsity", 0.0), multiple=multiple)
        kept = seq if impl == "cudnn" else float(count[0, 0, 0]) * KV_BLOCK
        fwd, fwd_bwd = attention_fns(impl, index, count, **options)
        if job.get("parts") and impl == "mgpu":
            out["parts"] = parts(q, k, v, w, index, count, options)
        if job.get("select"):  # its own failure must not cost the job's kernel timings
            try:
                out["with_selection"] = select_and_attend(q, k, v, w, int(count[0, 0, 0]), options, impl)
            except Exception as e:
                out["with_selection"] = {"error": error_text(e, trace=True)}
        t0 = time.perf_counter()
        out["fwd"] = timed(fwd, q, k, v)
        out["fwd_bwd"] = timed(fwd_bwd, q, k, v, w)
        out["time_s"] = time.perf_counter() - t0
        flops = attention_flops(seq, HEADS, HEAD_DIM, kept, q.shape[0])
        out["kept_keys"] = kept
        out["fwd_tflops"] = flops / out["fwd"]["median_ms"] / 1e9
        out["fwd_bwd_tflops"] = ATTENTION_FWD_BWD * flops / out["fwd_bwd"]["median_ms"] / 1e9
    except Exception as e:
        out["error"] = error_text(e, trace=True)
    return out


def run_child(job, timeout_s):
    t0 = time.perf_counter()
    result = harness.in_child("experiments.bench_sparse_mgpu", ["--job", json.dumps(job)], timeout_s)
    if "error" in result and "job" not in result:  # no answer
        return {"job": job, **result}
    result["wall_s"] = time.perf_counter() - t0
    return result


def plan(seqs, sparsities, variants, small_check=True, check_all=True, triton=True):
    """Jobs in order. Every variant is checked (at the first sparsity only unless check_all) and timed in
    pieces and with the selection, so that variants compare piece by piece in one run."""
    tunings = []  # the small check compiles each distinct tuning once (it has its own geometries)
    for options in variants:
        tuning = {k: v for k, v in options.items() if k not in GEOMETRY_KEYS}
        if tuning not in tunings:
            tunings.append(tuning)
    jobs = [{"seq": 1536, "impl": "small_check", "options": tuning} for tuning in tunings] if small_check else []
    for seq in seqs:
        jobs.append({"seq": seq, "impl": "cudnn"})
        for sparsity in sparsities:
            for options in variants:
                jobs.append(
                    {
                        "seq": seq,
                        "sparsity": sparsity,
                        "impl": "mgpu",
                        "options": options,
                        "check": check_all or sparsity == sparsities[0],
                        "parts": True,
                        "select": True,
                    }
                )
            if triton:
                jobs.append({"seq": seq, "sparsity": sparsity, "impl": "triton"})
    return jobs


GRANULARITY_ROWS = {  # --rows: KV granularity -> the path and geometry it is benchmarked on
    64: {"impl": "mgpu", "options": {"q_tile": 128, "kv_block": 64}},
    32: {"impl": "mgpu", "options": {"q_tile": 128, "kv_block": 32}},
    16: {"impl": "mgpu", "options": {"q_tile": 128, "kv_block": 16}},
    1: {"impl": "auto", "options": {"q_tile": 32, "kv_block": 1}, "keep_multiple": 256},
}


def plan_rows(seqs, sparsities, rows, small_check=True):
    """Jobs of a --rows run, in the order of `rows` (KV granularities, keys of GRANULARITY_ROWS): the small
    check of the geometries the Mosaic GPU rows use, then per sequence length cuDNN and each row at each
    sparsity, checked at the first sparsity (before it is timed), in pieces where the path has them, and
    with the selection."""
    unknown = [r for r in rows if r not in GRANULARITY_ROWS]
    if unknown:
        raise ValueError(f"--rows {unknown}: known rows are {sorted(GRANULARITY_ROWS)}")
    jobs = []
    cases = [c for c in SMALL_CASES_FINE if c[1] in rows]  # kv_block 64's kernels: checked at their size
    if small_check and cases:
        jobs.append({"seq": 1536, "impl": "small_check", "options": {}, "cases": [list(c) for c in cases]})
    for seq in seqs:
        jobs.append({"seq": seq, "impl": "cudnn"})
        for row in rows:
            spec = GRANULARITY_ROWS[row]
            for sparsity in sparsities:
                job = {"seq": seq, "sparsity": sparsity, "impl": spec["impl"], "options": dict(spec["options"])}
                job.update(row=row, check=sparsity == sparsities[0], parts=True, select=True)
                if "keep_multiple" in spec:
                    job["keep_multiple"] = spec["keep_multiple"]
                jobs.append(job)
    return jobs


def failed_check(result) -> bool:
    """Whether a job's correctness check ran and failed (or its job failed before timing)."""
    return ("check" in result and not result["check"]["correct"]) or (result["job"].get("check") and "error" in result)


def summarise(results):
    dense = {r["job"]["seq"]: r for r in results if r["job"]["impl"] == "cudnn" and "fwd_bwd" in r}
    rows = []
    for r in results:
        job = r["job"]
        if job["impl"] == "small_check":
            continue
        options = job.get("options", {})
        row = {
            "seq": job["seq"],
            "sparsity": job.get("sparsity", 0.0),
            "impl": job["impl"],
            "options": json.dumps(options),
        }
        if job["impl"] != "cudnn":
            row["kv_block"] = options.get("kv_block", KV_BLOCK)
            row["q_tile"] = options.get("q_tile", Q_TILE)
            row["path"] = r.get("path", job["impl"])
        if "kept_keys" in r:
            row["kept_keys"] = r["kept_keys"]
        if "skipped" in r:
            row["status"] = r["skipped"]
        elif failed_check(r):
            row["status"] = "FAILED check: not timed"
        if "error" in r:
            row["error"] = r["error"].splitlines()[0][:120]
        if "check" in r:
            row["correct"] = r["check"]["correct"]
            row["max_err"] = max(r["check"]["errors"].values())
        for name, value in r.get("parts", {}).items():
            row[name] = value
        if "fwd_bwd" in r:
            row["fwd_ms"] = r["fwd"]["median_ms"]
            row["fwd_spread"] = f"{r['fwd']['min_ms']:.3g}-{r['fwd']['max_ms']:.3g}"
            row["fwd_bwd_ms"] = r["fwd_bwd"]["median_ms"]
            row["bwd_ms"] = r["fwd_bwd"]["median_ms"] - r["fwd"]["median_ms"]
            row["fb_spread"] = f"{r['fwd_bwd']['min_ms']:.3g}-{r['fwd_bwd']['max_ms']:.3g}"
            row["fwd_tflops"], row["fwd_bwd_tflops"] = r["fwd_tflops"], r["fwd_bwd_tflops"]
            base = dense.get(job["seq"])
            if base is not None:
                row["fwd_vs_cudnn_rate"] = r["fwd_tflops"] / base["fwd_tflops"]
                row["fwd_bwd_vs_cudnn_rate"] = r["fwd_bwd_tflops"] / base["fwd_bwd_tflops"]
                row["fwd_bwd_speedup"] = base["fwd_bwd"]["median_ms"] / r["fwd_bwd"]["median_ms"]
        if "error" in r.get("with_selection", {}):
            row["select_error"] = r["with_selection"]["error"].splitlines()[0][:120]
        elif "with_selection" in r:
            sel = r["with_selection"]
            row["select_ms"] = sel["select"]["median_ms"]
            row["select_fwd_bwd_ms"] = sel["select_fwd_bwd"]["median_ms"]
            row["sfb_spread"] = f"{sel['select_fwd_bwd']['min_ms']:.3g}-{sel['select_fwd_bwd']['max_ms']:.3g}"
            base = dense.get(job["seq"])
            if base is not None:
                row["select_fwd_bwd_speedup"] = base["fwd_bwd"]["median_ms"] / row["select_fwd_bwd_ms"]
        rows.append(row)
    return rows


def run_jobs(jobs, budget, job_timeout_s, runner=None):
    """(results, skipped): each job run by `runner(job, timeout_s)` (run_child) while the budget allows ~30 s
    more; a --rows job whose row failed its check (or failed outright) at an earlier sparsity is not run but
    recorded as skipped with the reason."""
    runner = runner or run_child
    results, skipped, failed = [], [], {}
    for job in jobs:
        key = (job["seq"], job.get("row"))
        if job.get("row") is not None and key in failed:  # the kernel was wrong at another sparsity
            results.append({"job": job, "skipped": failed[key]})
            continue
        if not budget.allows(30):
            skipped.append(job)
            continue
        r = runner(job, min(job_timeout_s, budget.left()))
        results.append(r)
        if job.get("row") is not None and failed_check(r):
            failed[key] = f"not timed: row {job['row']} failed at sparsity {job['sparsity']} (its check or its run)"
        print(
            f"[{budget.elapsed():5.0f} s] {json.dumps(job)}: "
            f"{r.get('error', '').splitlines()[0][:200] if 'error' in r else 'ok'}",
            flush=True,
        )
    return results, skipped


COLUMNS = [
    "seq",
    "sparsity",
    "impl",
    "options",
    "correct",
    "max_err",
    "fwd_ms",
    "fwd_spread",
    "fwd_bwd_ms",
    "fb_spread",
    "fwd_tflops",
    "fwd_bwd_tflops",
    "fwd_vs_cudnn_rate",
    "fwd_bwd_vs_cudnn_rate",
    "fwd_bwd_speedup",
    "select_ms",
    "select_fwd_bwd_ms",
    "sfb_spread",
    "select_fwd_bwd_speedup",
]
ROWS_COLUMNS = [  # --rows: one line per (granularity, sparsity), pieces and selection beside the totals
    "seq",
    "sparsity",
    "kv_block",
    "q_tile",
    "path",
    "status",
    "correct",
    "max_err",
    "kept_keys",
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.9, 0.95])
    parser.add_argument(
        "--variants",
        default="[{}]",
        help="JSON list of option dicts for the Mosaic GPU path "
        "(its tuning, e.g. fwd_stages; or the geometry: q_tile, kv_block)",
    )
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting jobs after this")
    parser.add_argument("--job-timeout-s", type=float, default=180.0)
    parser.add_argument("--no-small-check", action="store_true", help="skip the small-shape check of all geometries")
    parser.add_argument(
        "--check-first-sparsity-only",
        action="store_true",
        help="check against the reference at the first sparsity of each size only",
    )
    parser.add_argument("--no-triton", action="store_true", help="leave the Triton path out")
    parser.add_argument(
        "--rows",
        help="comma-separated KV granularities to benchmark side by side with cuDNN, in this order "
        f"(of {sorted(GRANULARITY_ROWS)}; e.g. 16,1,32,64); replaces --variants",
    )
    parser.add_argument("--name", help="results file name (default bench_sparse_mgpu, with --rows _granularity)")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        harness.answer(measure(json.loads(args.job)))
        return

    budget = harness.Budget(args.budget_s)
    rows_run = [int(r) for r in args.rows.split(",")] if args.rows else None
    if rows_run:
        jobs = plan_rows(args.seqs, args.sparsities, rows_run, not args.no_small_check)
    else:
        jobs = plan(
            args.seqs,
            args.sparsities,
            json.loads(args.variants),
            not args.no_small_check,
            not args.check_first_sparsity_only,
            not args.no_triton,
        )
    results, skipped = run_jobs(jobs, budget, args.job_timeout_s)

    rows = summarise(results)
    path = harness.write_results(
        args.name or ("bench_sparse_mgpu_granularity" if rows_run else "bench_sparse_mgpu"),
        {
            "config": {
                "batch": 1,
                "heads": HEADS,
                "head_dim": HEAD_DIM,
                "dtype": "bfloat16",
                "q_tile": Q_TILE,
                "kv_block": KV_BLOCK,
                "geometry": "q_tile, kv_block: the default; a "
                "variant's own q_tile / kv_block override them for its jobs",
                "selection": "uniform random blocks, full counts (token rows: rounded up to a multiple of 256)",
                "seqs": args.seqs,
                "sparsities": args.sparsities,
                "variants": json.loads(args.variants),
                "rows": {r: GRANULARITY_ROWS[r] for r in rows_run} if rows_run else None,
                "flops": "fwd 4*B*H*S*kept*D, fwd+bwd 3.5x",
                "timing": "harness.time_fn: median of 7 repetitions, each n back-to-back calls blocked once (~200 ms)",
            },
            "results": results,
            "summary": rows,
            "skipped": skipped,
            "wall_s": budget.elapsed(),
        },
    )
    for r in results:
        if "error" in r:
            print(f"\nERROR {json.dumps(r['job'])}:\n{r['error'][-1200:]}")
        for case in r.get("cases", []):
            shown = {k_: (f"{v_:.2e}" if isinstance(v_, float) else v_) for k_, v_ in case.items() if k_ != "error"}
            print("small check", json.dumps(r["job"].get("options", {})), shown, case.get("error", "")[:600])
    print(f"\nwrote {path}")
    harness.print_table(rows, ROWS_COLUMNS if rows_run else COLUMNS)
    part_rows = [r for r in rows if "fwd_kernel_ms" in r]
    if part_rows:
        print(
            f"\nMosaic GPU pieces (executed TFLOP/s: the products each kernel runs; of_ceiling: that rate over "
            f"{harness.H200_BF16_MAX_TFLOPS:.0f} TFLOP/s, the bf16 matmul ceiling):"
        )
        harness.print_table(
            part_rows,
            [
                "seq",
                "sparsity",
                "options",
                "fwd_kernel_ms",
                "worklist_kernel_ms",
                "dq_kernel_ms",
                "dkdv_kernel_ms",
                "fused_kernel_ms",
                "fwd_executed_tflops",
                "dq_executed_tflops",
                "dkdv_executed_tflops",
                "fused_executed_tflops",
                "fwd_of_ceiling",
                "dq_of_ceiling",
                "dkdv_of_ceiling",
                "fused_of_ceiling",
            ],
        )


if __name__ == "__main__":
    main()
