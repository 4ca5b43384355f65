"""The window baseline as an attention plan (WA-M: window=1/3, WA-L: 2/3; attention=window).

Each query tile attends to a static 3D box of KV tiles around it, `window` of the tiles along each
dimension (`dsv_jax.dsv.selection.window_selection`). Nothing is learned: the lists are the same for
every head and every step. A sparse variant in one file: the plan class and its registration (imported
by `dsv_jax.dsv`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dsv_jax.dsv.backend import window_kv
from dsv_jax.dsv.plan import AttentionPlan, ContextLoad, Selection, register_plan
from dsv_jax.dsv.selection import window_selection


@register_plan
@dataclasses.dataclass(frozen=True)
class WindowPlan(AttentionPlan):
    mode: str = "window"
    window: float = 1 / 3  # window / grid per dimension

    def kv_block_for(self, layout) -> int:
        return layout.tile_size  # the lists are of whole tiles

    def kept_blocks(self, layout) -> int:
        """KV tiles per query tile on this layout (a padded grid counts its partial tiles)."""
        tiles = tuple(-(-g // t) for g, t in zip(layout.grid, layout.tile))
        return int(window_selection(tiles, float(self.window)).shape[1])

    def selection(self, q, x, layout, geometry, *, predictor=None, inputs=None, logits=None, positions=None):
        if geometry is None:
            return Selection()
        b, s, h = q.shape[:3]
        return Selection(window_kv(b, h, layout.grid, layout.tile, self.window, n_tiles=s // geometry.q_tile))

    def kept_fraction(self, layout, keep_heads=None) -> float:
        if not self.runs_sparse(layout):
            return 1.0
        return self.kept_blocks(layout) / (layout.seq_len // self.kv_block_for(layout))

    def cp_workload(self, layout, heads: int, keep_heads=None) -> ContextLoad:
        n_blocks = layout.seq_len // self.kv_block_for(layout)
        kept = self.kept_blocks(layout)
        keep = np.clip(np.full(heads, kept / n_blocks), 1.0 / n_blocks, 1.0)
        return ContextLoad(self.q_tile_for(layout), self.kv_block_for(layout), keep, kept)

    def describe(self) -> str:
        return f"window {self.window:.3g}" if self.sparse else "dense"

    def placement_tag(self) -> str:
        # the key format of placements checkpointed before plans had classes (its middle slot: DSV's keep)
        return f"window:0:{self.window:g}"

    @classmethod
    def from_config(cls, cfg=None):
        if cfg is None:
            return cls(sparse=True)
        return cls(sparse=True, window=cfg.dsv.window, backend=cfg.dsv.dense_backend)
