"""AdaLN in Pallas (Triton lowering on the GPU, interpret mode on the CPU): the kernels, their sharding
and custom_vjp. The definition and input checks are pallas_kernels.adaln_reference's; the block sizes
pallas_kernels.tuning.BlockSizes.

The op is memory bound, so the kernels are built around bytes moved:

  forward   grid (row tiles, B). A program loads its [rows, C] tile once, keeps mean and variance in
            fp32 registers and writes y (and h). For the backward it saves only mean and rstd per row
            (8 bytes a row), never the normalised tensor.
  backward  grid (sequence chunks, B). A program owns the whole feature axis (a row's dx needs the
            row's sums over C) and a chunk of the sequence. It walks down the chunk one row tile at a
            time, writes dx of every row, and accumulates the column sums of d_scale / d_shift
            (/ d_gate) in fp32 registers. Each thread stays on the same feature columns for the whole
            walk, so every load is a contiguous row segment (coalesced) and nothing is strided along N.
            The [B, chunks, C] partial sums (a few MB) are added up once at the end. x and dy are read
            once: a separate column-reduction kernel would read both again.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # the Triton lowering is deprecated: without it the XLA reference runs (see pallas_kernels.lowering)
    from jax.experimental.pallas import triton as plgpu
except ImportError:
    plgpu = None

from pallas_kernels.adaln_reference import check_adaln_inputs, check_gated_inputs
from pallas_kernels.partitioning import partitioned_over_rows
from pallas_kernels.tuning import BlockSizes, column_chunks


@dataclasses.dataclass(frozen=True)
class _Columns:
    """The feature axis as `count` chunks of `width` columns (tuning.column_chunks)."""

    size: int
    width: int
    count: int

    @classmethod
    def of(cls, c: int, min_width: int = 1) -> _Columns:
        return cls(c, *column_chunks(c, min_width))

    @property
    def padded(self) -> int:
        return self.width * self.count

    def index(self, k: int):
        return k * self.width + jnp.arange(self.width)


# ----------------------------------------------------------------------------------------------------
# Kernel pieces. A row tile is a list of chunks [rows, width], one per column chunk (loaded in the
# array's dtype, computed on in fp32); values outside the array (the ragged last row tile, padded
# columns) load as 0.


def _tile_mask(row_ok, col, cols: _Columns):
    mask = jnp.broadcast_to(row_ok[:, None], (row_ok.shape[0], cols.width))
    return mask if cols.size == cols.padded else mask & (col < cols.size)[None, :]


def _load_tile(ref, b, row, row_ok, cols: _Columns):
    """ref[b, row, :] as chunks [rows, width] in the ref's dtype."""
    tile = []
    for k in range(cols.count):
        col = cols.index(k)
        tile.append(plgpu.load(ref.at[b, row[:, None], col[None, :]], mask=_tile_mask(row_ok, col, cols), other=0.0))
    return tile


def _f32(tile):
    return [chunk.astype(jnp.float32) for chunk in tile]


def _store_tile(ref, b, row, row_ok, cols: _Columns, tile):
    for k, chunk in enumerate(tile):
        col = cols.index(k)
        mask = _tile_mask(row_ok, col, cols)
        plgpu.store(ref.at[b, row[:, None], col[None, :]], chunk.astype(ref.dtype), mask=mask)


def _load_vector(ref, b, cols: _Columns):
    """ref[b, :] ([B, C]) as chunks [1, width], to broadcast over a row tile."""
    return [
        plgpu.load(ref.at[b, cols.index(k)], mask=cols.index(k) < cols.size, other=0.0)[None, :]
        for k in range(cols.count)
    ]


def _store_vector(ref, b, s, cols: _Columns, tile):
    """Column sums of a row tile into ref[b, s, :] ([B, chunks, C])."""
    for k, chunk in enumerate(tile):
        col = cols.index(k)
        plgpu.store(ref.at[b, s, col], jnp.sum(chunk, axis=0), mask=col < cols.size)


def _row_mean(tile, cols: _Columns):
    """Mean over the feature axis, [rows]: add the chunks first, then one reduction."""
    return jnp.sum(functools.reduce(lambda a, c: a + c, tile), axis=1) / cols.size


