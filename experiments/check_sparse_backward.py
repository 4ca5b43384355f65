"""GPU check of `sparse_attention_backward` (the kernels' backward under given, merged softmax statistics)
and of the sparse SCP ring that calls it for each visiting chunk, on the compiled kernels (the CPU tests
run them in interpret mode only), against the plain-JAX reference on float32 copies of the inputs.

    python -m experiments.check_sparse_backward           # H200, ~1 min: results/check_sparse_backward.json
    python -m experiments.check_sparse_backward --quick   # CPU smoke run, 2 fake devices, kernels interpreted

Cases (B = 1, D = 128, bf16, q_tile = kv_block = 64):
  edge      S = 4096, 4 heads, ~1/4 of the blocks per tile, a tile with kv_count 0, kv_valid with partly and
            fully padded blocks;
  8k, 32k   16 heads, random 64-token blocks at keep 0.1 (harness.random_selection), no padding: the
            benchmarked sizes.
Per case and kernel path (mgpu: Mosaic GPU, sm90; triton: the Triton lowering): the selection split into
disjoint halves A and B (like two ring chunks), (o, lse) merged from the path's own forward of each half
(merge_attention), and backward(A) + backward(B) under the merged statistics, against the reference VJP of
the whole selection with random cotangents for o and lse. Then, on the edge case, the sparse ring
(`scp.ring_attention`, impl="auto") over every visible device in one group (one GPU: a ring of one chunk).
Errors are relative Frobenius norms (lse over finite rows; inf if the -inf rows differ); bf16 inputs give
~3e-3. Exits 1 if any exceeds TOL.
"""

from __future__ import annotations

import sys

if "--quick" in sys.argv[1:]:  # a ring of two chunks on the CPU (before jax starts)
    from experiments.quick_cpu import use_cpu

    use_cpu(devices=2)

# isort: split

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dsv_jax.attention import merge_attention
from dsv_jax.parallel import scp
from dsv_jax.parallel.groups import GroupAxis
from experiments.harness import error_text, on_gpu, rel_error, write_results
from pallas_kernels.sparse_attention import sparse_attention_reference

Q_TILE = KV_BLOCK = 64
HEAD_DIM = 128
TOL = 2e-2  # bf16 inputs and outputs against a float32 reference


def inputs(seq, heads, seed=0):
    """q, k, v (bf16), cotangents (do bf16, dlse f32), a selection with an empty tile, kv_valid."""
    ks = jax.random.split(jax.random.key(seed), 8)
    q, k, v, do = (jax.random.normal(kk, (1, seq, heads, HEAD_DIM), jnp.bfloat16) for kk in ks[:4])
    dlse = jax.random.normal(ks[4], (1, heads, seq))
    tiles, blocks = seq // Q_TILE, seq // KV_BLOCK
    n_sel = max(2, blocks // 4)
    index = jnp.sort(jax.lax.top_k(jax.random.uniform(ks[5], (1, heads, tiles, blocks)), n_sel)[1], axis=-1)
    index = index.astype(jnp.int32)  # ascending, as selections are
    count = jax.random.randint(ks[6], (1, heads, tiles), 1, n_sel + 1, dtype=jnp.int32).at[0, 0, 1].set(0)
    kv_valid = jax.random.randint(ks[7], (1, blocks), 0, KV_BLOCK + 1, dtype=jnp.int32).at[0, :2].set(KV_BLOCK)
    return (q, k, v), (do, dlse), (index, count), kv_valid


def split(index, count):
    """Disjoint selections A (first half of each tile's live ids) and B (the rest, moved to the front)."""
    first = (count + 1) // 2
    n_sel = index.shape[-1]
    rest = jnp.take_along_axis(index, jnp.minimum(jnp.arange(n_sel) + first[..., None], n_sel - 1), axis=-1)
    return (index, first), (rest, count - first)


def reference(qkv, cots, selection, kv_valid):
    """(o, lse, dq, dk, dv) of the whole selection on float32 copies."""
    f = lambda q, k, v: sparse_attention_reference(
        q, k, v, *selection, q_tile=Q_TILE, kv_block=KV_BLOCK, kv_valid=kv_valid, return_lse=True
    )
    (o, lse), vjp = jax.vjp(f, *(x.astype(jnp.float32) for x in qkv))
    return (o, lse, *vjp((cots[0].astype(jnp.float32), cots[1])))


def path_fns(path, interpret):
    """(forward -> (o, lse), backward -> (dq, dk, dv)) of one kernel path, keyword arguments as the public ones."""
    if path == "mgpu":
        from pallas_kernels import sparse_attention_mgpu as m

        return (
            lambda *a, **kw: m.sparse_attention_mgpu(*a, return_lse=True, interpret=interpret, **kw),
            lambda *a, **kw: m.sparse_attention_mgpu_backward(*a, interpret=interpret, **kw),
        )
    from pallas_kernels import sparse_attention_triton as t
    from pallas_kernels.tuning import for_device

    extra = dict(sm_scale=HEAD_DIM**-0.5, tuning=for_device()[0], interpret=interpret)
    return (
        lambda *a, **kw: t.sparse_attention_pallas(*a, return_lse=True, **extra, **kw),
        lambda *a, **kw: t.sparse_attention_pallas_backward(*a, **extra, **kw),
    )


def check_merged_backward(path, qkv, cots, selection, kv_valid, want, interpret=False):
    forward, backward = path_fns(path, interpret)
    kw = dict(q_tile=Q_TILE, kv_block=KV_BLOCK, kv_valid=kv_valid)
    # one kernel per jitted call: the Mosaic GPU interpreter (--interpret) deadlocks on concurrent kernels
    forward = jax.jit(functools.partial(forward, **kw))
    backward = jax.jit(functools.partial(backward, **kw))
    parts = split(*selection)
    o, lse = merge_attention(*forward(*qkv, *parts[0]), *forward(*qkv, *parts[1]))
    grads = [backward(*qkv, *part, o, lse, *cots) for part in parts]
    return errors((o, lse, *(a.astype(jnp.float32) + b.astype(jnp.float32) for a, b in zip(*grads))), want)


def check_ring(qkv, cots, selection, kv_valid, want):
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("context",))
    axis = GroupAxis("context", n)
    seq_spec, tile_spec = P(None, "context"), P(None, None, "context")

    def body(q, k, v, index, count, kv_valid):
        return scp.ring_attention(
            q,
            k,
            v,
            axis=axis,
            sm_scale=HEAD_DIM**-0.5,
            kv_index=index,
            kv_count=count,
            kv_valid=kv_valid,
            q_tile=Q_TILE,
            kv_block=KV_BLOCK,
            impl="auto",
        )

    ring = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(seq_spec,) * 3 + (tile_spec, tile_spec, P()),
        out_specs=(seq_spec, tile_spec),
        check_vma=False,
    )

    @jax.jit
    def run(q, k, v, do, dlse, index, count, kv_valid):
        (o, lse), vjp = jax.vjp(lambda q, k, v: ring(q, k, v, index, count, kv_valid), q, k, v)
        return o, lse, *vjp((do, dlse))

    return errors(run(*qkv, *cots, *selection, kv_valid), want), n


