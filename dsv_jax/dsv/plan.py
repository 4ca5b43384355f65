"""The static attention plan of one block: what its video self-attention does in one compiled step.

A plan is a frozen dataclass (hashable: it is part of the compiled-step cache key and a static argument
under jit), one class per mode, registered by its mode name:

    DensePlan   mode="dense"   the dense backend `backend` (profile=True: it also measures the sparsity)
    DSVPlan     mode="dsv"     DSV: predictor projections, top-k KV blocks per query tile, block-sparse attention
    WindowPlan  mode="window"  the window baseline: a static 3D neighbourhood of KV tiles (`dsv_jax.dsv.window`)

Everything that may change from step to step without recompiling (per-head keep ratios, the predictor's
learning rate) travels separately as runtime arrays (`inputs`).

A plan answers for itself what the rest of the system needs of it, so no code outside this package asks
for its mode:

    q_tile_for / kv_block_for(layout)        its query tile and KV block on a token layout
    geometry(layout, batch)                  both, with the padded layout's valid keys (None: runs dense)
    selection(...)                           the KV blocks each query tile attends to, and its aux losses
    kept_fraction(layout, keep_heads)        the share of the video keys it attends to (FLOPs and MFU)
    cp_workload(layout, heads, keep_heads)   the context-parallel planner's inputs (placement, bytes)
    describe() / placement_tag()             its name in an export's dsv.json and in CP placement keys

`AttentionPlan(mode=..., ...)` builds the registered class of that mode (how plans were built before
they had classes); `register_plan` adds a variant and refuses one that does not define its selection,
its FLOPs or its context-parallel costs (docs/architecture.md, "Adding a sparse variant").

Sparse plans run on padded token layouts too (the kernels mask each KV block's padding keys by count); a
KV block that does not divide the layout's tile falls back to dense attention for that shape (logged).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv_jax.attention.context import ContextBackend
from dsv_jax.attention.rope import rotary
from dsv_jax.dsv.predictor import predictor_loss
from dsv_jax.dsv.selection import select_kv

log = logging.getLogger("dsv_jax")

# mode name -> plan class (`register_plan`)
PLANS: dict[str, type] = {}

# What every registered plan class must define itself. Inheriting the base's would count a sparse
# variant as dense attention in MFU and place it as dense under context parallelism, silently.
REQUIRED = {
    "selection": "the KV blocks each query tile attends to (dsv_jax.model.attention)",
    "kept_fraction": "its FLOPs: the share of the video keys it attends to (dsv_jax.model.flops)",
    "cp_workload": "its context-parallel costs: per-head keep ratios and top-k for the planner "
    "(dsv_jax.parallel.policy)",
}


@dataclasses.dataclass(frozen=True)
class Geometry:
    """How a sparse plan cuts this layout: query tiles, KV blocks, and the valid keys of each block."""

    q_tile: int
    kv_block: int
    kv_valid: jax.Array | None  # int32 [B, S // kv_block] on padded layouts, else None

    def sparse_options(self) -> dict:
        opts = {"q_tile": self.q_tile, "kv_block": self.kv_block}
        return opts if self.kv_valid is None else {**opts, "kv_valid": self.kv_valid}


@dataclasses.dataclass
class Selection:
    """What a plan's selection step gives one block."""

    kv: tuple | None = None  # (kv_index [B, H, T, K], kv_count [B, H, T]) to attend through, or None
    aux: dict = dataclasses.field(default_factory=dict)  # e.g. the predictor loss
    lowrank: tuple | None = None  # (q_lr, k_lr): a predicted ranking whose recall the profiler measures
    block_reduce: str = "mean"  # how `lowrank` scores a KV block


@dataclasses.dataclass
class ContextLoad:
    """A sparse plan's inputs to the context-parallel planner (`dsv_jax.parallel.planner.Workload`)."""

    q_tile: int
    kv_block: int
    keep: np.ndarray  # float64 [H]: each head's share of the KV blocks, in [1 / blocks, 1]
    top_k: int  # static KV blocks per query tile


