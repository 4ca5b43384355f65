"""Fused AdaLN (Pallas) against the XLA reference: time, bandwidth, activation memory, a 2.7B train step.

    python -m experiments.bench_adaln            # GPU, about 3 minutes with compiles
    python -m experiments.bench_adaln --quick    # tiny sizes on the CPU (interpret mode)

Sections (--sections, default all):
  kernels  N x C grid, B=1, bf16 activations (fp32 modulation vectors, as in the model): outputs and all
           gradients of the fused kernel against the reference first, then median times of forward and
           forward+backward for both, achieved bandwidth over the minimal bytes (forward: read x, write y;
           forward+backward: that plus read x and dy, write dx) against a copy measured in this run.
           The gated kernel is measured at the headline shape (N=64k, C=3072).
  sweep    (not in the default run) block sizes around the default at N=64k, C=3072 and C=1152, to
           tune BlockSizes.default: python -m experiments.bench_adaln --sections sweep
  memory   compiled memory analysis of a gradient through a chain of AdaLN layers (plain and gated):
           temporary bytes, i.e. what the backward keeps alive, fused vs XLA.
  train    one train step of the 2.7B preset at 16k video tokens with model.adaln_impl=pallas vs xla.
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp

from dsv_jax.config import get_config
from experiments import harness
from experiments.training import QUICK_MODEL, time_train_step
from pallas_kernels.adaln import BlockSizes, adaln_modulate, adaln_modulate_pallas, gated_residual_adaln

DEFAULT_SECTIONS = "kernels,memory,train"
SIZES = {
    "gpu": {
        "N": [8192, 16384, 32768, 65536],
        "C": [1152, 2048, 3072, 5120],
        "headline": (65536, 3072),
        "iters": 10,
        "sweep_shapes": [(65536, 3072), (65536, 1152)],
        "sweep_limit": None,
        "memory": (16384, 3072, 4),  # N, C, layers
        # latents (16, 64, 64, 16), patch (1, 2, 2) -> 16 x 32 x 32 = 16384 video tokens
        "train": ("2.7b", (16, 64, 64), ["text.max_len=64"], 5),
        "copy_bytes": 2 << 30,
    },
    "quick": {
        "N": [37],
        "C": [96],
        "headline": (37, 96),
        "iters": 3,
        "sweep_shapes": [(37, 96)],
        "sweep_limit": 2,
        "memory": (37, 96, 2),
        "train": ("tiny", (1, 8, 8), QUICK_MODEL + ["model.depth=1", "model.patch=[1,4,4]", "text.max_len=8"], 3),
        "copy_bytes": 64 << 20,
    },
}
GOALS = {"fwd_pct_of_copy": 85.0, "fwd_bwd_speedup_64k_3072": 2.5, "memory_ratio_max": 0.5}
TOL = 2e-2  # relative error of bf16 outputs and gradients against the reference


def make_inputs(key, b, n, c, dtype, gated=False):
    ks = jax.random.split(key, 7)
    big = lambda k: jax.random.normal(k, (b, n, c), dtype)
    vec = lambda k: 0.5 * jax.random.normal(k, (b, c), jnp.float32)
    out = {"x": (2.0 * big(ks[0]) + 1.0).astype(dtype), "scale": vec(ks[1]), "shift": vec(ks[2]), "dy": big(ks[3])}
    if gated:
        out.update(branch=big(ks[4]), gate=vec(ks[5]), dh=big(ks[6]))
    return out


# The four programs timed per shape. Forward+backward returns the output too, as training needs it.
def fwd_fn(impl, block_sizes=None):
    if block_sizes is not None:
        return jax.jit(lambda v: adaln_modulate_pallas(v["x"], v["scale"], v["shift"], block_sizes=block_sizes))
    return jax.jit(lambda v: adaln_modulate(v["x"], v["scale"], v["shift"], impl=impl))


def fwd_bwd_fn(impl, block_sizes=None):
    fn = (
        functools.partial(adaln_modulate_pallas, block_sizes=block_sizes)
        if block_sizes is not None
        else functools.partial(adaln_modulate, impl=impl)
    )
    return jax.jit(lambda v: harness.fwd_bwd(fn)(v["x"], v["scale"], v["shift"], v["dy"]))


def gated_fns(impl):
    fn = functools.partial(gated_residual_adaln, impl=impl)
    args = lambda v: (v["x"], v["branch"], v["gate"], v["scale"], v["shift"])
    return jax.jit(lambda v: fn(*args(v))), jax.jit(lambda v: harness.fwd_bwd(fn)(*args(v), (v["dh"], v["dy"])))


def max_rel_error(outs, refs):
    return max(harness.rel_error(o, r) for o, r in zip(jax.tree.leaves(outs), jax.tree.leaves(refs)))


def timed(fn, v, iters):
    return harness.time_fn(fn, v, warmup=2, iters=iters)["median_ms"]


def bench_kernels(ns, cs, dtype, copy_tbps, iters, headline):
    rows = []
    for n in ns:
        for c in cs:
            v = make_inputs(jax.random.key(n + c), 1, n, c, dtype)
            f = {impl: (fwd_fn(impl), fwd_bwd_fn(impl)) for impl in ("xla", "pallas")}
            outs = {impl: (f[impl][0](v), f[impl][1](v)) for impl in f}  # compile + correctness first
            err_fwd = max_rel_error(outs["pallas"][0], outs["xla"][0])
            err_bwd = max_rel_error(outs["pallas"][1], outs["xla"][1])
            row = {"N": n, "C": c, "err_fwd": err_fwd, "err_fwd_bwd": err_bwd}
            if max(err_fwd, err_bwd) > TOL:
                row["error"] = "fused kernel disagrees with the reference; not timed"
                rows.append(row)
                print(row, flush=True)
                continue
            isz = jnp.dtype(dtype).itemsize
            fwd_bytes, fb_bytes = 2 * n * c * isz, 5 * n * c * isz
            for impl, name in (("xla", "xla"), ("pallas", "fused")):
                row[f"{name}_fwd_ms"] = timed(f[impl][0], v, iters)
                row[f"{name}_fwd_bwd_ms"] = timed(f[impl][1], v, iters)
                row[f"{name}_fwd_tbps"] = fwd_bytes / row[f"{name}_fwd_ms"] / 1e9
                row[f"{name}_fwd_bwd_tbps"] = fb_bytes / row[f"{name}_fwd_bwd_ms"] / 1e9
            row["fwd_speedup"] = row["xla_fwd_ms"] / row["fused_fwd_ms"]
            row["fwd_bwd_speedup"] = row["xla_fwd_bwd_ms"] / row["fused_fwd_bwd_ms"]
            row["fused_fwd_pct_copy"] = 100 * row["fused_fwd_tbps"] / copy_tbps
            row["fused_fwd_bwd_pct_copy"] = 100 * row["fused_fwd_bwd_tbps"] / copy_tbps
            rows.append(row)
            del v, outs
    harness.print_table(
        rows,
        [
            "N",
            "C",
            "xla_fwd_ms",
            "fused_fwd_ms",
            "fwd_speedup",
            "fused_fwd_pct_copy",
            "xla_fwd_bwd_ms",
            "fused_fwd_bwd_ms",
            "fwd_bwd_speedup",
            "fused_fwd_bwd_pct_copy",
            "err_fwd_bwd",
        ],
    )

    n, c = headline  # the gated kernel (residual add + AdaLN) at the headline shape
    v = make_inputs(jax.random.key(1), 1, n, c, dtype, gated=True)
    f = {impl: gated_fns(impl) for impl in ("xla", "pallas")}
    outs = {impl: (f[impl][0](v), f[impl][1](v)) for impl in f}
    isz = jnp.dtype(dtype).itemsize
    gated = {
        "N": n,
        "C": c,
        "err_fwd": max_rel_error(outs["pallas"][0], outs["xla"][0]),
        "err_fwd_bwd": max_rel_error(outs["pallas"][1], outs["xla"][1]),
        # forward: read residual, branch; write h, y. backward: read h, branch, dh, dy; write dr, dbranch
        "fwd_bytes": 4 * n * c * isz,
        "fwd_bwd_bytes": 10 * n * c * isz,
    }
    if max(gated["err_fwd"], gated["err_fwd_bwd"]) <= TOL:
        for impl, name in (("xla", "xla"), ("pallas", "fused")):
            gated[f"{name}_fwd_ms"] = timed(f[impl][0], v, iters)
            gated[f"{name}_fwd_bwd_ms"] = timed(f[impl][1], v, iters)
        gated["fwd_speedup"] = gated["xla_fwd_ms"] / gated["fused_fwd_ms"]
        gated["fwd_bwd_speedup"] = gated["xla_fwd_bwd_ms"] / gated["fused_fwd_bwd_ms"]
        gated["fused_fwd_pct_copy"] = 100 * gated["fwd_bytes"] / gated["fused_fwd_ms"] / 1e9 / copy_tbps
        gated["fused_fwd_bwd_pct_copy"] = 100 * gated["fwd_bwd_bytes"] / gated["fused_fwd_bwd_ms"] / 1e9 / copy_tbps
    else:
        gated["error"] = "fused gated kernel disagrees with the reference; not timed"
    print("gated", {k: (round(x, 4) if isinstance(x, float) else x) for k, x in gated.items()}, flush=True)
    return rows, gated


def sweep_options(c):
    """Block sizes around the default: each forward and backward knob halved / doubled, and for a width
    split into narrow chunks (1152 = 9 x 128) the padded single-chunk layout."""
    base = BlockSizes.default(c)
    swap = lambda **kw: dataclasses.replace(base, **kw)
    options = {
        "default": base,
        f"fwd rows={base.rows * 2}": swap(rows=base.rows * 2),
        f"fwd warps={max(1, base.warps // 2)}": swap(warps=max(1, base.warps // 2)),
        f"fwd warps={base.warps * 2}": swap(warps=min(32, base.warps * 2)),
        f"bwd rows={base.bwd_rows * 2}": swap(bwd_rows=base.bwd_rows * 2),
        f"bwd warps={max(1, base.bwd_warps // 2)}": swap(bwd_warps=max(1, base.bwd_warps // 2)),
        f"bwd programs={base.bwd_programs // 2}": swap(bwd_programs=base.bwd_programs // 2),
        f"bwd programs={base.bwd_programs * 2}": swap(bwd_programs=base.bwd_programs * 2),
    }
    if c & -c < 512:
        options["padded columns"] = BlockSizes.default(c, min_chunk=4096)
    return options


def sweep_block_sizes(shapes, dtype, iters, limit=None):
    """Times the fused kernels with each of sweep_options at each (N, C) (compile: ~2 s a config)."""
    rows = []
    for n, c in shapes:
        v = make_inputs(jax.random.key(2), 1, n, c, dtype)
        ref = fwd_bwd_fn("xla")(v)
        for name, bs in list(sweep_options(c).items())[:limit]:
            row = {"N": n, "C": c, "config": name}
            try:
                fb = fwd_bwd_fn("pallas", bs)
                row["err"] = max_rel_error(fb(v), ref)
                row.update(
                    fwd_ms=timed(fwd_fn("pallas", bs), v, iters),
                    fwd_bwd_ms=timed(fb, v, iters),
                    **dataclasses.asdict(bs),
                )
            except Exception as e:  # a config that does not compile (registers, shared memory) is reported
                row["error"] = harness.error_text(e)
            rows.append(row)
        del v, ref
    harness.print_table(rows, ["N", "C", "config", "fwd_ms", "fwd_bwd_ms", "err", "error"])
    return rows


def residual_bytes(fn, *args):
    """Bytes autodiff keeps for fn's backward (its vjp residuals, inputs included), before XLA fusion."""
    res = jax.eval_shape(lambda *a: jax.tree.leaves(jax.vjp(fn, *a)[1]), *args)
    return sum(r.size * jnp.dtype(r.dtype).itemsize for r in res)


