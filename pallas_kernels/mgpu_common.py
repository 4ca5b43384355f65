"""Building blocks shared by the Mosaic GPU (Hopper) kernels of block-sparse attention.

A kernel runs three warpgroups per CTA: two consumers (64 rows each, wgmma) and one producer that
streams the blocks named by a work list into a ring of SMEM stages by TMA. Each consumer walks one list
(`lists=2`: two lists, two rings) or both walk the same list (`lists=1`: one ring, every stage is freed
by both consumers). A ring stage carries one or more payload groups; each group has a `ready` barrier
(one arrival per TMA copy) and a `free` barrier (one arrival per consumer of the stage). The producer
warpgroup is the same in every kernel (`producer`); a kernel gives it what to copy per work item (the
forward and dQ: `KVWalk.streams`).

`Ops` hides what the GPU interpreter (jax's CPU simulation of Mosaic GPU, used by the tests) lacks:
layout casts, `plgpu.load`, transposed and register wgmma operands. In interpret mode the products are
plain dots with the same operands; barriers, copies and control flow are the real ones.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

ROWS = 64  # rows of a consumer warpgroup's tile and of one streamed slice (a step is one or two slices)
CONSUMERS = 2
WARPGROUP = 128  # threads
REGISTERS_PER_SM = 65536
LAUNCH_REGISTERS = REGISTERS_PER_SM // ((CONSUMERS + 1) * WARPGROUP) // 8 * 8  # per thread before setmaxnreg: 168


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
        if (
            "idx" in inspect.signature(load).parameters
            and inspect.signature(load).parameters["idx"].default is inspect.Parameter.empty
        ):
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

        init = tuple(
            plgpu.ACC.init(self.full(acc, 0.0, self.wgmma_layout) if isinstance(acc, tuple) else acc)
            for acc, *_ in products
        )
        return list(pl.run_state(issue)(init))


@dataclasses.dataclass(frozen=True)
class Group:
    """One payload of a ring stage: `copies(list_id, step, slot, barrier)` issues its TMA copies (one
    arrival each on `barrier`); ready/free are the barrier arrays, indexed list_id * stages + slot."""

    copies: Callable
    ready: object
    free: object


def produce(plgpu, groups: Sequence[Group], counts: Sequence, stages: int, done: Sequence | None = None):
    """Producer warpgroup, one work item: for every list, its steps 0..counts[list]-1. Returns the new `done`.

    done[list]: steps that earlier work items of this CTA streamed through the list's ring (None: none), so
    step s goes to slot (done + s) % stages, and a slot is refilled once its previous contents were freed.
    The lists are served in turn at each step, so two lists advance together (their consumers run in
    lockstep through the schedule barrier). Call `drain` after the last work item."""
    done = [0] * len(counts) if done is None else list(done)
    first = all(isinstance(x, int) and x == 0 for x in done)  # the CTA's first item: fill without waiting

    def issue(list_id, step, wait):
        at = done[list_id] + step
        index = list_id * stages + lax.rem(at, stages)
        for group in groups:
            if wait is True:
                plgpu.barrier_wait(group.free.at[index])
            elif wait is not False:
                pl.when(wait)(lambda group=group: plgpu.barrier_wait(group.free.at[index]))
            group.copies(list_id, step, lax.rem(at, stages), group.ready.at[index])

    longest = counts[0] if len(counts) == 1 else jnp.maximum(*counts)
    if first:
        for step in range(stages):  # fill the rings
            for list_id, n in enumerate(counts):
                pl.when(step < n)(functools.partial(issue, list_id, step, False))

    @pl.loop(stages if first else 0, jnp.maximum(longest, stages) if first else longest)
    def _stream(step):
        for list_id, n in enumerate(counts):
            wait = True if first else done[list_id] + step >= stages
            pl.when(step < n)(functools.partial(issue, list_id, step, wait))

    return [d + n for d, n in zip(done, counts, strict=True)]


def drain(plgpu, groups: Sequence[Group], done: Sequence, stages: int):
    """Wait for the last release of every used slot, so that each phase of a free barrier is observed by
    the producer (the GPU interpreter checks this; on the GPU it costs an idle warpgroup). done: the
    steps each list's ring carried in all (`produce`'s result after the last work item)."""
    for slot in range(stages):
        for list_id, n in enumerate(done):

            @pl.when(slot < n)
            def _(slot=slot, list_id=list_id):
                for group in groups:
                    plgpu.barrier_wait(group.free.at[list_id * stages + slot])


def producer(plgpu, ops: Ops, work, *, lists: int, stages: int, registers: int, rings: Sequence[tuple], streams):
    """The producer warpgroup of a kernel: gives up registers (keeps `registers` per thread), streams the
    payloads of each of this CTA's work items (`work`: WorkItems) through the rings, then drains them.

    rings: the (ready, free) barrier arrays of each payload group of a ring stage. streams(item) ->
    (copies, counts) for work item (head, pair, batch): per group its `Group.copies`, and per list
    the steps it takes. The rings carry on from one item to the next (`produce`'s done)."""
    ops.set_registers(registers, "decrease")

    def stream(i, item, done):
        copies, counts = streams(item)
        groups = [Group(c, ready, free) for c, (ready, free) in zip(copies, rings, strict=True)]
        return tuple(produce(plgpu, groups, counts, stages, done))

    done = work.loop(stream, (0,) * lists)
    drain(plgpu, [Group(None, ready, free) for ready, free in rings], done, stages)


def transposed_producer(
    plgpu, ops, work, *, registers, rings, tiles_ref, starts_ref, block_of, per_tile, q_tile, lists, stages, groups
):
    """The producer warpgroup of a dK/dV kernel (`producer` over the transposed index): list j of work item
    (head, pair, batch) walks the query tiles that selected its row block blk = block_of(item, j), i.e.
    tiles_ref[b, h, starts_ref[b, h, blk] : starts_ref[b, h, blk + 1]], in per_tile = q_tile // 64 steps of 64
    query rows. groups: per ring group, the (source ref, ring) pairs copied for a step's rows, in order: a
    [B, S, H, D] source (Q, dO) by rows, a [B, H, S] one (lse, delta) along its last axis; rings: each group's
    (ready, free) barriers. The ring slot's index is computed once per group (the 64-row kernel's two-copy form
    computed it per copy: its lowering differs only there)."""

    def copies(item, firsts):
        hi, _, bi = item

        def source(list_id, step):
            entry, offset = (step, 0) if per_tile == 1 else (lax.div(step, per_tile), lax.rem(step, per_tile) * ROWS)
            tile = tiles_ref[bi, hi, firsts[list_id] + entry]
            return pl.ds(tile * q_tile + offset, ROWS)

        def group_copies(pairs):
            def copy(list_id, step, slot, barrier):
                src, at = source(list_id, step), list_id * stages + slot
                for ref, ring in pairs:
                    view = ref.at[bi, src, hi] if len(ref.shape) == 4 else ref.at[bi, hi, src]
                    plgpu.copy_gmem_to_smem(view, ring.at[at], barrier)

            return copy

        return [group_copies(pairs) for pairs in groups]

    def streams(item):
        hi, _, bi = item
        blocks = [block_of(item, j) for j in range(lists)]
        firsts = [starts_ref[bi, hi, blk] for blk in blocks]
        counts = [(starts_ref[bi, hi, blk + 1] - f) * per_tile for blk, f in zip(blocks, firsts)]
        return copies(item, firsts), counts

    producer(plgpu, ops, work, lists=lists, stages=stages, registers=registers, rings=rings, streams=streams)


@dataclasses.dataclass(frozen=True)
class WorkItems:
    """The work items (head, pair of 64-row tiles, batch) of a kernel, the order the GPU starts them in,
    and which CTA runs which.

    The order: item w = 0, 1, ... is the w-th of the (heads, batch, pairs) array in row-major order, i.e.
    tiles fastest, so that the CTAs resident at one time (132 on an H200) share one head and one batch
    element: their randomly selected blocks come from that head's K and V (32 MB at 64k tokens, D 128),
    which the 50 MB L2 holds, and each block fetched from HBM serves every resident CTA that selected it.
    heads_fastest: (pairs, batch, heads) instead; the resident CTAs then span all heads and read all of
    K and V, which does not fit (L2 hit rate 11% against 83% measured; docs/kernels/mgpu_notes.md, "Which
    CTAs run together").

    programs == 0: one CTA per item on a grid of those three axes. Pallas' Mosaic GPU lowering gives the
    grid's last axis to CUDA's x, which the hardware starts first: the row-major order above. programs ==
    N > 0: a persistent grid of N CTAs, so that a CTA's producer streams the next item's first blocks while
    its consumers finish the current one (a CTA's start and end are not repeated per item). Round r is
    items rN .. rN + N - 1, one per CTA, so the N items in flight are still N consecutive ones; CTA c takes
    place c of even rounds and place N - 1 - c of odd ones (serpentine), so that when the items come
    longest first (dK/dV) no CTA takes the longest of every round."""

    heads: int
    pairs: int
    batch: int
    programs: int = 0
    heads_fastest: bool = False

    @property
    def total(self) -> int:
        return self.heads * self.pairs * self.batch

    @property
    def axes(self) -> tuple[str, str, str]:
        """The axes of the item array, slowest first."""
        return ("pairs", "batch", "heads") if self.heads_fastest else ("heads", "batch", "pairs")

    def size(self, axis: str) -> int:
        return {"heads": self.heads, "pairs": self.pairs, "batch": self.batch}[axis]

    def unravel(self, w):
        """(head, pair, batch) of item w (an int or an int32 scalar)."""
        div, rem = (operator.floordiv, operator.mod) if isinstance(w, int) else (lax.div, lax.rem)
        index = {}
        for axis in reversed(self.axes):
            index[axis], w = rem(w, self.size(axis)), div(w, self.size(axis))
        return index["heads"], index["pairs"], index["batch"]

    def launch(self) -> dict:
        """kernel_call's grid arguments."""
        if self.programs:
            return {"grid": (min(self.programs, self.total),), "grid_names": ("programs",)}
        return {"grid": tuple(self.size(a) for a in self.axes), "grid_names": self.axes}

    def loop(self, body, carry):
        """carry = body(i, (head, pair, batch), carry) over this CTA's items i = 0, 1, ...; returns carry
        (a pytree of int scalars)."""
        if not self.programs:  # carry stays as given (Python ints: constants, not values, in the kernel)
            item = (lax.axis_index("heads"), lax.axis_index("pairs"), lax.axis_index("batch"))
            return body(0, item, carry)
        carry = jax.tree.map(jnp.int32, carry)
        cta = lax.axis_index("programs")

        def step(i, carry):
            return body(i, self.unravel(self.item_of(cta, i)), carry)

        return lax.fori_loop(0, self.count_of(cta), step, carry)

    @property
    def ctas(self) -> int:
        return min(self.programs, self.total)

    def place(self, cta, r):
        """The place in round r (0 .. ctas - 1) that persistent CTA `cta` takes (serpentine)."""
        flip = self.ctas - 1 - cta
        if isinstance(cta, int) and isinstance(r, int):
            return cta if r % 2 == 0 else flip
        return jnp.where(lax.rem(r, 2) == 0, cta, flip)

    def item_of(self, cta, i):
        """The item (a number in the order above) that persistent CTA `cta` runs i-th."""
        return i * self.ctas + self.place(cta, i)

    def count_of(self, cta):
        """How many items persistent CTA `cta` runs: one per full round, and one of the last round if its
        place there is among that round's items."""
        full, last = divmod(self.total, self.ctas)
        if not last:
            return full
        if isinstance(cta, int):
            return full + int(self.place(cta, full) < last)
        return jnp.where(self.place(cta, full) < last, full + 1, full)


@dataclasses.dataclass(frozen=True)
class KVWalk:
    """How the forward and dQ walk a query tile's list of selected KV blocks: in 64-row slices of the
    blocks (kv_block // 64 per block), `step_rows // 64` slices per loop step. A last, partial step
    repeats the list's last slice: its copy keeps the ring stage finite (a masked column of P still
    multiplies its V row), and the consumer masks it (valid_keys, slice_limit)."""

    kv_block: int
    step_rows: int

    @property
    def per_block(self) -> int:
        return self.kv_block // ROWS

    @property
    def sub(self) -> int:
        return self.step_rows // ROWS

    def steps(self, slices):
        """Steps that cover `slices` slices (the last may be partial)."""
        return slices if self.sub == 1 else lax.div(slices + (self.sub - 1), self.sub)

    def full_steps(self, slices):
        return slices if self.sub == 1 else lax.div(slices, self.sub)

    def split(self, sl):
        """(entry of the list, row offset inside its block) of slice `sl`."""
        if self.per_block == 1:
            return sl, 0
        return lax.div(sl, self.per_block), lax.rem(sl, self.per_block) * ROWS

    def list_of(self, count_ref, item, list_id, lists: int):
        """(query tile, slice count, step count) of list `list_id` of work item (head, pair, batch): the
        pair's one 128-row tile (lists == 1), or its 64-row tile list_id (lists == 2)."""
        hi, ci, bi = item
        tile = ci * 2 + list_id if lists == 2 else ci
        slices = count_ref[bi, hi, tile] * self.per_block
        return tile, slices, self.steps(slices)

    def lists(self, count_ref, item, lists: int):
        """(query tile of each list, its slice count, its step count) of work item (head, pair, batch)."""
        tiles, slices, steps = zip(*(self.list_of(count_ref, item, j, lists) for j in range(lists)), strict=True)
        return list(tiles), list(slices), list(steps)

    def valid_keys(self, step, slices, valid_of_entry=None) -> tuple:
        """Valid keys of each slice of `step`, in [0, 64], 0 past the list's end. valid_of_entry(entry):
        the valid keys of the list's entry-th block (kv_valid); None: every key is valid."""
        out = []
        for i in range(self.sub):
            sl = step * self.sub + i
            if valid_of_entry is None:
                keys = ROWS
            else:
                entry, offset = self.split(jnp.clip(sl, 0, jnp.maximum(slices - 1, 0)))
                keys = jnp.clip(valid_of_entry(entry) - offset, 0, ROWS)
            out.append(jnp.where(sl < slices, keys, 0))
        return tuple(out)

    def loop(self, slices, masked, step_fn, carry, valid_keys):
        """Runs step_fn(step, (*carry, n_valid), mask) over the steps that cover `slices`; n_valid is
        valid_keys(step) of the first masked step, which step_fn advances. With kv_valid every step is
        masked; without it only a last, partial step (two slices per step, an odd slice count)."""
        n = self.steps(slices)
        full = n if masked else self.full_steps(slices)
        carry = (*carry, valid_keys(0 if masked else full))
        carry = lax.fori_loop(0, full, functools.partial(step_fn, mask=masked), carry)
        if not masked and self.sub > 1:
            carry = lax.fori_loop(full, n, functools.partial(step_fn, mask=True), carry)
        return carry[:-1]

    def streams(self, plgpu, index_ref, count_ref, payloads: Sequence[tuple], lists: int, stages: int):
        """`producer`'s streams of the forward and dQ: per work item, the K and V (payloads: (src_ref,
        dst_smem) each) of the blocks that the item's lists select, kv_index[b, h, tile, entry]."""

        def streams(item):
            hi, _, bi = item
            tiles, slices, steps = self.lists(count_ref, item, lists)
            block_of = lambda list_id, entry: index_ref[bi, hi, tiles[list_id], entry]
            copies = [self.copier(plgpu, src, dst, block_of, slices, stages, bi, hi) for src, dst in payloads]
            return copies, steps

        return streams

    def copier(self, plgpu, src_ref, dst_smem, block_of, slices, stages, bi, hi):
        """A producer Group's copies: step `step` of list `list_id` into its ring stage, one TMA copy per
        slice. block_of(list_id, entry): the KV block id; slices[list_id]: the list's slice count (>= 1)."""

        def copies(list_id, step, slot, barrier):
            for i in range(self.sub):
                sl = step if self.sub == 1 else jnp.minimum(step * self.sub + i, slices[list_id] - 1)
                entry, offset = self.split(sl)
                rows = pl.ds(block_of(list_id, entry) * self.kv_block + offset, ROWS)
                plgpu.copy_gmem_to_smem(
                    src_ref.at[bi, rows, hi], dst_smem.at[list_id * stages + slot, pl.ds(i * ROWS, ROWS)], barrier
                )

        return copies

    def keep(self, ops, shape, valid: Sequence):
        """Which columns of a step's [64, step_rows] tile hold valid keys (valid: valid_keys of the step)."""
        return slice_limit(ops, shape, valid)


def slice_limit(ops, shape, valid: Sequence):
    """Column c of a [64, 64 * len(valid)] tile is kept iff c < this: slice i's valid keys, each in
    [0, 64], counted from the slice's first column."""
    col = ops.iota(shape, 1)
    limit = valid[0]
    for i, v in enumerate(valid[1:], 1):
        limit = jnp.where(col >= i * ROWS, i * ROWS + v, limit)
    return col < limit


def load_query_rows(plgpu, ops, gmem, smem, at, ready, persistent: bool):
    """A backward consumer's resident rows of one work item: Q, dO (rows) and lse2, delta (one value per row) from
    gmem = (q, do, lse2, delta) refs at (batch, row slice, head) into smem = (q, do, lse2, delta) on one barrier,
    then lse2 and delta into registers, one value per row of a wgmma tile. persistent: a CTA walks several items,
    so the previous item's dQ store must first have read the Q buffer. Returns (lse2, delta)."""
    q_ref, do_ref, lse_ref, delta_ref = gmem
    bi, rows, hi = at
    if persistent:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    sources = (q_ref.at[bi, rows, hi], do_ref.at[bi, rows, hi], lse_ref.at[bi, hi, rows], delta_ref.at[bi, hi, rows])
    for src, dst in zip(sources, smem, strict=True):
        plgpu.copy_gmem_to_smem(src, dst, ready)
    plgpu.barrier_wait(ready)
    return ops.load(smem[2], ops.row_layout()), ops.load(smem[3], ops.row_layout())


def gpu_interpreter():
    """The `interpret` argument that runs a Mosaic GPU kernel in jax's GPU interpreter (on a CPU)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


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
    fwd_stages, dq_stages, dkdv_stages: SMEM ring depth per list of each kernel. The dQ consumer waits for
    its next K slice while the current one is still in use, so dQ needs two or more; dK/dV keeps the same
    floor (one stage would leave its producer idle while a step computes).
    fwd_step_rows, dq_step_rows: KV rows per loop step of the forward and dQ kernels, 64 or 128 (two
    64-row slices of the work list per step: half the steps, so half the per-step softmax rescaling,
    barrier waits and wgmma issues, for a ring stage twice as large).
    dkdv_longest_first: dK/dV programs take the row blocks in descending order of their lists' lengths
        (sparse_index.longest_first), so a program's two lists (kv_block 64) are almost equally long
        and the longest programs start first; False: ascending row blocks.
    fwd_programs, dq_programs, dkdv_programs: 0 for one CTA per work item; N > 0 for a persistent kernel of
    N CTAs (WorkItems).
    heads_fastest: start the work items heads fastest instead of tiles fastest (WorkItems; slower).
    fused_backward: with 16- or 32-row KV blocks and 128-row query tiles, one backward kernel by query tile
    (sparse_attention_mgpu_fused: dK/dV partials added by TMA reductions) instead of dQ and the fine dK/dV; it
    walks 64 KV rows a step in dq_stages stages and runs dq_programs CTAs.
    producer_registers: registers per thread the producer warpgroup keeps (setmaxnreg, a multiple of 8 in
    24..168: at launch each of the 384 threads holds 168, and setmaxnreg may only lower the producer's and
    raise the consumers'); the two consumers share the rest of the SM's 64K (consumer_registers).
    The launch fields (the stages to heads_fastest) have their defaults in pallas_kernels.tuning
    (MGPU_DEFAULTS, mgpu_defaults); sparse_attention_mgpu.default_config builds the config of a call.
    """

    q_tile: int
    kv_block: int
    head_dim: int
    sm_scale: float
    fwd_stages: int
    dq_stages: int
    dkdv_stages: int
    producer_registers: int
    fwd_step_rows: int
    dq_step_rows: int
    dkdv_longest_first: bool
    fwd_programs: int
    dq_programs: int
    dkdv_programs: int
    heads_fastest: bool
    fused_backward: bool = False
    masked: bool = False
    interpret: bool = False

    def __post_init__(self):
        if self.fwd_stages < 1 or self.dq_stages < 2 or self.dkdv_stages < 2:
            raise ValueError(
                f"fwd_stages={self.fwd_stages} must be >= 1, dq_stages={self.dq_stages} and "
                f"dkdv_stages={self.dkdv_stages} >= 2"
            )
        for name in ("fwd_step_rows", "dq_step_rows"):
            if getattr(self, name) not in (ROWS, 2 * ROWS):
                raise ValueError(f"{name}={getattr(self, name)} must be {ROWS} or {2 * ROWS}")
        for name in ("fwd_programs", "dq_programs", "dkdv_programs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0: one CTA per work item)")
        if self.producer_registers % 8 or not 24 <= self.producer_registers <= LAUNCH_REGISTERS:
            raise ValueError(
                f"producer_registers={self.producer_registers} must be a multiple of 8 in 24..{LAUNCH_REGISTERS}"
            )

    @property
    def consumer_registers(self) -> int:
        """Registers per consumer thread: what the producer leaves of 64K per SM, rounded down to 8."""
        per_thread = (REGISTERS_PER_SM - WARPGROUP * self.producer_registers) // (CONSUMERS * WARPGROUP)
        return per_thread // 8 * 8

    def smem_bytes(self, kernel: str, itemsize: int = 2) -> int:
        """SMEM that `kernel` ("fwd", "dq", "dkdv" or "fused") allocates: resident tiles, rings, row statistics."""
        tile = ROWS * self.head_dim * itemsize
        rows_f32 = ROWS * 4
        if kernel == "fwd":  # Q per consumer; K, V per ring stage; lse out
            step = self.fwd_step_rows * self.head_dim * itemsize
            return CONSUMERS * (tile + rows_f32) + 2 * self.fwd_lists * self.fwd_stages * step
        if kernel == "dq":  # Q, dO, lse, delta per consumer; K, V per ring stage
            step = self.dq_step_rows * self.head_dim * itemsize
            return CONSUMERS * (2 * tile + 2 * rows_f32) + 2 * self.fwd_lists * self.dq_stages * step
        if kernel == "dkdv" and self.kv_block < ROWS:  # sparse_attention_mgpu_fine: per consumer its block's K, V,
            # P^T and dS^T, the dK, dV out tiles; per ring stage Q, dO, lse, delta (two lists)
            g = self.kv_block
            per_consumer = 2 * g * self.head_dim * itemsize + 2 * ROWS * g * itemsize + 2 * self.head_dim * g * itemsize
            return CONSUMERS * per_consumer + 2 * self.dkdv_stages * (2 * tile + 2 * rows_f32)
        if kernel == "dkdv":  # K, V per consumer; Q, dO, lse, delta per ring stage
            return 2 * CONSUMERS * tile + self.dkdv_lists * self.dkdv_stages * (2 * tile + 2 * rows_f32)
        if kernel == "fused":  # Q, dO, lse, delta per consumer; K, V per 64-row ring stage; shared P, dS; fp32
            # dK or dV staging per consumer
            return (
                CONSUMERS * (2 * tile + 2 * rows_f32)
                + 2 * self.dq_stages * tile
                + 2 * CONSUMERS * ROWS * ROWS * itemsize
                + CONSUMERS * ROWS * self.head_dim * 4
            )
        raise ValueError(f"unknown kernel {kernel!r}")

    def work(self, kernel: str, heads: int, pairs: int, batch: int) -> WorkItems:
        """The work items of `kernel` ("fwd", "dq" or "dkdv"), tiles fastest unless heads_fastest (WorkItems
        says why)."""
        return WorkItems(heads, pairs, batch, getattr(self, f"{kernel}_programs"), self.heads_fastest)

    @property
    def fuses_backward(self) -> bool:
        """Whether the backward runs as one kernel (fused_backward, where its geometry allows)."""
        return self.fused_backward and self.kv_block < ROWS and self.q_tile == 2 * ROWS

    @property
    def fwd_lists(self) -> int:
        return 1 if self.q_tile == 2 * ROWS else 2

    @property
    def dkdv_lists(self) -> int:
        return 1 if self.kv_block % (2 * ROWS) == 0 else 2

    @property
    def dkdv_rows(self) -> int:
        """Key rows that one dK/dV work list covers (one block below 64 rows: sparse_attention_mgpu_fine)."""
        if self.kv_block < ROWS:
            return self.kv_block
        return 2 * ROWS if self.dkdv_lists == 1 else ROWS

    def interpret_params(self):
        return gpu_interpreter() if self.interpret else None


@dataclasses.dataclass(frozen=True)
class FineWalk(KVWalk):
    """The forward's and dQ's walk over KV blocks of fewer than 64 rows (kv_block 16 or 32): a slice is one
    block (one list entry), a step `step_rows // kv_block` of them, each brought by its own TMA copy into the
    step's ring stage at a row offset that is a multiple of kv_block (whole 8-row swizzle tiles). A partial last
    step repeats the list's last entry (finite data) and masks it; with kv_valid each block masks its own rows."""

    @property
    def per_block(self) -> int:
        return 1

    @property
    def sub(self) -> int:
        return self.step_rows // self.kv_block

    def split(self, sl):
        return sl, 0

    def valid_keys(self, step, slices, valid_of_entry=None) -> tuple:
        """Valid keys of each block of `step`, in [0, kv_block], 0 past the list's end."""
        out = []
        for i in range(self.sub):
            sl = step * self.sub + i
            if valid_of_entry is None:
                keys = self.kv_block
            else:
                keys = jnp.clip(valid_of_entry(jnp.clip(sl, 0, jnp.maximum(slices - 1, 0))), 0, self.kv_block)
            out.append(jnp.where(sl < slices, keys, 0))
        return tuple(out)

    def keep(self, ops, shape, valid: Sequence):
        """Column c is kept iff c mod kv_block < the valid keys of its block (valid[c // kv_block])."""
        col = ops.iota(shape, 1)
        limit = valid[0]
        for i, v in enumerate(valid[1:], 1):
            limit = jnp.where(col >= i * self.kv_block, v, limit)
        return jnp.bitwise_and(col, self.kv_block - 1) < limit

    def copier(self, plgpu, src_ref, dst_smem, block_of, slices, stages, bi, hi):
        """A producer Group's copies: block i of step `step` of list `list_id` into rows [i g, (i + 1) g) of its
        ring stage, one TMA copy per block (g = kv_block)."""
        g = self.kv_block

        def copies(list_id, step, slot, barrier):
            # All of the step's block ids first: independent loads in flight together (one L2 read of the
            # step's contiguous entries), not one load before each copy's issue.
            ids = [block_of(list_id, jnp.minimum(step * self.sub + i, slices[list_id] - 1)) for i in range(self.sub)]
            for i, block in enumerate(ids):
                plgpu.copy_gmem_to_smem(
                    src_ref.at[bi, pl.ds(block * g, g), hi],
                    dst_smem.at[list_id * stages + slot, pl.ds(i * g, g)],
                    barrier,
                )

        return copies


FINE_BLOCKS = (16, 32)  # KV blocks below 64 rows that the Mosaic GPU kernels take


def walk_for(kv_block: int, step_rows: int) -> KVWalk:
    """The forward's and dQ's walk: FineWalk for 16- and 32-row blocks, else KVWalk (multiples of 64)."""
    return FineWalk(kv_block, step_rows) if kv_block < ROWS else KVWalk(kv_block, step_rows)
