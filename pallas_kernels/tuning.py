"""Block shapes and launch parameters of every kernel, each path's defaults and their per-device choice.

Sparse attention and selection on the Triton lowering: one small dataclass per kernel, one entry per GPU
generation (`for_device()`). The block that a query tile or a KV block covers is fixed by the selection
(q_tile, kv_block); what is tunable is how many KV rows one loop step handles, how many key rows a dK/dV
program owns, and the Triton launch parameters.

Sparse attention on Hopper (Pallas Mosaic GPU): the launch fields a caller may set (MGPU_TUNABLE) and
their defaults on a device (`mgpu_defaults`).

Token-level sparse attention (real Triton, through jax-triton): `TokenAttentionTuning`.

AdaLN (Triton lowering): `BlockSizes`, derived from the model width.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class SparseAttentionTuning:
    """sparse_attention (Pallas Triton lowering).

    rows_per_step: KV rows per inner-loop step of the forward and dQ kernels (a power of two); a step
      covers rows_per_step // kv_block selected blocks (gathered) or part of one block (contiguous).
    dkdv_rows: key rows per dK/dV program when kv_block < 32 (token level): selections are folded into
      these row blocks with a bit mask per (query tile, row block); halved where it does not divide S.
    """

    rows_per_step: int = 64
    dkdv_rows: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 3
    dq_warps: int = 4
    dq_stages: int = 2
    dkdv_warps: int = 4
    dkdv_stages: int = 2

    def __post_init__(self):
        for name in ("rows_per_step", "dkdv_rows"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"SparseAttentionTuning.{name}={val} must be a power of two >= 16")


@dataclasses.dataclass(frozen=True)
class TokenAttentionTuning:
    """Token-level sparse attention (real Triton through jax-triton: sparse_attention_token).

    fwd_block_n / bwd_block_n: gathered key rows per loop step of the forward / backward (a power of two
      >= 16); warps and stages: Triton's launch parameters (stages > 1 pipelines the row gathers with cp.async).
    """

    fwd_block_n: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 3
    bwd_block_n: int = 64
    bwd_warps: int = 4
    bwd_stages: int = 2

    def __post_init__(self):
        for name in ("fwd_block_n", "bwd_block_n"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"TokenAttentionTuning.{name}={val} must be a power of two >= 16")


def token_attention_tuning(q_tile: int, head_dim: int) -> TokenAttentionTuning:
    """The token kernels' launch for a geometry: the warps that keep their registers from spilling on sm90
    (ptxas for triton 3.6: the backward at D = 128 or 64-query groups needs 8 warps, 4 spill 64-368 bytes;
    the forward at 128-query groups too). Not yet timed against the alternatives (4 warps with 32-key steps)."""
    return TokenAttentionTuning(
        fwd_warps=8 if q_tile >= 128 else 4,
        bwd_warps=8 if head_dim >= 128 or q_tile >= 64 else 4,
    )


TOPK_PRECISIONS = ("tf32", "tf32x3", "bf16x3", "ieee")


@dataclasses.dataclass(frozen=True)
class TopkTuning:
    """lowrank_topk (Pallas Triton lowering).

    tiles_per_program: query tiles whose selections one program computes (they share the key stream).
    keys_per_step: scores per tile per inner-loop step (at most 4096).
    radix_bits: a counting pass narrows the bracket of the k-th largest score 2 ** radix_bits ways (as
      many thresholds, and 2 ** radix_bits / 4 int32 counter words per key lane: 4 is the tuned value; 8 needs
      64 words, 512 registers a thread at 4 warps, and would spill).
    sample: scores per query tile, sorted in XLA, whose order statistics bound the span the first pass splits
      (0: none, every pass splits the bracket); used where a block's score is one dot product (token level, or
      block_reduce "mean") and a tile has at least 4x as many keys.
    precision: how the kernel's score dots (fp32 proxy . fp32 key rows) run on the GPU: "tf32" (one TF32
      tensor-core product, ~10 mantissa bits: near-ties at the k-th score may swap against an fp32
      top-k), "tf32x3" (three TF32 products, ~fp32), "bf16x3" (three bf16 products) or "ieee" (fp32 FMA).
      Interpret mode computes in fp32 whatever the choice.
    """

    tiles_per_program: int = 16
    keys_per_step: int = 64
    radix_bits: int = 4
    warps: int = 4
    stages: int = 2
    sample: int = 2048
    precision: str = "tf32"

    def __post_init__(self):
        for name in ("tiles_per_program", "keys_per_step"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"TopkTuning.{name}={val} must be a power of two >= 16")
        if self.keys_per_step > 4096:  # the compaction counts a step's keys in 16-bit halves of an int32
            raise ValueError(f"TopkTuning.keys_per_step={self.keys_per_step} must be at most 4096")
        if self.radix_bits not in (1, 2, 4, 8):
            raise ValueError(f"TopkTuning.radix_bits={self.radix_bits} must divide 32 (1, 2, 4 or 8)")
        if self.sample < 0:
            raise ValueError(f"TopkTuning.sample={self.sample} must be >= 0 (0: no sampled first pass)")
        if self.precision not in TOPK_PRECISIONS:
            raise ValueError(f"TopkTuning.precision={self.precision!r} is not one of {TOPK_PRECISIONS}")


# Hopper (H100/H200): 64-row query tiles leave registers for 64-row KV steps at D=128 with 4 warps;
# deeper pipelining pays in the forward, where each step's loads are independent of the previous step.
# Selection: 4 warps, 16 tiles a program, 64 keys a step. With the bucket counting at token level (64k-128k, one
# H200), 8 warps measured 21-27% slower, 32 tiles a program 9-10%, 32 keys a step 7%; 128 keys a step 2-3% faster
# in one run, 0-3% in another: not adopted (experiments/results/archive/2026-12-06/topk_bucket_ab_h200.json,
# bench_topk_token.json).
_HOPPER = (
    SparseAttentionTuning(rows_per_step=64, dkdv_rows=64, fwd_warps=4, fwd_stages=3),
    TopkTuning(tiles_per_program=16, keys_per_step=64, radix_bits=4, warps=4),
)
_AMPERE = (
    SparseAttentionTuning(rows_per_step=64, dkdv_rows=64, fwd_warps=4, fwd_stages=2),
    TopkTuning(tiles_per_program=16, keys_per_step=64, radix_bits=4, warps=8),
)
_DEFAULT = (SparseAttentionTuning(), TopkTuning())


def generation(device=None) -> str:
    kind = (device or jax.devices()[0]).device_kind.lower()
    if any(name in kind for name in ("h100", "h200", "h800", "gh200")):
        return "hopper"
    if any(name in kind for name in ("a100", "a800", "a10", "a40", "a6000", "l40", "l4", "4090", "3090")):
        return "ampere"
    return "default"


def for_device(device=None) -> tuple[SparseAttentionTuning, TopkTuning]:
    return {"hopper": _HOPPER, "ampere": _AMPERE}.get(generation(device), _DEFAULT)


# ----------------------------------------------------------------------------------------------------
# Sparse attention on Hopper (Pallas Mosaic GPU): the launch fields of mgpu_common.AttentionConfig that a
# caller may set (sparse_attention_mgpu(..., tuning={key: value}); their meanings are documented there).

MGPU_DEFAULTS = {
    "fwd_stages": 3,  # the most; sparse_attention_mgpu.default_config lowers it to what SMEM holds
    "dq_stages": 2,
    "dkdv_stages": 2,
    "fwd_step_rows": 64,
    "dq_step_rows": 64,
    "producer_registers": 40,
    "dkdv_longest_first": True,
    "fwd_programs": 0,
    "dq_programs": 0,
    "dkdv_programs": 0,
    "heads_fastest": False,
    # one backward kernel at 16/32-row blocks (sparse_attention_mgpu_fused): mgpu_defaults turns it on
    # where it measured faster (docs/kernels/mgpu_notes.md, "The fused backward")
    "fused_backward": False,
}
MGPU_TUNABLE = frozenset(MGPU_DEFAULTS)
H100_SMS = 132  # SXM H100 and H200


def multiprocessors(device=None) -> int:
    """SMs of `device` (default: the first): what jax reports as its core_count, else an H100/H200's 132."""
    device = device or jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return count if isinstance(count, int) and count > 0 else H100_SMS