def chain_memory(n, c, layers, dtype):
    """What the backward of AdaLN layers keeps alive: vjp residuals of one layer, and the compiled
    temporary bytes of jit(grad) through a chain of `layers` layers (plain, and gated with each
    layer's output as the next one's branch)."""
    x = jax.ShapeDtypeStruct((1, n, c), dtype)
    vec = jax.ShapeDtypeStruct((1, c), jnp.float32)
    vecs = jax.ShapeDtypeStruct((layers, 1, c), jnp.float32)
    sum_sq = lambda a: jnp.sum(jnp.square(a.astype(jnp.float32)))

    def plain(impl):
        def loss(x, scales, shifts):
            for i in range(layers):
                x = adaln_modulate(x, scales[i], shifts[i], impl=impl)
            return sum_sq(x)

        return jax.grad(loss, argnums=(0, 1, 2))

    def gated(impl):
        def loss(x, scales, shifts):
            h, y = x, x
            for i in range(layers):
                h, y = gated_residual_adaln(h, y, scales[i], scales[i], shifts[i], impl=impl)
            return sum_sq(h) + sum_sq(y)

        return jax.grad(loss, argnums=(0, 1, 2))

    one_layer = {
        "plain": (lambda impl: functools.partial(adaln_modulate, impl=impl), (x, vec, vec)),
        "gated": (lambda impl: functools.partial(gated_residual_adaln, impl=impl), (x, x, vec, vec, vec)),
    }
    act = n * c * jnp.dtype(dtype).itemsize
    out = {"N": n, "C": c, "layers": layers, "activation_bytes": act}
    for kind, chain in (("plain", plain), ("gated", gated)):
        for impl in ("xla", "pallas"):
            layer_fn, layer_args = one_layer[kind]
            out[f"{kind}_{impl}_residual_bytes"] = residual_bytes(layer_fn(impl), *layer_args)
            m = harness.compiled_memory(chain(impl), x, vecs, vecs)
            out[f"{kind}_{impl}_temp_bytes"] = m.get("temp_bytes")
            out[f"{kind}_{impl}_temp_activations_per_layer"] = m.get("temp_bytes", 0) / act / layers
        xla, fused = out[f"{kind}_xla_temp_bytes"], out[f"{kind}_pallas_temp_bytes"]
        out[f"{kind}_ratio"] = fused / xla if xla else None
        out[f"{kind}_residual_ratio"] = out[f"{kind}_pallas_residual_bytes"] / out[f"{kind}_xla_residual_bytes"]
    print("memory", out, flush=True)
    return out


