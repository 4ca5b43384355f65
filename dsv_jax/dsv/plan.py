"""The static attention plan of one block: what its video self-attention does in one compiled step.

A plan is a small frozen dataclass (hashable: it is part of the compiled-step cache key and a static
argument under jit). Everything that may change from step to step without recompiling (per-head keep
ratios, the predictor's learning rate) travels separately as runtime arrays (`inputs`).

    mode="dense"   the dense backend `backend` (what a plain backend name means)
    mode="dsv"     DSV: predictor projections, top-k KV blocks per query tile, block-sparse attention
    mode="window"  the window baseline: a static 3D neighbourhood of KV tiles around each query tile

Sparse modes need an unpadded token layout (valid keys = the whole sequence) and a KV block that
divides it; otherwise the block falls back to the dense backend for that shape (documented in
README): padded tiles are not contiguous 3D tiles, and the sparse kernel has no length mask.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    mode: str = "dense"  # dense | dsv | window
    backend: str = "auto"  # dense backend (dense mode, text tokens, fallbacks)
    sparse: bool = False  # attend through the selection (dsv); window plans are always sparse
    keep: float = 0.0  # dsv: static keep ceiling, top_k = ceil(keep * KV blocks); 0: no selection
    kv_block: int = 0  # dsv: tokens per KV block; 0: the layout's tile (window plans always use tiles)
    window: float = 1 / 3  # window mode: window / grid per dimension
    predictor: bool = False  # dsv: compute the predictor loss (training)
    profile: bool = False  # collect sparsity / recall statistics this step
    analysis: bool = False  # with profile: also top-key mass and critical-KV distances (analysis script)
    # return the block's attention q, k (and, with a predictor, its q_lr, k_lr) in aux as capture/q, ...:
    # what an analysis measures outside the model (experiments/granularity.py); forward only
    capture: bool = False
    block_reduce: str = "mean"
    center_logits: bool = True  # dsv: the predictor loss compares mean-centred logit rows (dsv.center_logits)
    query_stride: int = 64
    max_queries: int = 256
    theta: float = 0.9
    percentile: float = 10.0

    def __post_init__(self):
        if self.mode not in ("dense", "dsv", "window"):
            raise ValueError(f"AttentionPlan.mode={self.mode!r} is not one of 'dense', 'dsv', 'window'")

    def top_k(self, n_blocks: int) -> int:
        """Static number of KV blocks selected per query tile for a sequence of `n_blocks` blocks."""
        return max(1, min(n_blocks, math.ceil(self.keep * n_blocks - 1e-9)))

    @property
    def selects(self) -> bool:
        """Whether this plan computes a DSV selection (to attend through it, or to measure its recall)."""
        return self.mode == "dsv" and self.keep > 0 and (self.sparse or self.profile)


def as_plan(plan: Any, *, window: float = 1 / 3) -> Any:
    """A backend name stays a name (dense); "dsv" and "window" become plans. "dsv" alone (no controller)
    is dense attention: the trainer's controller supplies the sparse plans."""
    if plan == "dsv":
        return AttentionPlan(mode="dsv")
    if plan == "window":
        return AttentionPlan(mode="window", sparse=True, window=window)
    return plan


def static_plans(cfg) -> Any:
    """The attention argument of a run without a controller: a backend name, or one window plan."""
    if cfg.attention == "window":
        return AttentionPlan(mode="window", sparse=True, window=cfg.dsv.window, backend=cfg.dsv.dense_backend)
    if cfg.attention == "dsv":
        return AttentionPlan(mode="dsv", backend=cfg.dsv.dense_backend)
    return cfg.attention