def _missing(plan, name: str) -> NotImplementedError:
    return NotImplementedError(f"attention plan class {type(plan).__name__} does not define {name}: {REQUIRED[name]}")


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """The base of every plan class, and its constructor by mode: `AttentionPlan(mode="dsv", keep=0.5)`
    is a `DSVPlan`. The fields here are what every mode has: the dense backend, whether the block
    attends sparsely, the KV block, and what a profile step samples."""

    mode: str = "dense"  # the registered name of the class (each class fixes its own)
    backend: Any = "auto"  # dense backend name (dense mode, text tokens, fallbacks) or a ContextBackend
    sparse: bool = False  # attend through the plan's selection (window plans are built with sparse=True)
    kv_block: int = 0  # tokens per KV block; 0: the layout's tile (window plans always use tiles)
    profile: bool = False  # collect sparsity / recall statistics this step
    analysis: bool = False  # with profile: also top-key mass and critical-KV distances (analysis script)
    # return the block's attention q, k (and, with a predictor, its q_lr, k_lr) in aux as capture/q, ...:
    # what an analysis measures outside the model (experiments/granularity.py); forward only
    capture: bool = False
    query_stride: int = 64
    max_queries: int = 256
    theta: float = 0.9
    percentile: float = 10.0

    def __new__(cls, *args, **kwargs):
        if cls is AttentionPlan:  # the constructor by mode
            cls = plan_class(kwargs.get("mode", args[0] if args else "dense"))
        return super().__new__(cls)

    def __post_init__(self):
        own = type(self).__dataclass_fields__["mode"].default
        if self.mode != own:
            raise ValueError(f"{type(self).__name__} is mode {own!r}, got mode={self.mode!r}")

    # -- geometry ------------------------------------------------------------------------------------
    def q_tile_for(self, layout) -> int:
        """Query rows that share one KV list: one 3D tile of the token layout."""
        return layout.tile_size

    def kv_block_for(self, layout) -> int:
        """Tokens per KV block: the plan's kv_block, or the layout's tile."""
        return self.kv_block or layout.tile_size

    def divides(self, layout) -> bool:
        """Whether the KV block divides the tile (else this shape runs dense)."""
        return layout.tile_size % self.kv_block_for(layout) == 0

    def runs_sparse(self, layout) -> bool:
        """Whether the block attends sparsely on this layout."""
        return self.sparse and self.divides(layout)

    def geometry(self, layout, batch: int) -> Geometry | None:
        """The sparse geometry on this layout, or None where the plan must run dense."""
        if layout is None:
            return None
        kv_block = self.kv_block_for(layout)
        if not self.divides(layout):
            log.warning(
                "%s: KV block %d does not divide the %d-token tile; dense attention for this shape",
                self.mode,
                kv_block,
                layout.tile_size,
            )
            return None
        kv_valid = None
        if layout.padded:
            counts = layout.kv_valid(kv_block)
            kv_valid = jnp.broadcast_to(jnp.asarray(counts), (batch, counts.shape[0]))
        return Geometry(self.q_tile_for(layout), kv_block, kv_valid)

    # -- what the block does -------------------------------------------------------------------------
    @property
    def plain_dense(self) -> bool:
        """Whether the block just runs its dense backend (nothing to select, train or profile)."""
        return False

    @property
    def needs_tiles(self) -> bool:
        """Whether the block's tokens must lie in 3D tiles: query tiles and KV blocks are what it selects,
        trains on or measures. A block that only attends densely keeps raster order (see `tiled`)."""
        return not self.plain_dense

    @property
    def selects(self) -> bool:
        """Whether this plan computes a learned (DSV) selection, to attend through or to measure its recall."""
        return False

    @property
    def needs_logits(self) -> bool:
        """Whether the step needs the true logits of sampled query rows (profiling, predictor training)."""
        return self.profile

    def selection(self, q, x, layout, geometry, *, predictor=None, inputs=None, logits=None, positions=None):
        """The block's Selection. q [B, S, H, D] (for its shape), x the block's input, geometry from
        `geometry` (None: no sparse attention on this shape), predictor the block's DSV predictor (or
        None), inputs the runtime arrays, logits / positions the true logits of the sampled query rows
        (when `needs_logits`)."""
        raise _missing(self, "selection")

    # -- costs ---------------------------------------------------------------------------------------
    def kept_fraction(self, layout, keep_heads=None) -> float:
        """The share of the video keys the block's attention computes (1: dense). keep_heads: the
        runtime per-head keep ratios [H] of the block, or None."""
        raise _missing(self, "kept_fraction")

    def cp_workload(self, layout, heads: int, keep_heads=None) -> ContextLoad:
        """The planner's inputs for this plan as a sparse block under context parallelism."""
        raise _missing(self, "cp_workload")

    # -- names ---------------------------------------------------------------------------------------
    def describe(self) -> str:
        """What the block runs at inference, as an export's dsv.json lists it."""
        return self.mode if self.sparse else "dense"

    def placement_tag(self) -> str:
        """What a context-parallel placement of this plan is keyed by (with the bucket and the block):
        the mode and the fields its class adds."""
        base = {f.name for f in dataclasses.fields(AttentionPlan)}
        own = [getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in base]
        return ":".join([self.mode, *(f"{v:g}" if isinstance(v, float) else str(v) for v in own)])

    @classmethod
    def from_config(cls, cfg=None):
        """The plan of a run with `attention=<mode>` and no controller (cfg's dsv section; None: defaults)."""
        return cls(sparse=True, **({"backend": cfg.dsv.dense_backend} if cfg is not None else {}))