def _normalize(x, cols: _Columns, eps: float):
    """(mean [rows], rstd [rows], xhat) of a row tile, as the reference: var = mean((x - mean)^2), fp32."""
    mean = _row_mean(x, cols)
    centred = [xc - mean[:, None] for xc in x]
    if cols.size != cols.padded:  # padded columns must not count in the variance
        centred = [jnp.where((cols.index(k) < cols.size)[None, :], d, 0.0) for k, d in enumerate(centred)]
    rstd = lax.rsqrt(_row_mean([d * d for d in centred], cols) + eps)
    return mean, rstd, [d * rstd[:, None] for d in centred]


def _rows(start, rows: int, n: int):
    row = start + jnp.arange(rows)
    return row, row < n


def _dnormalize(xhat, rstd, g, cols: _Columns):
    """d LN(x) / dx applied to g (the cotangent of xhat): rstd * (g - mean(g) - xhat * mean(g * xhat))."""
    mean_g = _row_mean(g, cols)[:, None]
    mean_gx = _row_mean([gc * xc for gc, xc in zip(g, xhat)], cols)[:, None]
    return [rstd * (gc - mean_g - xc * mean_gx) for gc, xc in zip(g, xhat)]


# ----------------------------------------------------------------------------------------------------
# Forward kernels: one pass per row tile.


def _adaln_fwd_kernel(x_ref, scale_ref, shift_ref, y_ref, mean_ref, rstd_ref, *, cols, rows, eps):
    b = pl.program_id(1)
    row, row_ok = _rows(pl.program_id(0) * rows, rows, x_ref.shape[1])
    mean, rstd, xhat = _normalize(_f32(_load_tile(x_ref, b, row, row_ok, cols)), cols, eps)
    scale, shift = _f32(_load_vector(scale_ref, b, cols)), _f32(_load_vector(shift_ref, b, cols))
    _store_tile(y_ref, b, row, row_ok, cols, [xc * (1.0 + sc) + sh for xc, sc, sh in zip(xhat, scale, shift)])
    plgpu.store(mean_ref.at[b, row], mean, mask=row_ok)
    plgpu.store(rstd_ref.at[b, row], rstd, mask=row_ok)


def _gated_fwd_kernel(
    r_ref, br_ref, gate_ref, scale_ref, shift_ref, h_ref, y_ref, mean_ref, rstd_ref, *, cols, rows, eps
):
    b = pl.program_id(1)
    row, row_ok = _rows(pl.program_id(0) * rows, rows, r_ref.shape[1])
    r, br = _f32(_load_tile(r_ref, b, row, row_ok, cols)), _f32(_load_tile(br_ref, b, row, row_ok, cols))
    gate = _f32(_load_vector(gate_ref, b, cols))
    # h is rounded to its dtype before the statistics, as the reference normalises the stored h.
    h = [(rc + gc * bc).astype(h_ref.dtype) for rc, gc, bc in zip(r, gate, br)]
    _store_tile(h_ref, b, row, row_ok, cols, h)
    mean, rstd, hhat = _normalize([hc.astype(jnp.float32) for hc in h], cols, eps)
    scale, shift = _f32(_load_vector(scale_ref, b, cols)), _f32(_load_vector(shift_ref, b, cols))
    _store_tile(y_ref, b, row, row_ok, cols, [xc * (1.0 + sc) + sh for xc, sc, sh in zip(hhat, scale, shift)])
    plgpu.store(mean_ref.at[b, row], mean, mask=row_ok)
    plgpu.store(rstd_ref.at[b, row], rstd, mask=row_ok)


# ----------------------------------------------------------------------------------------------------
# Backward kernels: each program walks down its chunk of the sequence; dx per row, column partial sums
# in registers. Rows outside the array load dy = 0, so they add nothing to any sum.