def mgpu_defaults(q_tile: int, kv_block: int, device=None) -> dict:
    """The launch fields of one call on `device` (default: the first) before a tuning's overrides.

    With 128-row query tiles (one list per CTA) the forward and dQ step over 128 KV rows: the forward
    measured 13% faster, dQ 0-1.5% (H200, S = 64k, docs/kernels/mgpu_notes.md, "Two KV blocks per step").
    The forward is persistent, one CTA per SM: 2.5-4% faster than one CTA per work item at 32k and 64k
    tokens, where the persistent dQ measured the same and the persistent dK/dV 6-15% slower (register
    spills), so those two stay one CTA per item (docs/kernels/mgpu_notes.md, "Which CTAs run together")."""
    defaults = {**MGPU_DEFAULTS, "fwd_programs": multiprocessors(device)}
    if q_tile == 128:
        defaults.update(fwd_step_rows=128, dq_step_rows=128)
    # With the fused backward, fwd + bwd measured 1.46x (90%) and 1.05x (95%) as fast as with dQ + fine dK/dV
    # at 16-row blocks, and 0.93x / 0.78x at 32-row blocks (one H100, S = 64k,
    # experiments/results/archive/2026-12-07/bench_fused_ab_kv{16,32}_h100.json).
    defaults["fused_backward"] = q_tile == 128 and kv_block == 16
    return defaults


