"""3D RoPE on one q or k tensor: the model's apply_rope against the implementation it replaced, and one more.

    python -m experiments.bench_rope            # GPU: [1, S, 16, 128] bf16 at S = 64k and 128k, ~1 min
    python -m experiments.bench_rope --quick    # small shapes on the CPU

The profile of a 2.7B DSV step (bench_e2e --profile) gave RoPE 4-5% of the step, ~8x its memory time.
Variants, all exact against each other (outputs and gradients compared first, fp32 math, bf16 in and out):
  autodiff-parts   the previous apply_rope: per axis part, a*c - b*s and a*s + b*c on fp32 slices of x,
                   concatenated; the backward left to autodiff (slices and concatenation transpose into pads
                   and sums)
  vjp-swap         dsv_jax.attention.rope.apply_rope: x*cos + swap(x)*sin per channel (swap: the pair halves
                   exchanged by slices and one concatenation), with a custom VJP whose backward is the
                   rotation by the opposite angle (one elementwise pass)
  vjp-matmul       the same custom VJP with swap(x) as x @ P, P the [D, D] signed permutation (exact in bf16)
Per variant and S: median ms of the forward and of forward+backward (dx for a random cotangent) and the
bandwidth over the minimal bytes (forward: read x, write out; with the backward also read dy, write dx)
against a copy measured in the same run. Results: experiments/results/bench_rope.json.
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv_jax.attention.rope import apply_rope, axis_dims, full_width_table, rotary
from dsv_jax.model.tokens import token_layout
from experiments import harness

SIZES = {
    "gpu": {"grids": {"64k": (64, 32, 32), "128k": (128, 32, 32)}, "heads": 16, "head_dim": 128, "copy_bytes": 2 << 30},
    "quick": {"grids": {"512": (8, 8, 8)}, "heads": 2, "head_dim": 24, "copy_bytes": 16 << 20},
}


def autodiff_parts(x, rope):
    """The apply_rope this module's variants replace (dsv-jax before its custom VJP: docs/journal.md)."""
    cos, sin = (jnp.asarray(t, jnp.float32)[None, :, None, :] for t in rope)
    xf = x.astype(jnp.float32)
    out, start_x, start_a = [], 0, 0
    for dim in axis_dims(x.shape[-1]):
        part = xf[..., start_x : start_x + dim]
        c, s = cos[..., start_a : start_a + dim // 2], sin[..., start_a : start_a + dim // 2]
        a, b = part[..., : dim // 2], part[..., dim // 2 :]
        out += [a * c - b * s, a * s + b * c]
        start_x += dim
        start_a += dim // 2
    return jnp.concatenate(out, axis=-1).astype(x.dtype)


def swap_matrix(head_dim: int) -> np.ndarray:
    """P [D, D] with x @ P = the pair halves of each axis part exchanged."""
    order, start = [], 0
    for dim in axis_dims(head_dim):
        order += list(range(start + dim // 2, start + dim)) + list(range(start, start + dim // 2))
        start += dim
    p = np.zeros((head_dim, head_dim), np.float32)
    p[order, np.arange(head_dim)] = 1.0
    return p


def vjp_matmul(x, rope):
    p = jnp.asarray(swap_matrix(x.shape[-1]), x.dtype)

    def rotate(x, cos, sin):
        c = full_width_table(jnp.asarray(cos, jnp.float32), 1.0)[None, :, None, :]
        s = full_width_table(jnp.asarray(sin, jnp.float32), -1.0)[None, :, None, :]
        swapped = jnp.einsum("bshd,de->bshe", x, p, preferred_element_type=x.dtype)
        return (x.astype(jnp.float32) * c + swapped.astype(jnp.float32) * s).astype(x.dtype)

    @jax.custom_vjp
    def run(x):
        return rotate(x, *rope)

    run.defvjp(lambda x: (rotate(x, *rope), None), lambda _, g: (rotate(g, rope[0], -rope[1]),))
    return run(x)


VARIANTS = {"autodiff-parts": autodiff_parts, "vjp-swap": apply_rope, "vjp-matmul": vjp_matmul}


def bench_length(name, grid, heads, head_dim, copy_tbps):
    layout = token_layout(grid, (1, 1, 1))
    rope = rotary(layout.coords, head_dim)
    s = layout.seq_len
    kx, kg = jax.random.split(jax.random.key(s))
    x = jax.random.normal(kx, (1, s, heads, head_dim), jnp.bfloat16)
    g = jax.random.normal(kg, x.shape, jnp.bfloat16)
    nbytes = x.size * x.dtype.itemsize
    rows, reference = [], None
    for variant, fn in VARIANTS.items():
        fwd = jax.jit(lambda x, fn=fn: fn(x, rope))
        # forward and backward in one program: the output is returned too, or XLA would drop the forward
        both = jax.jit(lambda x, g, fn=fn: harness.fwd_bwd(lambda y: fn(y, rope))(x, g))
        y, (dx,) = both(x, g)
        out = (fwd(x), dx)
        assert float(jnp.max(jnp.abs(y.astype(jnp.float32) - out[0].astype(jnp.float32)))) == 0.0
        if reference is None:
            reference = out
        errors = [
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(out, reference)
        ]
        t_fwd = harness.time_fn(fwd, x)
        t_both = harness.time_fn(both, x, g)
        rows.append(
            {
                "length": name,
                "tokens": s,
                "variant": variant,
                "max_abs_diff_fwd": errors[0],
                "max_abs_diff_dx": errors[1],
                "fwd_ms": t_fwd["median_ms"],
                "fwd_spread_pct": t_fwd["spread_pct"],
                "fwd_bwd_ms": t_both["median_ms"],
                "fwd_bwd_spread_pct": t_both["spread_pct"],
                "fwd_pct_of_copy": 100 * 2 * nbytes / (t_fwd["median_ms"] * 1e-3) / 1e12 / copy_tbps,
                "fwd_bwd_pct_of_copy": 100 * 4 * nbytes / (t_both["median_ms"] * 1e-3) / 1e12 / copy_tbps,
            }
        )
    base = rows[0]
    for r in rows:
        r["fwd_bwd_speedup"] = base["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes on the CPU")
    args = p.parse_args()
    if not args.quick and not harness.on_gpu():
        sys.exit("bench_rope.py measures the GPU; use --quick on a CPU")
    t0 = time.perf_counter()
    z = SIZES["quick" if args.quick else "gpu"]
    copy_tbps = harness.copy_bandwidth_tbps(z["copy_bytes"])
    rows = []
    for name, grid in z["grids"].items():
        rows += bench_length(name, grid, z["heads"], z["head_dim"], copy_tbps)
    harness.print_table(
        rows,
        [
            "length",
            "variant",
            "fwd_ms",
            "fwd_bwd_ms",
            "fwd_pct_of_copy",
            "fwd_bwd_pct_of_copy",
            "fwd_bwd_speedup",
            "max_abs_diff_fwd",
            "max_abs_diff_dx",
        ],
    )
    harness.write_results(
        "bench_rope" + ("_quick" if args.quick else ""),
        {
            "dtype": "bfloat16",
            "batch": 1,
            "heads": z["heads"],
            "head_dim": z["head_dim"],
            "copy_tbps": copy_tbps,
            "rows": rows,
            "wall_s": time.perf_counter() - t0,
        },
    )


if __name__ == "__main__":
    main()
