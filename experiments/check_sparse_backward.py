"""GPU check of `sparse_attention_backward` (the kernels' backward under given, merged softmax statistics:
what the ring of context parallelism calls for each visiting chunk) against the plain-JAX reference.

    python -m experiments.check_sparse_backward            # GPU: every kernel path, S = 8k and 32k
    python -m experiments.check_sparse_backward --quick    # CPU: interpret mode, tiny shapes

Setup: B = 1, H heads of D = 128, bf16 inputs, random 64-token blocks at keep 0.1 (harness.random_selection,
half local, half far). Each tile's selection is split into two disjoint halves A and B (alternate entries of
the sorted list), like two ring chunks. Per kernel path (Mosaic GPU on sm90, the Triton kernels; the XLA
reference as a baseline):
  merged   (o, lse) = merge_attention of the two halves' (o_A, lse_A), (o_B, lse_B) from sparse_attention
  grads    sparse_attention_backward(half A, merged stats) + (half B, merged stats), random cotangents for o
           and lse
against jax.vjp of the reference over the whole selection on float32 copies of the same inputs (relative
Frobenius error; bf16 inputs, fp32 accumulation: errors near 3e-3 are the bf16 rounding of the products).
Paths are called directly (each module's entry points), so the Triton kernels are checked on sm90 too.
Writes experiments/results/check_sparse_backward.json (--quick: *_quick.json, git-ignored).
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import sys

import jax
import jax.numpy as jnp

from dsv_jax.attention import merge_attention
from experiments import harness
from pallas_kernels.sparse_attention import (
    sparse_attention,
    sparse_attention_backward,
    sparse_attention_reference,
)

TOL = 2e-2  # relative Frobenius error of bf16 kernels against the fp32 reference


def halves(index, count):
    """Two disjoint selections from one: even and odd entries of each tile's first `count` ids."""
    k = index.shape[-1]
    pos = jnp.arange(k)
    live = pos < count[..., None]
    out = []
    for parity in (0, 1):
        keep = live & (pos % 2 == parity)
        order = jnp.argsort(~keep, axis=-1, stable=True)  # kept entries first, in their order
        out.append((jnp.take_along_axis(index, order, -1), jnp.sum(keep, -1).astype(jnp.int32)))
    return out


def path_functions(path: str, scale: float):
    """(forward with lse, backward under given statistics) of one kernel path, called directly so that each
    path is checked whatever the dispatcher would pick on this device."""
    opts = {"q_tile": 64, "kv_block": 64}
    if path == "xla":
        fwd = lambda q, k, v, i, c: sparse_attention(q, k, v, i, c, return_lse=True, impl="xla", **opts)
        bwd = lambda *a: sparse_attention_backward(*a, impl="xla", **opts)
    elif path == "mgpu":
        from pallas_kernels import sparse_attention_mgpu as mgpu

        fwd = lambda q, k, v, i, c: mgpu.sparse_attention_mgpu(q, k, v, i, c, sm_scale=scale, return_lse=True, **opts)
        bwd = lambda *a: mgpu.sparse_attention_mgpu_backward(*a, sm_scale=scale, **opts)
    else:
        from pallas_kernels import sparse_attention_triton as triton_path
        from pallas_kernels.tuning import for_device

        kw = {"sm_scale": scale, "tuning": for_device()[0], "interpret": not harness.on_gpu(), **opts}
        fwd = lambda q, k, v, i, c: triton_path.sparse_attention_pallas(q, k, v, i, c, return_lse=True, **kw)
        bwd = lambda *a: triton_path.sparse_attention_pallas_backward(*a, **kw)
    return fwd, bwd


def check(seq: int, heads: int, path: str, key) -> dict:
    ks = jax.random.split(key, 6)
    q, k, v, do = harness.random_qkv(ks[0], seq, heads, 128, jnp.bfloat16)
    dlse = jax.random.normal(ks[1], (1, heads, seq), jnp.float32)
    index, count = harness.random_selection(ks[2], seq=seq, heads=heads, q_tile=64, kv_block=64, keep=0.1)
    fwd, bwd = path_functions(path, 128 ** -0.5)

    @jax.jit
    def merged_grads(q, k, v, do, dlse):
        parts = [fwd(q, k, v, i, c) for i, c in halves(index, count)]
        o, lse = merge_attention(parts[0][0].astype(jnp.float32), parts[0][1], parts[1][0].astype(jnp.float32),
                                 parts[1][1])
        o = o.astype(q.dtype)
        grads = [bwd(q, k, v, i, c, o, lse, do, dlse) for i, c in halves(index, count)]
        return o, lse, [a.astype(jnp.float32) + b.astype(jnp.float32) for a, b in zip(*grads)]

    @jax.jit
    def reference(q, k, v, do, dlse):
        f = lambda q, k, v: sparse_attention_reference(q, k, v, index, count, q_tile=64, kv_block=64, return_lse=True)
        (o, lse), pullback = jax.vjp(f, q, k, v)
        return o, lse, pullback((do, dlse))

    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    o, lse, grads = merged_grads(q, k, v, do, dlse)
    o_ref, lse_ref, grads_ref = reference(*f32, dlse)
    errors = {"o": harness.rel_error(o, o_ref), "lse_max_abs": float(jnp.max(jnp.abs(lse - lse_ref)))}
    errors.update({name: harness.rel_error(g, r) for name, g, r in zip(("dq", "dk", "dv"), grads, grads_ref)})
    ok = all(errors[n] < TOL for n in ("o", "dq", "dk", "dv")) and errors["lse_max_abs"] < 1e-2
    return {"seq": seq, "heads": heads, "path": path, "errors": errors, "ok": bool(ok)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU, interpret mode, tiny shapes")
    args = p.parse_args(argv)
    if not args.quick and not harness.on_gpu():
        sys.exit("check_sparse_backward.py checks the GPU kernels; use --quick on a CPU")
    sizes = [(512, 2)] if args.quick else [(8192, 16), (32768, 16)]
    paths = ["triton", "xla"] if args.quick else ["mgpu", "triton", "xla"]
    rows = []
    for i, (seq, heads) in enumerate(sizes):
        for path in paths:
            row = check(seq, heads, path, jax.random.key(100 + i))
            rows.append(row)
            print(row, flush=True)
    name = "check_sparse_backward" + ("_quick" if args.quick else "")
    path = harness.write_results(name, {"tolerance": TOL, "rows": rows, "all_ok": all(r["ok"] for r in rows)})
    harness.print_table([{"seq": r["seq"], "path": r["path"], **r["errors"], "ok": r["ok"]} for r in rows],
                        ["seq", "path", "o", "lse_max_abs", "dq", "dk", "dv", "ok"])
    print("wrote", path)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
