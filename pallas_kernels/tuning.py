"""Block shapes and launch parameters of the DSV kernels, one small dataclass per kernel and GPU generation.

The block that a query tile or a KV block covers is fixed by the selection (q_tile, kv_block); what is
tunable is how many KV rows one loop step handles, how many key rows a dK/dV program owns, and the
Triton launch parameters. `for_device()` picks the entry of the current GPU generation.
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


TOPK_PRECISIONS = ("tf32", "tf32x3", "bf16x3", "ieee")


@dataclasses.dataclass(frozen=True)
class TopkTuning:
    """lowrank_topk (Pallas Triton lowering).

    tiles_per_program: query tiles whose selections one program computes (they share the key stream).
    keys_per_step: scores per tile per inner-loop step.
    radix_bits: a counting pass narrows the bracket of the k-th largest score 2 ** radix_bits ways (as
      many thresholds).
    sample: scores per query tile, sorted in XLA, whose order statistics are the first pass's thresholds
      (0: none, every pass splits evenly); used where a block's score is one dot product (token level, or
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
        if self.radix_bits not in (1, 2, 4, 8):
            raise ValueError(f"TopkTuning.radix_bits={self.radix_bits} must divide 32 (1, 2, 4 or 8)")
        if self.sample < 0:
            raise ValueError(f"TopkTuning.sample={self.sample} must be >= 0 (0: no sampled first pass)")
        if self.precision not in TOPK_PRECISIONS:
            raise ValueError(f"TopkTuning.precision={self.precision!r} is not one of {TOPK_PRECISIONS}")


# Hopper (H100/H200): 64-row query tiles leave registers for 64-row KV steps at D=128 with 4 warps;
# deeper pipelining pays in the forward, where each step's loads are independent of the previous step.
# Selection: 4 warps, though the [tiles, keys, 2**radix_bits] comparison block of a counting pass is then 128
# elements per thread: 8 warps measured 1.5-1.8x slower at token level and with 64-token blocks, 32k-128k keys
# (experiments/results/bench_topk.json).
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