def register_plan(cls):
    """Class decorator: make a plan class (a frozen dataclass subclass of AttentionPlan whose `mode`
    field defaults to its name) reachable as `AttentionPlan(mode=name)`, `as_plan(name)` and
    `attention=name` configs. Refuses a class that does not define what REQUIRED lists."""
    if not (isinstance(cls, type) and issubclass(cls, AttentionPlan) and cls is not AttentionPlan):
        raise TypeError(f"register_plan: {cls!r} is not a subclass of AttentionPlan")
    params = cls.__dict__.get("__dataclass_params__")
    if params is None or not params.frozen:
        raise TypeError(f"register_plan: {cls.__name__} must be a @dataclass(frozen=True): plans are hashed")
    mode = cls.__dataclass_fields__["mode"].default
    if not isinstance(mode, str) or not mode:
        raise TypeError(f'register_plan: {cls.__name__} must name its mode: `mode: str = "name"`')
    if mode in PLANS and PLANS[mode] is not cls:
        raise ValueError(
            f"register_plan: mode {mode!r} is already {PLANS[mode].__name__}'s; give {cls.__name__} its own "
            f'(`mode: str = "name"`)'
        )
    missing = [name for name in REQUIRED if getattr(cls, name) is getattr(AttentionPlan, name)]
    if missing:
        raise TypeError(
            f"attention plan class {cls.__name__} (mode {mode!r}) does not define "
            + "; ".join(f"{name}: {REQUIRED[name]}" for name in missing)
        )
    PLANS[mode] = cls
    return cls


def unregister_plan(mode: str) -> None:
    """Remove a registered plan class (a plugin or test that registered one cleans up)."""
    PLANS.pop(mode, None)


def plan_class(mode: str) -> type:
    if mode not in PLANS:
        raise ValueError(f"unknown attention plan mode {mode!r}; registered: {', '.join(sorted(PLANS))}")
    return PLANS[mode]


def sparse_modes() -> tuple[str, ...]:
    """The registered modes that attend sparsely (every one but dense): the `attention=` values that
    build a plan rather than name a dense backend."""
    return tuple(mode for mode, cls in PLANS.items() if not issubclass(cls, DensePlan))


@register_plan
@dataclasses.dataclass(frozen=True)
class DensePlan(AttentionPlan):
    """Dense attention on `backend`; with profile=True it also measures the block's sparsity (the
    profile's KV blocks: kv_block, or the tile)."""

    mode: str = "dense"

    @property
    def plain_dense(self) -> bool:
        return not (self.profile or self.capture)

    def selection(self, q, x, layout, geometry, *, predictor=None, inputs=None, logits=None, positions=None):
        return Selection()

    def kept_fraction(self, layout, keep_heads=None) -> float:
        return 1.0

    def cp_workload(self, layout, heads: int, keep_heads=None) -> ContextLoad:
        n_blocks = layout.seq_len // self.kv_block_for(layout)
        return ContextLoad(self.q_tile_for(layout), self.kv_block_for(layout), np.ones(heads), n_blocks)

    @classmethod
    def from_config(cls, cfg=None):
        return cls(**({"backend": cfg.dsv.dense_backend} if cfg is not None else {}))