def _walk(chunk_rows: int, rows: int, n: int, load, body, init):
    """acc = body(row, row_ok, load(row, row_ok), acc) over this program's chunk of the sequence, one
    row tile a step. The next step's tiles are loaded before this step's arithmetic and carried
    through the loop in their storage dtype, so a program keeps two tiles of loads in flight instead
    of one (the last step's look-ahead reads one tile of the next chunk, or nothing past N)."""
    start = pl.program_id(0) * chunk_rows
    at = lambda t: _rows(start + t * rows, rows, n)

    def step(t, carry):
        tiles, acc = carry
        upcoming = load(*at(t + 1))
        return upcoming, body(*at(t), tiles, acc)

    return lax.fori_loop(0, chunk_rows // rows, step, (load(*at(0)), init))[1]


def _load_row_stats(mean_ref, rstd_ref, b, row, row_ok):
    return (
        plgpu.load(mean_ref.at[b, row], mask=row_ok, other=0.0)[:, None],
        plgpu.load(rstd_ref.at[b, row], mask=row_ok, other=0.0)[:, None],
    )


def _adaln_bwd_kernel(
    x_ref, scale_ref, mean_ref, rstd_ref, dy_ref, dx_ref, dscale_ref, dshift_ref, *, cols, rows, chunk_rows
):
    b, s = pl.program_id(1), pl.program_id(0)
    scale1 = [1.0 + sc for sc in _f32(_load_vector(scale_ref, b, cols))]

    def load(row, row_ok):
        return (
            _load_tile(x_ref, b, row, row_ok, cols),
            _load_tile(dy_ref, b, row, row_ok, cols),
            _load_row_stats(mean_ref, rstd_ref, b, row, row_ok),
        )

    def body(row, row_ok, tiles, acc):
        (x, dy, (mean, rstd)), (acc_scale, acc_shift) = tiles, acc
        xhat = [(xc - mean) * rstd for xc in _f32(x)]
        dy = _f32(dy)
        dx = _dnormalize(xhat, rstd, [d * sc for d, sc in zip(dy, scale1)], cols)
        _store_tile(dx_ref, b, row, row_ok, cols, dx)
        return [a + d * xc for a, d, xc in zip(acc_scale, dy, xhat)], [a + d for a, d in zip(acc_shift, dy)]

    zeros = [jnp.zeros((rows, cols.width), jnp.float32) for _ in range(cols.count)]
    acc_scale, acc_shift = _walk(chunk_rows, rows, x_ref.shape[1], load, body, (zeros, zeros))
    _store_vector(dscale_ref, b, s, cols, acc_scale)
    _store_vector(dshift_ref, b, s, cols, acc_shift)


def _gated_bwd_kernel(
    h_ref,
    br_ref,
    gate_ref,
    scale_ref,
    mean_ref,
    rstd_ref,
    dh_ref,
    dy_ref,
    dr_ref,
    dbr_ref,
    dgate_ref,
    dscale_ref,
    dshift_ref,
    *,
    cols,
    rows,
    chunk_rows,
):
    b, s = pl.program_id(1), pl.program_id(0)
    scale1 = [1.0 + sc for sc in _f32(_load_vector(scale_ref, b, cols))]
    gate = _f32(_load_vector(gate_ref, b, cols))

    def load(row, row_ok):
        return (
            *(_load_tile(ref, b, row, row_ok, cols) for ref in (h_ref, br_ref, dh_ref, dy_ref)),
            _load_row_stats(mean_ref, rstd_ref, b, row, row_ok),
        )

    def body(row, row_ok, tiles, acc):
        (h, br, dh, dy, (mean, rstd)), (acc_gate, acc_scale, acc_shift) = tiles, acc
        hhat = [(hc - mean) * rstd for hc in _f32(h)]
        dy = _f32(dy)
        # dh: the cotangent of h from outside plus the path through the LayerNorm.
        dln = _dnormalize(hhat, rstd, [d * sc for d, sc in zip(dy, scale1)], cols)
        dh = [a + c for a, c in zip(_f32(dh), dln)]
        _store_tile(dr_ref, b, row, row_ok, cols, dh)
        _store_tile(dbr_ref, b, row, row_ok, cols, [d * g for d, g in zip(dh, gate)])
        return (
            [a + d * bc for a, d, bc in zip(acc_gate, dh, _f32(br))],
            [a + d * xc for a, d, xc in zip(acc_scale, dy, hhat)],
            [a + d for a, d in zip(acc_shift, dy)],
        )

    zeros = [jnp.zeros((rows, cols.width), jnp.float32) for _ in range(cols.count)]
    acc_gate, acc_scale, acc_shift = _walk(chunk_rows, rows, h_ref.shape[1], load, body, (zeros, zeros, zeros))
    _store_vector(dgate_ref, b, s, cols, acc_gate)
    _store_vector(dscale_ref, b, s, cols, acc_scale)
    _store_vector(dshift_ref, b, s, cols, acc_shift)


# ----------------------------------------------------------------------------------------------------
# pallas_call wrappers.


def _call(kernel, grid, out_shape, warps, interpret, name):
    # num_stages=1: no software pipelining by Triton (it is meant for loads feeding dots and would stage
    # tiles through shared memory); the backward's walk does its own one-step look-ahead in registers.
    return pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        interpret=interpret,
        name=name,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
    )


