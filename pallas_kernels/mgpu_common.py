"""Building blocks shared by the Mosaic GPU (Hopper) kernels of block-sparse attention.

A kernel runs three warpgroups per CTA: two consumers (64 rows each, wgmma) and one producer that
streams the blocks named by a work list into a ring of SMEM stages by TMA. Each consumer walks one list
(`lists=2`: two lists, two rings) or both walk the same list (`lists=1`: one ring, every stage is freed
by both consumers). A ring stage carries one or more payload groups; each group has a `ready` barrier
(one arrival per TMA copy) and a `free` barrier (one arrival per consumer of the stage).

`Ops` hides what the GPU interpreter (jax's CPU simulation of Mosaic GPU, used by the tests) lacks:
layout casts, `plgpu.load`, transposed and register wgmma operands. In interpret mode the products are
plain dots with the same operands; barriers, copies and control flow are the real ones.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

ROWS = 64  # rows of a consumer warpgroup's tile and of one streamed step
CONSUMERS = 2


def import_plgpu():
    """jax.experimental.pallas.mosaic_gpu, or an ImportError naming what is missing."""
    try:
        import jax.experimental.pallas.mosaic_gpu as plgpu
    except Exception as e:
        raise ImportError(f"jax.experimental.pallas.mosaic_gpu is unavailable ({type(e).__name__}: {e})") from e
    return plgpu


def swizzled(plgpu, shape, dtype):
    """SMEM of rows of a 16-bit dtype, 128-byte swizzled as wgmma and TMA want it."""
    tiling = plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(128)))


def kernel_call(plgpu, body, out_types, **kwargs):
    """plgpu.kernel across the out_shape -> out_type rename."""
    params = inspect.signature(plgpu.kernel).parameters
    key = "out_type" if "out_type" in params else "out_shape"
    return plgpu.kernel(body, **{key: out_types}, **kwargs)


def compiler_params(plgpu):
    """Approximate exp2/log; no SMEM reserved for cross-warp reductions (the kernels reduce only along
    rows of wgmma tiles, inside a warp), which leaves room for a third forward stage at q_tile 64."""
    return plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0)


@dataclasses.dataclass(frozen=True)
class Ops:
    """Array operations of a consumer warpgroup, compiled (wgmma) or interpreted (plain dots)."""

    plgpu: object
    interpret: bool

    @property
    def wgmma_layout(self):
        return self.plgpu.Layout.WGMMA

    def row_layout(self):  # one value per row of a [64, N] wgmma tile
        return self.plgpu.Layout.WGMMA.reduce(1)

    def col_layout(self):  # one value per column
        return self.plgpu.Layout.WGMMA.reduce(0)

    def cast(self, x, layout):
        return x if self.interpret else self.plgpu.layout_cast(x, layout)

    def full(self, shape, value, layout):
        return self.cast(jnp.full(shape, value, jnp.float32), layout)

    def iota(self, shape, dim):
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return self.plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=self.wgmma_layout)

    def load(self, ref, layout):
        """A small SMEM vector into registers in `layout`."""
        if self.interpret:
            return ref[...]
        load = self.plgpu.load
        if "idx" in inspect.signature(load).parameters and inspect.signature(load).parameters["idx"].default is \
                inspect.Parameter.empty:
            return load(ref, (), layout=layout)
        return load(ref, layout=layout)

    def set_registers(self, n: int, action: str):
        if not self.interpret:
            self.plgpu.set_max_registers(n, action=action)

    def mma(self, products: Sequence[tuple], after: Callable[[], None] | None = None):
        """Issues the products, runs `after` while they run, waits, returns their accumulators.

        Each product is (acc, a, b, transpose_b): acc is an fp32 array to accumulate into (WGMMA layout)
        or a shape (a fresh zero accumulator); a is an SMEM ref or a register array; b an SMEM ref,
        transposed when transpose_b (a @ b.T). Issued together, they share one wait.
        """
        if self.interpret:
            outs = []
            for acc, a, b, transpose_b in products:
                a_val = a if isinstance(a, jax.Array) else a[...]
                b_val = b[...]
                prod = jnp.dot(a_val, b_val.T if transpose_b else b_val, preferred_element_type=jnp.float32)
                outs.append(prod if isinstance(acc, tuple) else acc + prod)
            if after is not None:
                after()
            return outs
        plgpu = self.plgpu

        def issue(refs):
            for ref, (_, a, b, transpose_b) in zip(refs, products, strict=True):
                plgpu.wgmma(ref, a, plgpu.transpose_ref(b, (1, 0)) if transpose_b else b)
            if after is not None:
                after()

        init = tuple(plgpu.ACC.init(self.full(acc, 0.0, self.wgmma_layout) if isinstance(acc, tuple) else acc)
                     for acc, *_ in products)
        return list(pl.run_state(issue)(init))


@dataclasses.dataclass(frozen=True)
class Group:
    """One payload of a ring stage: `copies(list_id, step, slot, barrier)` issues its TMA copies (one
    arrival each on `barrier`); ready/free are the barrier arrays, indexed list_id * stages + slot."""

    copies: Callable
    ready: object
    free: object


def produce(plgpu, groups: Sequence[Group], counts: Sequence, stages: int):
    """Producer warpgroup: for every list, steps 0..counts[list]-1 into slots step % stages.

    A slot is refilled once its previous contents were freed. The lists are served in turn at each step,
    so two lists advance together (their consumers run in lockstep through the schedule barrier)."""

    def issue(list_id, step, wait):
        slot = lax.rem(step, stages)
        index = list_id * stages + slot
        for group in groups:
            if wait:
                plgpu.barrier_wait(group.free.at[index])
            group.copies(list_id, step, slot, group.ready.at[index])

    for step in range(stages):  # fill the rings
        for list_id, n in enumerate(counts):
            pl.when(step < n)(functools.partial(issue, list_id, step, False))

    longest = counts[0] if len(counts) == 1 else jnp.maximum(*counts)

    @pl.loop(stages, jnp.maximum(longest, stages))
    def _refill(step):
        for list_id, n in enumerate(counts):
            pl.when(step < n)(functools.partial(issue, list_id, step, True))

    # Drain: wait for the last release of every used slot, so that each phase of a free barrier is
    # observed by the producer (the GPU interpreter checks this; on the GPU it costs an idle warpgroup).
    for slot in range(stages):
        for list_id, n in enumerate(counts):

            @pl.when(slot < n)
            def _(slot=slot, list_id=list_id):
                for group in groups:
                    plgpu.barrier_wait(group.free.at[list_id * stages + slot])


def schedule_round(plgpu, barrier):
    """One round of the schedule barrier: both consumers arrive, each waits for the other."""
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static geometry of one block-sparse attention call on the Mosaic GPU path (hashable).

    A CTA covers 128 query rows (forward, dQ) or 128 key rows (dK/dV), 64 per consumer warpgroup.
    The two consumers share one work list when a query tile (forward, dQ) or a KV block (dK/dV) spans
    both of them, else each walks its own.
    masked: kv_valid was given (per-block counts of valid keys; the others are masked).
    fwd_stages, bwd_stages: SMEM ring depth per list (forward; dQ and dK/dV). The dQ consumer waits for
    its next K slice while the current one is still in use, so the backward needs two or more.
    """

    q_tile: int
    kv_block: int
    head_dim: int
    sm_scale: float
    masked: bool = False
    fwd_stages: int = 2
    bwd_stages: int = 2
    tiles_fastest: bool = False
    interpret: bool = False

    def __post_init__(self):
        if self.fwd_stages < 1 or self.bwd_stages < 2:
            raise ValueError(f"fwd_stages={self.fwd_stages} must be >= 1 and bwd_stages={self.bwd_stages} >= 2")

    def grid(self, heads: int, pairs: int, batch: int) -> dict:
        """Launch grid, heads fastest by default: the CTAs resident at one time cover every head. Tiles
        fastest (all resident CTAs on one head, whose K/V rows are 256-byte stripes 4 KiB apart in
        [B, S, H, D]) measured slower on the H200 (fwd+bwd 8.9 vs 7.4 ms at S=32k, 90% sparsity;
        experiments/results/mgpu_notes.md), although it should reuse L2 better; not profiled further."""
        if self.tiles_fastest:
            return {"grid": (pairs, heads, batch), "grid_names": ("pairs", "heads", "batch")}
        return {"grid": (heads, pairs, batch), "grid_names": ("heads", "pairs", "batch")}

    @property
    def fwd_lists(self) -> int:
        return 1 if self.q_tile == 2 * ROWS else 2

    @property
    def dkdv_lists(self) -> int:
        return 1 if self.kv_block % (2 * ROWS) == 0 else 2

    @property
    def dkdv_rows(self) -> int:
        """Key rows that one dK/dV work list covers."""
        return 2 * ROWS if self.dkdv_lists == 1 else ROWS

    def interpret_params(self):
        if not self.interpret:
            return None
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        return InterpretGPUParams()