@register_plan
@dataclasses.dataclass(frozen=True)
class DSVPlan(AttentionPlan):
    """DSV: the block's low-rank predictor scores KV blocks per query tile; the top `keep` share of them
    (fewer per head at run time: inputs["keep"]) is attended. sparse=False with keep > 0 and profile
    computes the selection only to measure its recall (stage 1)."""

    mode: str = "dsv"
    keep: float = 0.0  # static keep ceiling, top_k = ceil(keep * KV blocks); 0: no selection
    predictor: bool = False  # compute the predictor loss (training)
    block_reduce: str = "mean"
    center_logits: bool = True  # the predictor loss compares mean-centred logit rows (dsv.center_logits)
    # stage 1 under dsv.freeze_model_stage1: the step trains the predictor alone (the block itself reads
    # nothing of it; the train step does, and the flag keeps that step's program apart in the compile cache)
    model_frozen: bool = False

    def top_k(self, n_blocks: int) -> int:
        """Static number of KV blocks selected per query tile for a sequence of `n_blocks` blocks."""
        return max(1, min(n_blocks, math.ceil(self.keep * n_blocks - 1e-9)))

    @property
    def selects(self) -> bool:
        return self.keep > 0 and (self.sparse or self.profile)

    @property
    def needs_logits(self) -> bool:
        return self.predictor or self.profile

    @property
    def needs_tiles(self) -> bool:
        # a backed-off stage-2 block (nothing kept sparse, no predictor step, no profile) attends densely
        return self.sparse or self.selects or self.needs_logits or self.capture

    def selection(self, q, x, layout, geometry, *, predictor=None, inputs=None, logits=None, positions=None):
        if predictor is None and (self.predictor or self.selects):
            raise ValueError(
                "a DSV plan that selects or trains needs the block's predictor: build the model with "
                "attention=dsv (Config.predictor_rank > 0)"
            )
        out = Selection(block_reduce=self.block_reduce)
        if not (self.predictor or (self.capture and predictor is not None) or (self.selects and geometry is not None)):
            return out
        rope = rotary(layout.coords, predictor.rank, predictor.rope_theta) if predictor.rope else None
        q_lr, k_lr = predictor(jax.lax.stop_gradient(x), rope)  # the predictor never trains the model
        if self.capture:
            out.aux.update({"capture/q_lr": q_lr, "capture/k_lr": k_lr})
        if self.predictor:
            out.aux["predictor_loss"] = predictor_loss(
                q_lr, k_lr, logits, positions, layout.valid, center=self.center_logits
            )
        if geometry is None:
            return out
        out.lowrank = (q_lr, k_lr)
        if self.selects:
            keep = None if inputs is None else inputs.get("keep")
            backend = self.backend
            # under context parallelism the selection runs where the query tiles live
            select = backend.select_kv if isinstance(backend, ContextBackend) else select_kv
            out.kv = select(
                q_lr,
                k_lr,
                self.top_k(q.shape[1] // geometry.kv_block),
                keep,
                q_tile=geometry.q_tile,
                kv_block=geometry.kv_block,
                block_reduce=self.block_reduce,
                kv_valid=geometry.kv_valid,
            )
        return out

    def kept_fraction(self, layout, keep_heads=None) -> float:
        if not self.runs_sparse(layout):
            return 1.0
        n_blocks = layout.seq_len // self.kv_block_for(layout)
        top_k = self.top_k(n_blocks)
        if keep_heads is None:
            return top_k / n_blocks
        counts = np.clip(np.ceil(np.asarray(keep_heads, np.float64) * n_blocks - 1e-4), 1, top_k)  # head_counts
        return float(np.mean(counts)) / n_blocks

    def cp_workload(self, layout, heads: int, keep_heads=None) -> ContextLoad:
        kv_block = self.kv_block_for(layout)
        n_blocks = layout.seq_len // kv_block
        keep = np.full(heads, self.keep) if keep_heads is None else np.minimum(np.asarray(keep_heads), self.keep)
        keep = np.clip(np.asarray(keep, np.float64), 1.0 / n_blocks, 1.0)
        return ContextLoad(self.q_tile_for(layout), kv_block, keep, self.top_k(n_blocks))

    def describe(self) -> str:
        return f"dsv keep<={self.keep:g}" if self.sparse else "dense"

    def placement_tag(self) -> str:
        # the key format of placements checkpointed before plans had classes (its last slot: the window)
        return f"dsv:{self.keep:g}:{1 / 3:g}"

    @classmethod
    def from_config(cls, cfg=None):
        # dense until the controller's plans: the controller builds the sparse ones
        return cls(**({"backend": cfg.dsv.dense_backend} if cfg is not None else {}))


def as_plan(plan: Any) -> Any:
    """A backend name stays a name (dense); a sparse mode's name ("dsv", "window") becomes its default
    plan. "dsv" alone (no controller) is dense attention: the trainer's controller supplies the sparse
    plans."""
    if isinstance(plan, str) and plan in sparse_modes():
        return PLANS[plan].from_config()
    return plan


def tiled(attention: Any) -> bool:
    """Whether a forward under `attention` (a backend name, a plan, or one per block) lays its tokens out
    in the model's 3D tiles: where some block needs them. Otherwise tokens stay in raster order (1 x 1 x 1
    tiles), so a grid that does not divide into tiles is not padded for attention that is dense anyway."""
    plans = attention if isinstance(attention, (list, tuple)) else [attention]
    return any(isinstance(p, AttentionPlan) and p.needs_tiles for p in map(as_plan, plans))


def static_plans(cfg) -> Any:
    """The attention argument of a run without a controller: a backend name, or the plan of a sparse mode."""
    if cfg.attention in sparse_modes():
        return PLANS[cfg.attention].from_config(cfg)
    return cfg.attention