def _row_stats_shape(b, n):
    return jax.ShapeDtypeStruct((b, n), jnp.float32)


def _chunking(n: int, b: int, bs: BlockSizes):
    """(rows per backward program, programs along the sequence)."""
    target = max(1, bs.bwd_programs // b)
    chunk_rows = pl.cdiv(pl.cdiv(n, target), bs.bwd_rows) * bs.bwd_rows
    return chunk_rows, pl.cdiv(n, chunk_rows)


def _adaln_fwd_call(x, scale, shift, eps, bs: BlockSizes, interpret):
    b, n, c = x.shape
    kernel = functools.partial(_adaln_fwd_kernel, cols=_Columns.of(c, bs.min_chunk), rows=bs.rows, eps=eps)
    out_shape = (jax.ShapeDtypeStruct(x.shape, x.dtype), _row_stats_shape(b, n), _row_stats_shape(b, n))
    return _call(kernel, (pl.cdiv(n, bs.rows), b), out_shape, bs.warps, interpret, "adaln_fwd")(x, scale, shift)


def _adaln_bwd_call(x, scale, mean, rstd, dy, bs: BlockSizes, interpret):
    b, n, c = x.shape
    chunk_rows, chunks = _chunking(n, b, bs)
    kernel = functools.partial(
        _adaln_bwd_kernel, cols=_Columns.of(c, bs.min_chunk), rows=bs.bwd_rows, chunk_rows=chunk_rows
    )
    partial = jax.ShapeDtypeStruct((b, chunks, c), jnp.float32)
    out_shape = (jax.ShapeDtypeStruct(x.shape, x.dtype), partial, partial)
    dx, dscale, dshift = _call(kernel, (chunks, b), out_shape, bs.bwd_warps, interpret, "adaln_bwd")(
        x, scale, mean, rstd, dy
    )
    return dx, jnp.sum(dscale, axis=1), jnp.sum(dshift, axis=1)


def _gated_fwd_call(residual, branch, gate, scale, shift, eps, bs: BlockSizes, interpret):
    b, n, c = residual.shape
    kernel = functools.partial(_gated_fwd_kernel, cols=_Columns.of(c, bs.min_chunk), rows=bs.rows, eps=eps)
    h = jax.ShapeDtypeStruct(residual.shape, residual.dtype)
    out_shape = (h, h, _row_stats_shape(b, n), _row_stats_shape(b, n))
    return _call(kernel, (pl.cdiv(n, bs.rows), b), out_shape, bs.warps, interpret, "gated_adaln_fwd")(
        residual, branch, gate, scale, shift
    )


def _gated_bwd_call(h, branch, gate, scale, mean, rstd, dh, dy, bs: BlockSizes, interpret):
    b, n, c = h.shape
    chunk_rows, chunks = _chunking(n, b, bs)
    kernel = functools.partial(
        _gated_bwd_kernel, cols=_Columns.of(c, bs.min_chunk), rows=bs.bwd_rows, chunk_rows=chunk_rows
    )
    partial = jax.ShapeDtypeStruct((b, chunks, c), jnp.float32)
    out_shape = (
        jax.ShapeDtypeStruct(h.shape, h.dtype),
        jax.ShapeDtypeStruct(branch.shape, branch.dtype),
        partial,
        partial,
        partial,
    )
    dr, dbr, dgate, dscale, dshift = _call(kernel, (chunks, b), out_shape, bs.bwd_warps, interpret, "gated_adaln_bwd")(
        h, branch, gate, scale, mean, rstd, dh, dy
    )
    return dr, dbr, jnp.sum(dgate, axis=1), jnp.sum(dscale, axis=1), jnp.sum(dshift, axis=1)


# ----------------------------------------------------------------------------------------------------
# Sharding over rows (B and N; pallas_kernels.partitioning): the [B, C] results are summed over N's axes.

_adaln_fwd = partitioned_over_rows(_adaln_fwd_call, ("bnc", "bc", "bc"), ("bnc", "bn", "bn"))
_adaln_bwd = partitioned_over_rows(_adaln_bwd_call, ("bnc", "bc", "bn", "bn", "bnc"), ("bnc", "bc", "bc"))
_gated_fwd = partitioned_over_rows(_gated_fwd_call, ("bnc", "bnc", "bc", "bc", "bc"), ("bnc", "bnc", "bn", "bn"))
_gated_bwd = partitioned_over_rows(
    _gated_bwd_call, ("bnc", "bnc", "bc", "bc", "bn", "bn", "bnc", "bnc"), ("bnc", "bnc", "bc", "bc", "bc")
)


# ----------------------------------------------------------------------------------------------------
# custom_vjp: the forward saves the inputs it was given (already alive in the model) and mean / rstd.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _adaln_pallas(x, scale, shift, eps, bs, interpret):
    return _adaln_fwd(x, scale, shift, eps, bs, interpret)[0]


def _adaln_pallas_fwd(x, scale, shift, eps, bs, interpret):
    y, mean, rstd = _adaln_fwd(x, scale, shift, eps, bs, interpret)
    return y, (x, scale, shift, mean, rstd)


def _adaln_pallas_bwd(eps, bs, interpret, res, dy):
    x, scale, shift, mean, rstd = res
    dx, dscale, dshift = _adaln_bwd(x, scale, mean, rstd, dy, bs, interpret)
    return dx, dscale.astype(scale.dtype), dshift.astype(shift.dtype)


_adaln_pallas.defvjp(_adaln_pallas_fwd, _adaln_pallas_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _gated_pallas(residual, branch, gate, scale, shift, eps, bs, interpret):
    h, y, _, _ = _gated_fwd(residual, branch, gate, scale, shift, eps, bs, interpret)
    return h, y


def _gated_pallas_fwd(residual, branch, gate, scale, shift, eps, bs, interpret):
    # The backward needs h (an output, kept anyway by the next layer) and branch, not residual.
    h, y, mean, rstd = _gated_fwd(residual, branch, gate, scale, shift, eps, bs, interpret)
    return (h, y), (h, branch, gate, scale, shift, mean, rstd)


def _gated_pallas_bwd(eps, bs, interpret, res, cotangents):
    h, branch, gate, scale, shift, mean, rstd = res
    dh, dy = cotangents
    dr, dbr, dgate, dscale, dshift = _gated_bwd(h, branch, gate, scale, mean, rstd, dh, dy, bs, interpret)
    return dr, dbr, dgate.astype(gate.dtype), dscale.astype(scale.dtype), dshift.astype(shift.dtype)


_gated_pallas.defvjp(_gated_pallas_fwd, _gated_pallas_bwd)


def adaln_modulate_pallas(
    x, scale, shift, *, eps=1e-6, block_sizes: BlockSizes | None = None, interpret: bool | None = None
):
    """The Pallas kernel, whatever the backend (interpret mode unless on a GPU); `block_sizes` for tuning."""
    check_adaln_inputs(x, scale, shift)
    bs = block_sizes or BlockSizes.default(x.shape[-1])
    return _adaln_pallas(x, scale, shift, float(eps), bs, _interpret(interpret))


def gated_residual_adaln_pallas(
    residual,
    branch,
    gate,
    scale,
    shift,
    *,
    eps=1e-6,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
):
    check_gated_inputs(residual, branch, gate, scale, shift)
    bs = block_sizes or BlockSizes.default(residual.shape[-1])
    return _gated_pallas(residual, branch, gate, scale, shift, float(eps), bs, _interpret(interpret))


def _interpret(interpret: bool | None) -> bool:
    return jax.default_backend() != "gpu" if interpret is None else interpret