def errors(got, want):
    """Relative errors of (o, lse on finite rows, dq, dk, dv); inf where the non-finite entries differ."""
    o, lse, *grads = got
    w_o, w_lse, *w_grads = want
    lse, w_lse = np.asarray(lse), np.asarray(w_lse)
    finite = np.isfinite(w_lse)
    lse_err = rel_error(lse[finite], w_lse[finite]) if np.array_equal(np.isfinite(lse), finite) else np.inf
    return {
        "o": rel_error(o, w_o),
        "lse": lse_err,
        **{name: rel_error(g, w) for name, g, w in zip(("dq", "dk", "dv"), grads, w_grads)},
    }


def report(name, errs):
    if "error" in errs:
        print(f"{name}: ERROR {errs['error']}", flush=True)
        return False
    bad = [k for k, e in errs.items() if not e < TOL]
    print(
        f"{name}: " + " ".join(f"{k} {e:.2e}" for k, e in errs.items()) + (f"  FAILED {bad}" if bad else "  ok"),
        flush=True,
    )
    return not bad


def big_case(seq, heads, seed):
    """The benchmarked geometry: random 64-token blocks at keep 0.1, no padding, cotangents for o and lse."""
    from experiments.harness import random_qkv, random_selection

    ks = jax.random.split(jax.random.key(seed), 3)
    q, k, v, do = random_qkv(ks[0], seq, heads, HEAD_DIM, jnp.bfloat16)
    dlse = jax.random.normal(ks[1], (1, heads, seq))
    selection = random_selection(ks[2], seq=seq, heads=heads, q_tile=Q_TILE, kv_block=KV_BLOCK, keep=0.1)
    return (q, k, v), (do, dlse), selection, None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: small shapes, kernels interpreted")
    ap.add_argument("--paths", nargs="+", default=None, help="kernel paths (default: mgpu triton; quick: triton)")
    args = ap.parse_args(argv)
    if not args.quick and not on_gpu():
        sys.exit("check_sparse_backward.py checks the compiled GPU kernels; use --quick on a CPU")
    paths = args.paths or (["triton"] if args.quick else ["mgpu", "triton"])
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} x {jax.device_count()}", flush=True)
    cases = {"edge": inputs(256 if args.quick else 4096, 1 if args.quick else 4)}
    if not args.quick:
        cases.update({"8k": big_case(8192, 16, 1), "32k": big_case(32768, 16, 2)})
    rows, ok = [], True
    for name, case in cases.items():
        want = jax.jit(reference)(*case)
        for path in paths:
            try:
                errs = check_merged_backward(path, *case, want, args.quick)
            except Exception as e:  # one path failing to build must not hide the others' results
                errs = {"error": error_text(e)}
            rows.append({"case": name, "seq": case[0][0].shape[1], "check": f"merged backward [{path}]", **errs})
            ok &= report(f"{name}: merged backward [{path}]", errs)
        if name == "edge":
            try:
                errs, n = check_ring(*case, want)
                label = f"sparse ring over {n} device(s), impl=auto"
            except Exception as e:
                errs, label = {"error": error_text(e)}, "sparse ring"
            rows.append({"case": name, "seq": case[0][0].shape[1], "check": label, **errs})
            ok &= report(f"{name}: {label}", errs)
    path = write_results(
        "check_sparse_backward" + ("_quick" if args.quick else ""), {"tolerance": TOL, "rows": rows, "all_ok": bool(ok)}
    )
    print("wrote", path)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