def train_step(preset, latent_shape, overrides, impl, steps):
    """Median step time of the preset with model.adaln_impl=impl after one warm-up step (B = 1)."""
    cfg = get_config(preset, [*overrides, f"model.adaln_impl={impl}"])
    r = time_train_step(cfg, latent_shape, steps - 1)
    out = {
        "impl": impl,
        "tokens": r["tokens"],
        "compile_s": r["compile_s"],
        "step_ms": 1e3 * r["step_s"],
        "times_ms": [1e3 * t for t in [r["warmup_s"], *r["step_times_s"]]],
        "loss": r["loss"],
        "temp_bytes": r["temp_bytes"],
    }
    print("train", out, flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes on the CPU (interpret mode)")
    p.add_argument(
        "--sections",
        default=DEFAULT_SECTIONS,
        help="comma-separated: kernels, sweep, memory, train (sweep is extra: ~1 min on the GPU)",
    )
    args = p.parse_args()
    sections = set(args.sections.split(","))
    if not sections <= {"kernels", "sweep", "memory", "train"}:
        p.error(f"--sections {args.sections}: choose from kernels, sweep, memory, train")
    t_start = time.perf_counter()
    dtype = jnp.bfloat16
    if not args.quick and not harness.on_gpu():
        sys.exit("bench_adaln.py measures the GPU kernels; use --quick on a CPU")
    z = SIZES["quick" if args.quick else "gpu"]
    ns, cs, headline, iters = z["N"], z["C"], z["headline"], z["iters"]

    results = {"dtype": "bfloat16", "batch": 1, "goals": GOALS, "sections": sorted(sections)}
    copy_tbps = harness.copy_bandwidth_tbps(z["copy_bytes"])
    results["copy_tbps"] = copy_tbps
    print(f"copy bandwidth {copy_tbps:.3f} TB/s", flush=True)

    def section(name, fn):
        if name in sections:
            t0 = time.perf_counter()
            results[name] = fn()
            print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)

    section("kernels", lambda: dict(zip(("rows", "gated"), bench_kernels(ns, cs, dtype, copy_tbps, iters, headline))))
    section("sweep", lambda: sweep_block_sizes(z["sweep_shapes"], dtype, iters, z["sweep_limit"]))
    section("memory", lambda: chain_memory(*z["memory"], dtype))

    def train():
        preset, latent, overrides, steps = z["train"]
        out = {impl: train_step(preset, latent, overrides, impl, steps) for impl in ("xla", "pallas")}
        out["speedup"] = out["xla"]["step_ms"] / out["pallas"]["step_ms"]
        return out

    section("train", train)
    results["summary"] = summarize(results, headline)
    results["wall_s"] = time.perf_counter() - t_start
    print("summary", results["summary"], f"wall {results['wall_s']:.0f} s", flush=True)
    name = "bench_adaln" + ("_quick" if args.quick else "")
    if args.sections != DEFAULT_SECTIONS:
        name += "_" + "_".join(sorted(sections))
    print("wrote", harness.write_results(name, results))


def summarize(results, headline):
    out = {}
    rows = results.get("kernels", {}).get("rows", [])
    timed_rows = [r for r in rows if "fused_fwd_pct_copy" in r]
    if timed_rows:
        out["fwd_pct_copy_min"] = min(r["fused_fwd_pct_copy"] for r in timed_rows)
        out["fwd_pct_copy_median"] = sorted(r["fused_fwd_pct_copy"] for r in timed_rows)[len(timed_rows) // 2]
        head = [r for r in timed_rows if (r["N"], r["C"]) == tuple(headline)]
        if head:
            out["fwd_bwd_speedup_headline"] = head[0]["fwd_bwd_speedup"]
    if rows and len(timed_rows) < len(rows):
        out["incorrect_shapes"] = [(r["N"], r["C"]) for r in rows if "error" in r]
    if "memory" in results:
        for kind in ("plain", "gated"):
            out[f"memory_ratio_{kind}"] = results["memory"][f"{kind}_ratio"]
            out[f"residual_ratio_{kind}"] = results["memory"][f"{kind}_residual_ratio"]
    if "train" in results:
        out["train_step_speedup"] = results["train"]["speedup"]
    return out


if __name__ == "__main__":
    main()