# ----------------------------------------------------------------------------------------------------
# AdaLN (Triton lowering).


def column_chunks(c: int, min_width: int = 1, max_chunks: int = 16, max_width: int = 2048) -> tuple[int, int]:
    """(width, count): the AdaLN kernels' feature axis of c columns as `count` chunks of `width` (a power of
    two, as Triton needs). Model widths split exactly (1152 = 9 x 128, 3072 = 3 x 1024, 5120 = 5 x 1024,
    6144 = 3 x 2048), so no lane is wasted on padding; a width without a large power-of-two factor (or
    whose chunks would be narrower than min_width) becomes one padded, masked chunk instead."""
    width = min(c & -c, max_width)
    if c // width > max_chunks or width < min_width:
        width = 1 << (c - 1).bit_length()  # the next power of two
    return width, -(-c // width)


def _pow2_floor(v: int) -> int:
    return 1 << (int(v).bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles and warps of the AdaLN kernels. The feature axis is never split: a row's statistics need
    all of it, and the largest model width (6144 fp32 values a row) fits in one program's registers.

    rows / warps:        forward, rows per program.
    bwd_rows / bwd_warps: backward, rows per step of a program's walk down its sequence chunk.
    bwd_programs:        backward, about how many programs share B x N (a few per SM of an H200, so
                         all are resident at once and the partial sums stay small).
    min_chunk:           column chunks narrower than this become one padded, masked chunk (wider
                         vector loads, idle lanes) instead; see column_chunks.
    All row counts are powers of two (Triton's tensors are).
    """

    rows: int
    warps: int
    bwd_rows: int
    bwd_warps: int
    bwd_programs: int = 528
    min_chunk: int = 1

    def __post_init__(self):
        for name in ("rows", "warps", "bwd_rows", "bwd_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"BlockSizes.{name}={v} must be a power of two")
        if self.bwd_programs < 1:
            raise ValueError(f"BlockSizes.bwd_programs={self.bwd_programs} must be >= 1")

    @classmethod
    def default(cls, c: int, min_chunk: int = 1) -> BlockSizes:
        """About 8k (forward) / 4k (backward) elements per tile, and warps so that each thread holds
        8-32 values of each live tensor: enough bytes in flight without spilling registers (the gated
        backward keeps three fp32 accumulators and about six tile-sized values live)."""
        width, count = column_chunks(c, min_chunk)
        width *= count  # the padded feature axis
        rows = _pow2_floor(min(16, max(1, 8192 // width)))
        bwd_rows = _pow2_floor(min(16, max(1, 4096 // width)))
        warps = _pow2_floor(min(16, max(1, rows * width // 512)))
        bwd_warps = _pow2_floor(min(16, max(1, bwd_rows * width // 256)))
        return cls(rows=rows, warps=warps, bwd_rows=bwd_rows, bwd_warps=bwd_warps, min_chunk=min_chunk)
