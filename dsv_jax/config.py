"""Typed configs and named presets.

A config is a tree of frozen dataclasses. Presets are plain functions returning one; command-line
overrides (`model.depth=8`, `train.lr=3e-4`) are merged by OmegaConf, which type-checks each value
against the dataclass field and rejects unknown keys. `__post_init__` checks the choices and ranges
that types alone cannot express.

    cfg = get_config("2.7b-mmdit", ["train.steps=1000", "attention=dsv"])
    cfg = load_config("runs/x/config.json", ["train.steps=2000"])   # a preset name, or a YAML / JSON file

A config file (`load_config`) names the preset it extends in its top-level `name:` (as the config's
own `name` field does; `tiny` when absent); its other fields are merged over that preset, then the
overrides over the result. A run's `config.json` is such a file, so it re-launches the run.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import json
import logging
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A preset name or override that cannot be applied; the message says which and why."""


def _choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {list(choices)}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name}={value!r} must be > 0")


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "dit"  # dit: cross-attention to text (Wan-like); mmdit: joint text+video attention (SD3-like)
    in_channels: int = 3  # latent channels C of [B, T, H, W, C]
    hidden: int = 128
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    text_mlp_ratio: float = 2.0  # MMDiT text stream only
    # per_block: each block projects the conditioning to its own (shift, scale, gate) (DiT's AdaLN-Zero).
    # single: one shared projection plus a learned per-block offset (PixArt-alpha's adaLN-single, Wan).
    adaln: str = "per_block"
    adaln_impl: str = "auto"  # auto | pallas | xla: which AdaLN kernel the blocks call
    patch: tuple[int, int, int] = (1, 2, 2)  # (pt, ph, pw) latent voxels per token
    tile: tuple[int, int, int] = (2, 4, 4)  # tokens per 3D tile in tile-major order
    text_dim: int = 128  # width of the text embeddings the model receives
    qk_norm: bool = True
    rope_theta: float = 10000.0
    # also add a fixed sin-cos embedding of each token's (t, h, w) to its patch embedding (no parameters):
    # RoPE alone tells attention only relative positions, so a token learns which frame or where in the
    # frame it is only through its neighbours
    absolute_position: bool = False
    dtype: str = "auto"  # compute dtype: auto (bfloat16 on accelerators, float32 on CPU) | bfloat16 | float32
    remat: bool = True  # jax.checkpoint per block
    # with remat: keep each block's flash-attention output and softmax statistics (DSV's sparse kernels,
    # cuDNN self-attention) for the backward instead of running attention's forward again. H200, 2.7B at
    # 128k: full attention's step -19%, DSV 0.9's -11%, +15-17 GiB (experiments/results/RESULTS.md,
    # "Keeping attention across the remat")
    remat_keep_attention: bool = False
    scan_layers: bool = True  # lax.scan over blocks when all blocks share one static attention plan
    # Where Wan 2.1 differs from our defaults, one named option each (the `wan2.1-*` presets set them all;
    # docs/guide/wan.md maps every parameter to Wan's):
    mlp_width: int = 0  # the MLP's hidden width (Wan: 8960 at 1.3B); 0: round(hidden * mlp_ratio)
    # RMSNorm of q and k: "head" normalises each head's channels; "all_heads" all heads' channels together,
    # with one scale per channel of the model width (Wan's rms_norm_across_heads)
    qk_norm_scope: str = "head"
    # the LayerNorm before the DiT's cross-attention: "plain" has no parameters; "affine" learns a scale and
    # a bias (Wan's cross_attn_norm)
    cross_norm: str = "plain"
    # adaLN-single's final (shift, scale): "projected" from the shared projection of the timestep embedding
    # (two more rows); "timestep": the timestep embedding itself plus the final layer's table (Wan's head)
    final_modulation: str = "projected"
    # text attention sees only each caption's valid tokens (text_mask); false: every one of the L positions,
    # as Wan attends to its encoder's zero-filled tail of 512 tokens
    text_mask: bool = True

    def __post_init__(self):
        _choice("model.arch", self.arch, ("dit", "mmdit"))
        _choice("model.adaln", self.adaln, ("per_block", "single"))
        _choice("model.qk_norm_scope", self.qk_norm_scope, ("head", "all_heads"))
        _choice("model.cross_norm", self.cross_norm, ("plain", "affine"))
        _choice("model.final_modulation", self.final_modulation, ("projected", "timestep"))
        if self.final_modulation == "timestep" and self.adaln != "single":
            raise ConfigError("model.final_modulation=timestep needs model.adaln=single (a per-block table)")
        if self.cross_norm == "affine" and self.arch != "dit":
            raise ConfigError("model.cross_norm=affine applies to the DiT's cross-attention (model.arch=dit)")
        if self.mlp_width < 0:
            raise ConfigError(f"model.mlp_width={self.mlp_width} must be >= 0 (0: hidden x mlp_ratio)")
        _choice("model.adaln_impl", self.adaln_impl, ("auto", "pallas", "xla"))
        _choice("model.dtype", self.dtype, ("auto", "bfloat16", "float32"))
        for name in ("in_channels", "hidden", "depth", "heads", "text_dim"):
            _positive(f"model.{name}", getattr(self, name))
        _positive("model.mlp_ratio", self.mlp_ratio)
        _positive("model.text_mlp_ratio", self.text_mlp_ratio)
        if self.hidden % self.heads:
            raise ConfigError(f"model.hidden={self.hidden} is not divisible by model.heads={self.heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head dim {self.head_dim} must be even for rotary embeddings")
        for name in ("patch", "tile"):
            if any(v < 1 for v in getattr(self, name)):
                raise ConfigError(f"model.{name}={getattr(self, name)} must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_hidden(self) -> int:
        """The (video-stream) MLP's hidden width."""
        return self.mlp_width or int(round(self.hidden * self.mlp_ratio))

    @property
    def text_mlp_hidden(self) -> int:
        """The MMDiT text stream's MLP hidden width."""
        return int(round(self.hidden * self.text_mlp_ratio))

    @property
    def shared_modulation_rows(self) -> int:
        """Rows of adaLN-single's shared projection: 6 per stream (video, MMDiT's text), 2 for the final layer
        unless it takes the timestep embedding itself (final_modulation=timestep)."""
        return 6 * (2 if self.arch == "mmdit" else 1) + (2 if self.final_modulation == "projected" else 0)

    @property
    def patch_dim(self) -> int:
        pt, ph, pw = self.patch
        return pt * ph * pw * self.in_channels


@dataclass(frozen=True)
class TextConfig:
    encoder: str = "builtin"  # builtin: learned token embeddings; precomputed: embeddings come with the data
    max_len: int = 16  # tokens per caption (the built-in tokenizer pads or truncates to this)
    hash_buckets: int = 256  # out-of-vocabulary words hash into this many extra embeddings

    def __post_init__(self):
        _choice("text.encoder", self.encoder, ("builtin", "precomputed"))
        _positive("text.max_len", self.max_len)


# data.source values: the keys of `dsv_jax.data.feed.SOURCES` (a test keeps the two in sync), of which
# PATH_SOURCES read a prepared dataset at data.path; "auto" resolves in `DataConfig.resolved_source`.
DATA_SOURCES = ("synthetic", "photos", "arrayrecord")
PATH_SOURCES = ("arrayrecord",)


@dataclass(frozen=True)
class DataConfig:
    # auto: a prepared dataset when data.path is set (`dsv-jax prepare-data`), else the embedded one
    source: str = "auto"  # auto | synthetic | photos (embedded, data/photos.py) | arrayrecord
    path: str = ""  # a prepare-data output folder (ArrayRecord shards + manifest.json)
    seed: int = 0
    # Bucket shapes (T, H, W) in latent voxels, with their sampling weights. Images are T = 1.
    # With data.path these come from the dataset's manifest (weights = sample counts).
    buckets: tuple[tuple[int, int, int], ...] = ((1, 32, 32), (4, 32, 32), (8, 32, 32), (8, 32, 48))
    bucket_weights: tuple[float, ...] = (0.25, 0.25, 0.3, 0.2)
    # Samples per step (data/bucketing.py): equal_tokens: B = tokens_per_batch // S;
    # dual: B = min(m_mem // S, m_comp // S**cost_p) (AdaptiveLoad); both capped at max_batch.
    batching: str = "equal_tokens"  # equal_tokens | dual
    tokens_per_batch: int = 2048
    max_batch: int = 64
    cost_model: str = ""  # JSON from `dsv-jax fit-cost`: supplies m_mem, m_comp, cost_p not set here
    m_mem: float = 0.0  # tokens per global batch (memory budget)
    m_comp: float = 0.0  # B * S**p per global batch (compute budget)
    cost_p: float = 0.0  # exponent p of t = a + b * B * S**p
    codec: str = ""  # latent codec (data/codec.py); "" = the dataset's (or pixels for the embedded data)
    workers: int = 2  # Grain prefetch processes reading a data.path dataset (0: read in a thread)

    @property
    def resolved_source(self) -> str:
        """data.source with "auto" resolved, the one place it is: arrayrecord where data.path is set, else
        the embedded shapes (synthetic)."""
        if self.source != "auto":
            return self.source
        return "arrayrecord" if self.path else "synthetic"

    def __post_init__(self):
        _choice("data.source", self.source, ("auto", *DATA_SOURCES))
        if self.resolved_source in PATH_SOURCES and not self.path:
            raise ConfigError(f"data.source={self.source} needs data.path=DIR (a prepare-data output folder)")
        if self.resolved_source not in PATH_SOURCES and self.path:
            raise ConfigError(f"data.path={self.path!r} is set but data.source={self.source}; drop one of them")
        _choice("data.batching", self.batching, ("equal_tokens", "dual"))
        if not self.buckets:
            raise ConfigError("data.buckets is empty")
        if len(self.bucket_weights) != len(self.buckets):
            raise ConfigError(
                f"data.bucket_weights has {len(self.bucket_weights)} entries for {len(self.buckets)} buckets"
            )
        if any(w < 0 for w in self.bucket_weights) or sum(self.bucket_weights) <= 0:
            raise ConfigError(f"data.bucket_weights={self.bucket_weights} must be >= 0 with a positive sum")
        for shape in self.buckets:
            if len(shape) != 3 or any(v < 1 for v in shape):
                raise ConfigError(f"data.buckets entry {shape} must be (T, H, W) with positive sizes")
        _positive("data.tokens_per_batch", self.tokens_per_batch)
        _positive("data.max_batch", self.max_batch)
        for name in ("m_mem", "m_comp", "cost_p"):
            if getattr(self, name) < 0:
                raise ConfigError(f"data.{name}={getattr(self, name)} must be >= 0 (0: from data.cost_model)")
        if self.batching == "dual" and not self.cost_model and not (self.m_mem and self.m_comp and self.cost_p):
            raise ConfigError(
                "data.batching=dual needs data.cost_model=PATH (from `dsv-jax fit-cost`) or all of "
                "data.m_mem, data.m_comp, data.cost_p"
            )
        if self.workers < 0:
            raise ConfigError(f"data.workers={self.workers} must be >= 0")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    seed: int = 0
    lr: float = 1e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.99
    grad_clip: float = 1.0
    caption_dropout: float = 0.1  # share of captions replaced by the empty caption (for guidance)
    t_logit_mean: float = 0.0  # logit-normal timestep distribution
    t_logit_std: float = 1.0
    log_every: int = 10
    ckpt_every: int = 100
    keep_checkpoints: int = 3
    eval_every: int = 0  # held-out loss every N steps (0: only at the end)
    eval_batches: int = 2  # batches per bucket of each held-out evaluation (0: none)
    sample_at_end: bool = True
    sample_steps: int = 30
    guidance: float = 3.0
    # Moves the sampler's time grid towards noise (t = 1): t -> s t / (1 + (s - 1) t), see
    # dsv_jax/train/loss.py: shift_timesteps. 1: a uniform grid. The same shift of the training t is
    # t_logit_mean += log(s). Every sampler (end-of-run GIF, `sample`, `eval`) reads it from the run's config.
    sample_shift: float = 1.0
    # The sampler's solver of the flow ODE (dsv_jax/solvers.py): "euler" (first order, on the shifted uniform
    # grid) or "unipc" (Wan's: second-order UniPC multistep on Wan's grid, one model call per step as Euler).
    sample_solver: str = "euler"
    # Resolution-dependent shift (SD3, section 5.3.2): a clip of n latent positions (T x H x W) has n / ref
    # times the reference's positions and keeps its layout at more noise, so its training t_logit_mean gains
    # 0.5 * log(n / ref) and the sampler's shift is multiplied by sqrt(n / ref). t_logit_mean and
    # sample_shift are the values at ref positions. 0: off (every shape trains and samples alike).
    resolution_shift_ref: int = 0
    # An exponential moving average (EMA) of the weights, kept in the train state beside them and updated
    # after every applied step: ema <- d ema + (1 - d) params. When it is on, everything that samples or
    # evaluates a trained run (end-of-run GIF, `sample`, `eval`, `export`, dsv_jax.load_model) uses it.
    # 0: off, and no copy of the weights is kept. ema_warmup: d at update n is min(ema_decay,
    # (1 + n) / (10 + n)), so that the random init's share fades within a short run's first steps.
    ema_decay: float = 0.0
    ema_warmup: bool = True
    # Divergence guard (dsv_jax/train/guard.py). A step is bad when its loss or gradient is not finite
    # (its update is skipped) or its loss is above divergence_factor x the median of the last
    # divergence_window good losses (0: no loss check; our tiny runs stay below 2x). While the latest
    # step is bad nothing is saved or sampled; after max_bad_steps bad steps in a row the run stops
    # with exit status 1 (0: never stops).
    max_bad_steps: int = 20
    divergence_factor: float = 10.0
    divergence_window: int = 100
    # A new run's model weights from an export folder (`dsv-jax export`, `dsv-jax import-weights`; CLI:
    # --init-from DIR): its model config must match this one; DSV predictors the export lacks start fresh,
    # the optimizer and step start afresh. A checkpoint in the workdir wins (the run resumes; this is ignored).
    init_from: str = ""

    def __post_init__(self):
        if self.steps < 0:
            raise ConfigError(f"train.steps={self.steps} must be >= 0")
        for name in ("eval_every", "eval_batches"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be >= 0 (0: none)")
        if self.max_bad_steps < 0:
            raise ConfigError(f"train.max_bad_steps={self.max_bad_steps} must be >= 0 (0: never stop)")
        if self.divergence_factor != 0 and not self.divergence_factor > 1:
            raise ConfigError(f"train.divergence_factor={self.divergence_factor} must be > 1 (0: off)")
        _positive("train.divergence_window", self.divergence_window)
        _positive("train.lr", self.lr)
        _positive("train.sample_shift", self.sample_shift)
        if self.resolution_shift_ref < 0:
            raise ConfigError(
                f"train.resolution_shift_ref={self.resolution_shift_ref} must be >= 0 (0: off; else "
                "the latent positions T x H x W at which t_logit_mean and sample_shift apply)"
            )
        _positive("train.sample_steps", self.sample_steps)
        _choice("train.sample_solver", self.sample_solver, ("euler", "unipc"))
        _positive("train.ckpt_every", self.ckpt_every)
        _positive("train.keep_checkpoints", self.keep_checkpoints)
        _positive("train.log_every", self.log_every)
        if not 0 <= self.caption_dropout < 1:
            raise ConfigError(f"train.caption_dropout={self.caption_dropout} must be in [0, 1)")
        if not 0 <= self.ema_decay < 1:
            raise ConfigError(
                f"train.ema_decay={self.ema_decay} must be in [0, 1) (0: no EMA of the weights; e.g. 0.999)"
            )


@dataclass(frozen=True)
class ParallelConfig:
    # Mesh axis sizes; -1 takes the remaining devices. All explicit and smaller than the device count:
    # the mesh uses the first data * fsdp * context devices.
    data: int = 1
    fsdp: int = -1
    context: int = 1
    # Context-parallel attention when context > 1: hybrid (planner picks HCP x SCP) | ulysses | ring |
    # allgather | selective (sparse only). See dsv_jax/parallel/context.py.
    context_strategy: str = "hybrid"
    # Force the HCP degree of every block (0: the planner picks HCP x SCP per block). It must divide
    # parallel.context and the number of heads.
    hcp_degree: int = 0

    def __post_init__(self):
        _choice(
            "parallel.context_strategy", self.context_strategy, ("hybrid", "ulysses", "ring", "allgather", "selective")
        )
        if self.hcp_degree < 0:
            raise ConfigError(f"parallel.hcp_degree={self.hcp_degree} must be >= 0 (0: chosen by the planner)")
        sizes = (self.data, self.fsdp, self.context)
        if sum(s == -1 for s in sizes) > 1:
            raise ConfigError(f"at most one of parallel.data/fsdp/context may be -1, got {sizes}")
        if any(s == 0 or s < -1 for s in sizes):
            raise ConfigError(f"parallel sizes must be positive or -1, got {sizes}")


@dataclass(frozen=True)
class DSVConfig:
    """DSV dynamic sparse attention (attention=dsv) and the window baseline (attention=window).

    Paper figures (arXiv 2502.07590) are the defaults: rank 16, every 64th query, loss 0.9 cosine +
    0.1 MSE, AdamW 1e-4, theta 0.9, EMA 0.9, switch at predictor loss < 0.01. The cost-benefit
    threshold is set from our kernels' measurements (0.5; the paper's artifact uses 0.8).
    """

    rank: int = 16  # low-rank predictor dims per head (W_Q^lr, W_K^lr)
    # Our DiT has no absolute position embedding (3D RoPE only), so a position-blind predictor could not
    # express locality; q_lr / k_lr get the same 3D RoPE as q / k (a departure from the paper; false = off).
    predictor_rope: bool = True
    predictor_lr: float = 1e-4
    stage2_lr_scale: float = 0.1  # the predictor keeps training in stage 2 at predictor_lr * this
    predictor_weight_decay: float = 0.0  # the loss is scale-invariant: decay would only shrink weights
    # The loss on logit rows minus their mean (ours, not the paper's): softmax ignores a row's offset;
    # measured against raw rows in experiments/results/RESULTS.md, "Quality parity".
    center_logits: bool = True
    query_stride: int = 64  # predictor loss and profiling use every Nth query ...
    max_queries: int = 256  # ... at most this many per sample (the paper's every-64th up to 16k tokens;
    # beyond, a wider stride bounds the [B, H, queries, S] logits: 2 GiB at 128k tokens x 16 heads)
    # Stage 2 lowers the predictor's rate: its loss samples at most this many queries on steps that do not
    # profile (profile steps keep max_queries, so the statistics the controller decides on are unchanged).
    # The [B, H, queries, S] logits are memory-bound work; the predictor is in stage 2 a slow fine-tune
    # (stage2_lr_scale). Never above max_queries; 0 = max_queries.
    stage2_max_queries: int = 64
    # ... and trains only on every Nth stage-2 step (and on every profile step), at N times the per-step
    # learning rate, so it moves as far per step on average as when it trains every step. The other steps
    # skip its loss (true and predicted logit rows, and their backward) and leave its weights and AdamW
    # state untouched; 1 = every step.
    stage2_predictor_every: int = 4
    theta: float = 0.9  # critical KV: the fewest keys holding this share of a query's attention mass
    profile_every: int = 50  # steps between sparsity profiles (and the first step of each bucket)
    # Back-off while nothing is sparse (ours; 0 = off): in stage 2, each profile that leaves every block of a
    # bucket dense doubles that bucket's intervals between profiles and between predictor steps, until
    # profiles are this many steps apart; a profile that makes a block sparse restores profile_every and
    # stage2_predictor_every. Then a DSV step costs what a full-attention step does, but for a profile and
    # a predictor step in every this-many steps (experiments/results/RESULTS.md, "DSV's overhead"). No
    # back-off where it is not above profile_every.
    backoff_max_every: int = 400
    ema: float = 0.9  # momentum of the sparsity (and predictor-loss) moving averages
    percentile: float = 10.0  # conservative head sparsity: this low percentile over sampled queries
    switch_loss: float = 0.01  # stage 2 once the predictor loss averaged over blocks is below this ...
    stage1_steps: int = 0  # ... or after this many steps (0: only the loss criterion)
    # A block goes sparse only when 1 - its mean head keep ratio is at least this: where the sparse
    # kernels beat dense attention (experiments/results/RESULTS.md, "Sparse attention kernels (Triton)").
    threshold: float = 0.5
    hysteresis: float = 0.05  # margin before a decision is reversed (sparse -> dense, or a smaller rung)
    # Static keep ratios (top_k = ceil(rung * KV blocks)); per-head counts below the rung are runtime.
    ladder: tuple[float, ...] = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
    keep_scale: float = 1.0  # paper's rule: keep = min(1, keep_scale * (1 - sparsity)); > 1 buys recall
    # > 0 (not in the paper; 0 = off): per-head keep = the smallest keep ratio whose measured recall (the
    # attention mass inside the predictor's selection, profiled as a curve over keep ratios) reaches this;
    # replaces the keep_scale rule once a block has a curve.
    recall_target: float = 0.0
    # tokens per KV block of the selection; 0: the token layout's 3D tile (64 tokens), the default because at equal
    # recall it is the fastest: finer blocks hold little more of the mass per kept key on trained models while
    # their kernels run 1.25x (16) and 1.3x (32) slower per kept key (one H100 run, all against its cuDNN;
    # RESULTS.md, "Recall by granularity")
    kv_block: int = 0
    block_reduce: str = "mean"  # how a KV block's score reduces over its keys (mean | max)
    dense_backend: str = "auto"  # the dense attention used by dense blocks and text tokens
    window: float = 1 / 3  # window baseline: window / grid per dimension (WA-M 1/3, WA-L 2/3)
    # Stage 1 trains the predictors alone: every other parameter (and its AdamW state) stays as it was, and the
    # step skips the model's backward pass. For DSV retrofitted onto pretrained weights (train.init_from):
    # the predictors learn the pretrained attention before stage 2 fine-tunes everything with sparse attention.
    freeze_model_stage1: bool = False

    def __post_init__(self):
        _positive("dsv.rank", self.rank)
        if self.predictor_rope and self.rank % 2:
            raise ConfigError(f"dsv.rank={self.rank} must be even for rotary embeddings (or dsv.predictor_rope=false)")
        for name in ("predictor_lr", "query_stride", "max_queries", "profile_every", "keep_scale"):
            _positive(f"dsv.{name}", getattr(self, name))
        for name in ("theta", "ema", "threshold"):
            if not 0 <= getattr(self, name) < 1 or (name == "theta" and self.theta <= 0):
                raise ConfigError(f"dsv.{name}={getattr(self, name)} must be in (0, 1)")
        if not 0 <= self.recall_target < 1:
            raise ConfigError(f"dsv.recall_target={self.recall_target} must be in [0, 1)")
        if not 0 <= self.percentile <= 100:
            raise ConfigError(f"dsv.percentile={self.percentile} must be in [0, 100]")
        if not self.ladder or any(not 0 < r <= 1 for r in self.ladder) or list(self.ladder) != sorted(set(self.ladder)):
            raise ConfigError(f"dsv.ladder={self.ladder} must be increasing keep ratios in (0, 1]")
        _positive("dsv.stage2_predictor_every", self.stage2_predictor_every)
        if self.stage2_max_queries < 0:
            raise ConfigError(f"dsv.stage2_max_queries={self.stage2_max_queries} must be >= 0 (0: dsv.max_queries)")
        if self.stage1_steps < 0 or self.kv_block < 0 or self.stage2_lr_scale < 0 or self.hysteresis < 0:
            raise ConfigError("dsv.stage1_steps, dsv.kv_block, dsv.stage2_lr_scale and dsv.hysteresis must be >= 0")
        if self.backoff_max_every < 0:
            raise ConfigError(f"dsv.backoff_max_every={self.backoff_max_every} must be >= 0 (0: no back-off)")
        _choice("dsv.block_reduce", self.block_reduce, ("mean", "max"))
        if not 0 < self.window <= 1:
            raise ConfigError(f"dsv.window={self.window} must be in (0, 1]")


# The attention backends dsv_jax.attention registers and the sparse plan modes dsv_jax.dsv.plan registers
# (a test keeps them in sync); a backend or plan registered by your own code is accepted too once its
# module is imported.
ATTENTION_BACKENDS = ("auto", "xla", "cudnn", "dsv", "window")


def known_attention_backends() -> tuple[str, ...]:
    # never imported from here: config stays jax-free
    registry, plans = sys.modules.get("dsv_jax.attention.registry"), sys.modules.get("dsv_jax.dsv.plan")
    extra = [*(registry.available_backends() if registry else ()), *(plans.sparse_modes() if plans else ())]
    return ATTENTION_BACKENDS + tuple(sorted(set(extra) - set(ATTENTION_BACKENDS)))


@dataclass(frozen=True)
class Config:
    name: str = "tiny"
    attention: str = "auto"  # attention backend of the video self-attention: auto | xla | cudnn | dsv | window
    model: ModelConfig = field(default_factory=ModelConfig)
    text: TextConfig = field(default_factory=TextConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dsv: DSVConfig = field(default_factory=DSVConfig)

    def __post_init__(self):
        _choice("attention", self.attention, known_attention_backends())
        if self.dsv.freeze_model_stage1 and self.attention != "dsv":
            raise ConfigError(
                f"dsv.freeze_model_stage1=true freezes the model during DSV's stage 1: it needs attention=dsv, "
                f"got attention={self.attention} (or pass dsv.freeze_model_stage1=false)"
            )

    @property
    def predictor_rank(self) -> int:
        """Rank of the DSV predictor the blocks carry (0: none; only attention=dsv trains one)."""
        return self.dsv.rank if self.attention == "dsv" else 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        """Rebuild a config saved by `to_dict` (e.g. from a checkpoint), type-checked like overrides."""
        return _to_config(OmegaConf.merge(OmegaConf.structured(cls), OmegaConf.create(d)))


# ---------------------------------------------------------------------------------------------
# Presets. Paper sizes (DSV): 0.8B = 28 x 12 heads x 96; 2.7B = 32 x 16 x 128; 30B = 42 x 24 x 256.
# MLP widths are chosen so that each preset lands within a few percent of its name; the MMDiT
# variants use adaLN-single and a narrower text-stream MLP to stay parameter-matched to the DiT.


def _tiny() -> Config:
    # Sized for the README's first command: a few minutes on 2 CPU cores.
    return Config(
        name="tiny",
        model=ModelConfig(
            hidden=128, depth=4, heads=4, patch=(1, 4, 4), tile=(2, 4, 4), text_dim=64, in_channels=3, mlp_ratio=4.0
        ),
        data=DataConfig(tokens_per_batch=1536),
        train=TrainConfig(steps=800, lr=2e-3),
        # attention=dsv reaches stage 2 well within the default steps on a CPU; paper presets switch on the loss.
        dsv=DSVConfig(stage1_steps=100, profile_every=25),
    )


def _tiny_motion() -> Config:
    # The tiny MMDiT set up for a first sample whose objects move as prompted within ~5 minutes on 2 CPU cores
    # (experiments/results/RESULTS.md, "Tiny first run", run "w50"): absolute positions beside a short-range RoPE,
    # half the batches stills (the shapes and colours cheaply) and half 8-frame clips (the motion), training
    # weighted towards high noise where the layout and the direction are decided, and a mild guidance.
    cfg = _mmdit(_tiny(), 2.0)
    return dataclasses.replace(
        cfg,
        name="tiny-motion",
        model=dataclasses.replace(cfg.model, remat=False, rope_theta=100.0, absolute_position=True),
        data=dataclasses.replace(cfg.data, buckets=((1, 32, 32), (8, 32, 32)), bucket_weights=(0.5, 0.5)),
        train=dataclasses.replace(
            cfg.train, steps=2000, t_logit_mean=1.6, t_logit_std=1.5, sample_shift=3.0, guidance=1.5
        ),
    )


def _paper(name: str, depth: int, heads: int, head_dim: int, mlp_ratio: float) -> Config:
    return Config(
        name=name,
        model=ModelConfig(
            hidden=heads * head_dim,
            depth=depth,
            heads=heads,
            mlp_ratio=mlp_ratio,
            in_channels=16,
            patch=(1, 2, 2),
            tile=(4, 4, 4),
            text_dim=4096,
        ),
        text=TextConfig(max_len=64),
        data=DataConfig(
            buckets=((1, 64, 64), (13, 48, 80), (21, 60, 104)), bucket_weights=(0.3, 0.4, 0.3), tokens_per_batch=32768
        ),
        train=TrainConfig(lr=1e-4, warmup_steps=1000, steps=100_000, ckpt_every=1000, log_every=10),
    )


def _wan(name: str, hidden: int, depth: int, heads: int, mlp_width: int) -> Config:
    """Wan 2.1's text-to-video transformer, exactly (docs/guide/wan.md): import its weights with
    `dsv-jax import-weights`. Text: umT5-XXL embeddings (4096 wide) of up to 512 tokens, precomputed with the
    data. Tiles of 1 x 8 x 8 tokens pad 480p's 21 x 30 x 52 grid by 15% and 720p's 21 x 45 x 80 by 7%
    (4 x 4 x 4 tiles: 22% and 22%). Sampling follows Wan's defaults: UniPC, 50 steps, guidance 5, shift 3
    (Wan's value at 480p; 5 at 720p: pass --shift 5)."""
    return Config(
        name=name,
        model=ModelConfig(
            arch="dit",
            adaln="single",
            in_channels=16,
            hidden=hidden,
            depth=depth,
            heads=heads,
            mlp_width=mlp_width,
            patch=(1, 2, 2),
            tile=(1, 8, 8),
            text_dim=4096,
            qk_norm_scope="all_heads",
            cross_norm="affine",
            final_modulation="timestep",
            text_mask=False,
        ),
        text=TextConfig(encoder="precomputed", max_len=512),
        data=DataConfig(buckets=((21, 60, 104),), bucket_weights=(1.0,), tokens_per_batch=32760, max_batch=8),
        train=TrainConfig(
            lr=1e-5,
            warmup_steps=100,
            steps=2000,
            ckpt_every=200,
            caption_dropout=0.1,
            sample_steps=50,
            guidance=5.0,
            sample_shift=3.0,
            sample_solver="unipc",
        ),
    )


def _mmdit(cfg: Config, text_mlp_ratio: float) -> Config:
    model = dataclasses.replace(cfg.model, arch="mmdit", adaln="single", text_mlp_ratio=text_mlp_ratio)
    return dataclasses.replace(cfg, name=f"{cfg.name}-mmdit", model=model)


PRESETS: dict[str, Callable[[], Config]] = {
    "tiny": _tiny,
    "tiny-mmdit": lambda: _mmdit(_tiny(), 2.0),
    "tiny-motion": _tiny_motion,
    "0.8b": lambda: _paper("0.8b", 28, 12, 96, 4.0),
    "0.8b-mmdit": lambda: _mmdit(_paper("0.8b", 28, 12, 96, 4.0), 2.5),
    "2.7b": lambda: _paper("2.7b", 32, 16, 128, 3.5),
    "2.7b-mmdit": lambda: _mmdit(_paper("2.7b", 32, 16, 128, 4.0), 2.0),
    "30b": lambda: _paper("30b", 42, 24, 256, 3.0),
    "30b-mmdit": lambda: _mmdit(_paper("30b", 42, 24, 256, 4.0), 1.5),
    "wan2.1-t2v-1.3b": lambda: _wan("wan2.1-t2v-1.3b", 1536, 30, 12, 8960),
    "wan2.1-t2v-14b": lambda: _wan("wan2.1-t2v-14b", 5120, 40, 40, 13824),
}
# "<size>-dit" names the default architecture explicitly.
PRESETS.update(
    {f"{k}-dit": v for k, v in list(PRESETS.items()) if not k.endswith(("-mmdit", "-motion")) and "wan" not in k}
)


def _valid_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    for k, v in node.items():
        if OmegaConf.is_dict(v):
            keys += _valid_keys(v, f"{prefix}{k}.")
        else:
            keys.append(f"{prefix}{k}")
    return keys


def _deep_tuple(value: Any) -> Any:
    return tuple(_deep_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def _frozen(obj: Any) -> Any:
    """Nested sequences as tuples (OmegaConf gives lists inside tuple fields such as data.buckets), so that
    configs from presets, overrides and files compare equal and hash."""
    changes = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        new = _frozen(value) if dataclasses.is_dataclass(value) else _deep_tuple(value)
        if type(new) is not type(value) or new != value:
            changes[f.name] = new
    return dataclasses.replace(obj, **changes) if changes else obj


def _to_config(node: Any) -> Config:
    try:
        return _frozen(OmegaConf.to_object(node))
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def _field_type(key: str) -> Any:
    """The annotated type of a dotted config key (e.g. float for train.lr), or None."""
    cls: Any = Config
    for part in key.split("."):
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            return None
        cls = hints[part]
    return cls


def _example(tp: Any) -> str:
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        items = [args[0]] * 2 if len(args) == 2 and args[1] is Ellipsis else list(args)
        return "[" + ",".join(_example(a) for a in items) + "]"
    return {int: "8", float: "0.5", bool: "true", str: "xla"}.get(tp, "...")


def _expected(tp: Any) -> str | None:
    """What a value of config type `tp` looks like on the command line, e.g. 'a number (e.g. 0.5)'."""
    if tp in (int, float, bool, str):
        kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[tp]
        return kind if tp is bool else f"{kind} (e.g. {_example(tp)})"
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        size = "" if len(args) == 2 and args[1] is Ellipsis else f" of {len(args)} values"
        return f"a list{size}, e.g. {_example(tp)}"
    if dataclasses.is_dataclass(tp):
        return f"fields of the section, e.g. {tp.__name__.removesuffix('Config').lower()}.FIELD=VALUE"
    return None


def _unknown_key(key: str, valid: list[str]) -> ConfigError:
    """A one-line error with the closest valid keys: the section and the field are matched apart, so
    that the shared section prefix does not make every field of it look close."""
    section, _, leaf = key.rpartition(".")
    sections = sorted({k.rpartition(".")[0] for k in valid if "." in k})
    if section and section not in sections:  # a mistyped section: trian.lr -> train.lr
        close = [f"{s}.{leaf}" for s in difflib.get_close_matches(section, sections, n=3, cutoff=0.6)]
        close = [k for k in close if k in valid]
    else:
        fields = [k.rpartition(".")[2] for k in valid if k.rpartition(".")[0] == section]
        close = [f"{section}.{f}" if section else f for f in difflib.get_close_matches(leaf, fields, n=3, cutoff=0.6)]
    if not close:  # a field under the wrong section (data.lr -> train.lr)
        close = [k for k in valid if k.rpartition(".")[2] == leaf][:3]
    if close:
        hint = f"did you mean {' or '.join(close)}?"
    else:
        tops = sorted({k.split(".")[0] for k in valid})
        hint = f"top-level keys: {', '.join(tops)} (fields in dsv_jax/config.py)"
    return ConfigError(f"unknown config key {key!r}; {hint}")


def apply_override(node: Any, item: str, valid: list[str]) -> Any:
    """`node` with one `key=value` override merged, or a one-line ConfigError naming the key, the value
    and what was expected."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, value = item.split("=", 1)
    key = key.strip()
    if key not in valid and not any(k.startswith(key + ".") for k in valid):
        raise _unknown_key(key, valid)
    try:
        return OmegaConf.merge(node, OmegaConf.from_dotlist([item]))
    except OmegaConfBaseException as e:
        expected = _expected(_field_type(key))
        detail = f"expected {expected}" if expected else str(e).splitlines()[0]
        raise ConfigError(f"{key}={value}: {detail}") from None


def get_config(name: str, overrides: Sequence[str] = ()) -> Config:
    """The preset `name` with `key=value` overrides applied, type-checked."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=3)
        raise ConfigError(
            f"unknown preset {name!r}; "
            + (f"did you mean {' or '.join(close)}? " if close else "")
            + f"presets: {', '.join(sorted(PRESETS))}"
        )
    return _apply_overrides(OmegaConf.structured(PRESETS[name]()), overrides)


def _apply_overrides(base: Any, overrides: Sequence[str]) -> Config:
    merged = base
    valid = _valid_keys(merged)
    for item in overrides:
        merged = apply_override(merged, item, valid)
    return _to_config(merged)


CONFIG_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def load_config(name_or_path: str, overrides: Sequence[str] = ()) -> Config:
    """A preset by name, or a YAML / JSON config file (see the module docstring), with `key=value`
    overrides applied last; every value type-checked, every error naming the file and key."""
    if name_or_path in PRESETS:
        return get_config(name_or_path, overrides)
    looks_like_file = name_or_path.lower().endswith(CONFIG_FILE_SUFFIXES) or os.sep in name_or_path
    if not looks_like_file:
        raise ConfigError(
            f"unknown preset {name_or_path!r}; presets: {sorted(PRESETS)}, or a config file "
            f"({' '.join(CONFIG_FILE_SUFFIXES)})"
        )
    fields = _read_config_file(name_or_path)
    name = fields.pop("name", None)
    if name is None:
        log.info("%s has no 'name:': extending the tiny preset", name_or_path)
        name = "tiny"
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(
            f"{name_or_path}: name={name!r} must name the preset the file extends; presets: {sorted(PRESETS)}"
        )
    base = OmegaConf.structured(PRESETS[name]())
    try:
        merged = OmegaConf.merge(base, OmegaConf.create(fields))
    except OmegaConfBaseException as e:
        key = str(getattr(e, "full_key", None) or "")
        valid = _valid_keys(base)
        if key and key not in valid and not any(k.startswith(key + ".") for k in valid):
            raise ConfigError(f"{name_or_path}: {_unknown_key(key, valid)}") from None
        expected = _expected(_field_type(key)) if key else None
        detail = f"expected {expected}" if expected else str(e).splitlines()[0]
        raise ConfigError(f"{name_or_path}: {key + ': ' if key else ''}{detail}") from None
    try:
        _to_config(merged)  # the file alone must make a valid config: its errors name the file
    except ConfigError as e:
        raise ConfigError(f"{name_or_path}: {e}") from None
    return _apply_overrides(merged, overrides)


def _read_config_file(path: str) -> dict[str, Any]:
    """The fields of a YAML or JSON config file as a plain dict; an empty or binary file is an error
    naming it (an empty one would otherwise start a run of the tiny preset)."""
    if not os.path.isfile(path):
        raise ConfigError(
            f"config file {path!r} does not exist"
            if not os.path.exists(path)
            else f"config file {path!r} is not a file"
        )
    import yaml  # omegaconf's own dependency

    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path!r} is not a text file (byte {raw[e.start]:#04x} at offset {e.start} is not UTF-8)"
        ) from None
    is_json = path.lower().endswith(".json")
    try:
        if is_json:  # json: YAML 1.1 would read 1e-05 as a string
            fields = json.loads(text) if text.strip() else None
        else:
            fields = OmegaConf.to_container(OmegaConf.load(io.StringIO(text)))
    except (json.JSONDecodeError, yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(
            f"config file {path!r} is not valid {'JSON' if is_json else 'YAML'}: {' '.join(str(e).split())}"
        ) from None
    if not fields:
        raise ConfigError(f"config file {path!r} is empty: give at least the preset it extends ('name: tiny')")
    if not isinstance(fields, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of config sections, got a {type(fields).__name__}")
    return fields


def config_yaml(cfg: Config) -> str:
    """A config as YAML, loadable by `load_config` (what `dsv-jax presets --show NAME` prints)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# Fields that change how a model runs but not its parameters: a checkpoint restores across them.
RUNTIME_FIELDS = frozenset(
    {"model.adaln_impl", "model.dtype", "model.remat", "model.remat_keep_attention", "model.scan_layers"}
)


def architecture_diff(a: Config, b: Config) -> list[tuple[str, Any, Any]]:
    """Parameter-shaping fields (model.*, text.*) that differ, as (key, a_value, b_value)."""
    diffs = []
    for section in ("model", "text"):
        da, db = getattr(a, section), getattr(b, section)
        for f in dataclasses.fields(da):
            key = f"{section}.{f.name}"
            if key not in RUNTIME_FIELDS and getattr(da, f.name) != getattr(db, f.name):
                diffs.append((key, getattr(da, f.name), getattr(db, f.name)))
    if a.predictor_rank != b.predictor_rank:  # the DSV predictor's parameters live in the blocks
        diffs.append(("DSV predictor rank (attention=dsv, dsv.rank)", a.predictor_rank, b.predictor_rank))
    return diffs
