"""Model FLOPs of TextToVideo (for MFU) and the peak FLOP/s of a device.

Counted: every matrix product of a forward, at 2 FLOPs per multiply-add (elementwise work, norms,
softmax and gathers are left out, as MFU conventionally does). For B samples of S video tokens (the
token grid the model computes: padded to whole tiles where a block needs tiles, see `forward_flops`), L text
tokens (text.max_len), C hidden, F MLP width, H heads x D, P patch dim and Dt the text embedding width, a forward is

    conditioning  2 B (256 C + C^2)  timestep MLP    + 2 B L (Dt C + C^2)  text projection
                  + 2 B C 6C per block and 2 B C 2C final (per_block AdaLN) | 2 B C 8C (adaLN-single)
                  [MMDiT: + 2 B C^2 pooled text, adaLN-single 2 B C 14C, and 2 B C 6C text modulation]
    embed, head   2 B S P C + 2 B S C P
    DiT block     2 B S C (3C + C)  self q,k,v,out   + 2 B S C (C + C) + 2 B L C 2C  cross q,out; k,v
                  + 2 B S C F 2  MLP
                  video attention 4 B S^2 C kept (q k^T and p v over the kept keys), text 4 B S L C
    MMDiT block   2 B (S + L) C 4C  q,k,v,out of both streams  + 2 B C 2 (S F + L Ft)  MLPs
                  video attention 4 B S^2 C kept; text part of the joint attention 4 B C (2 S L + L^2)
    DSV (training) predictor 2 B S C 2 H r (W_Q^lr, W_K^lr) + 2 B H Q S (D + r) true and predicted logits
                  of Q sampled queries; selection 2 B H (S / q_tile) (S / kv_block) r, plus the projections
                  on a step that does not train the predictor

`kept` is the share of the video keys a block attends to (1 = dense; a sparse block's selected KV
blocks / all). A train step is

    dense-equivalent (model FLOPs)  3 x the dense forward (forward + backward = 2 x forward), no DSV
    work done                       (3 + R) x (linear + text attention) + (3.5 + R) x kept video
                                    attention + (3 + R) x predictor + 1 x selection

with R = 1 when blocks are rematerialised (model.remat: one more forward) and 0 otherwise (the
recomputed forward keeps the selection: `dsv_jax.model.attention.remat_policy`), and R = 0 for the
video attention with model.remat_keep_attention (the remat keeps the flash kernels' output and statistics); an
attention backward recomputes the scores (flash attention: 2.5 x its forward). MFU = FLOPs per second
per device / the device's dense bf16 peak (`peak_flops`; None on CPUs and unknown devices).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from dsv_jax.config import Config
from dsv_jax.dsv.plan import AttentionPlan, DSVPlan
from dsv_jax.dsv.predictor import sample_positions
from dsv_jax.model.size import parameter_count  # noqa: F401  (re-exported: callers count parameters here)
from dsv_jax.model.tokens import grid_shape, token_layout

# Dense bf16 tensor-core peak (FLOP/s) by a substring of jax's device_kind, first match wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),  # also GH200
    ("H800", 989.4e12),
    ("A100", 312e12),
    ("A800", 312e12),
)
PEAK_ENV = "DSV_JAX_PEAK_TFLOPS"  # a device's peak in TFLOP/s where the table has none


def peak_flops(device_kind: str, platform: str = "gpu") -> float | None:
    """Dense bf16 peak FLOP/s of a device (by jax's `device.device_kind`), or None where unknown (CPU)."""
    if os.environ.get(PEAK_ENV):
        return float(os.environ[PEAK_ENV]) * 1e12
    if platform == "cpu":
        return None
    return next((peak for name, peak in PEAK_BF16_FLOPS if name.lower() in device_kind.lower()), None)


# An attention's forward and backward over its forward: the backward recomputes the scores (flash
# attention), so 1 + 2.5 products of the forward's two.
ATTENTION_FWD_BWD = 3.5


def attention_flops(seq: float, heads: int, head_dim: int, keys_per_query: float, batch: int = 1) -> float:
    """FLOPs of one attention forward: q k^T and p v over `keys_per_query` keys for each of `seq` queries
    (x ATTENTION_FWD_BWD for forward and backward)."""
    return 4.0 * batch * seq * heads * head_dim * keys_per_query


def layout_of(cfg: Config, shape: Sequence[int], tiles: bool = True):
    """The token layout the model computes on: its 3D tiles where some block needs them (`dsv_jax.dsv.plan.tiled`),
    else raster order, unpadded."""
    return token_layout(grid_shape(tuple(shape), cfg.model.patch), cfg.model.tile if tiles else (1, 1, 1))


def _per_block(kept, depth: int) -> np.ndarray:
    kept = np.broadcast_to(np.asarray(kept, np.float64), (depth,))
    if np.any(kept < 0) or np.any(kept > 1):
        raise ValueError(f"kept fractions must be in [0, 1], got {kept}")
    return kept


def forward_flops(
    cfg: Config,
    shape: Sequence[int],
    batch: int = 1,
    *,
    kept: float | Sequence[float] = 1.0,
    predictor: bool = False,
    tiles: bool | None = None,
) -> dict[str, float]:
    """FLOPs of one forward of TextToVideo on `batch` samples of latent `shape` (T, H, W), by part:
    linear, video_attention (at `kept`, a fraction or one per block), video_attention_dense,
    text_attention, selection (a DSV model: its block scores) and, with `predictor` (a step that trains the
    DSV predictors), predictor. tiles: whether the tokens lie in the model's tiles (padded where the grid
    does not divide); None: as the model lays them out for such a step (tiled where it trains the predictor
    or some block attends sparsely, raster order where every block is dense)."""
    m, b = cfg.model, float(batch)
    if tiles is None:
        tiles = predictor or bool(np.any(_per_block(kept, m.depth) < 1))
    layout = layout_of(cfg, shape, tiles)
    s, lt, c, depth = float(layout.seq_len), float(cfg.text.max_len), float(m.hidden), m.depth
    f = float(m.mlp_hidden)
    mmdit, per_block = m.arch == "mmdit", m.adaln == "per_block"

    cond = 2 * b * (256 * c + c * c) + 2 * b * lt * (m.text_dim * c + c * c)
    if mmdit:
        cond += 2 * b * c * c
    if per_block:
        cond += 2 * b * c * 6 * c * depth * (2 if mmdit else 1) + 2 * b * c * 2 * c
    else:
        cond += 2 * b * c * m.shared_modulation_rows * c
    embed = 2 * b * s * m.patch_dim * c * 2  # patch embedding and final projection
    if mmdit:
        ft = float(m.text_mlp_hidden)
        block_linear = 2 * b * (s + lt) * c * 4 * c + 2 * b * c * 2 * (s * f + lt * ft)
        text_attention = 4 * b * c * (2 * s * lt + lt * lt)
    else:
        block_linear = 2 * b * s * c * 6 * c + 2 * b * lt * c * 2 * c + 2 * b * s * c * f * 2
        text_attention = 4 * b * s * lt * c
    video_dense = attention_flops(s, m.heads, m.head_dim, s, b)
    out = {
        "linear": cond + embed + depth * block_linear,
        "video_attention": float(video_dense * _per_block(kept, depth).sum()),
        "video_attention_dense": depth * video_dense,
        "text_attention": depth * text_attention,
        "predictor": 0.0,
        "selection": 0.0,
    }
    if cfg.predictor_rank:
        r, h, d = float(cfg.predictor_rank), float(m.heads), float(m.head_dim)
        projections = depth * 2 * b * s * c * 2 * h * r  # q_lr, k_lr
        if predictor:
            q = float(len(sample_positions(layout.n_real, cfg.dsv.query_stride, cfg.dsv.max_queries)))
            out["predictor"] = projections + depth * 2 * b * h * q * s * (d + r)
        # the selection's block scores (counted by train_step_flops where a block attends sparsely), and the
        # projections on a step that does not train the predictor (they then serve the selection alone)
        plan = DSVPlan(kv_block=cfg.dsv.kv_block)
        kv_block = plan.kv_block_for(layout)
        if tiles and not layout.padded and layout.seq_len % kv_block == 0:
            out["selection"] = depth * 2 * b * h * (s // plan.q_tile_for(layout)) * (s // kv_block) * r
            if not predictor:
                out["selection"] += projections
    return out


def train_step_flops(
    cfg: Config,
    shape: Sequence[int],
    batch: int = 1,
    *,
    kept: float | Sequence[float] = 1.0,
    predictor: bool | None = None,
    selection: bool | None = None,
    tiles: bool | None = None,
) -> dict[str, float]:
    """{"dense_equiv", "work"} FLOPs of one train step (see the module docstring), the video attention's
    share of the work ("work_video_attention"), and the forward's parts.
    predictor: whether the step trains DSV predictors (default: attention=dsv); selection: whether it
    selects KV blocks (default: some block attends sparsely, i.e. any kept < 1); tiles as `forward_flops`."""
    predictor = cfg.predictor_rank > 0 if predictor is None else predictor
    fwd = forward_flops(cfg, shape, batch, kept=kept, predictor=predictor, tiles=tiles)
    if selection is None:
        selection = bool(np.any(_per_block(kept, cfg.model.depth) < 1))
    r = 1.0 if cfg.model.remat else 0.0
    # the remat keeps the flash kernels' video attention outputs (cross attention is recomputed); assumes
    # those kernels run (cuDNN, the sparse ones): XLA's dense attention recomputes either way
    r_attention = 0.0 if cfg.model.remat_keep_attention else r
    dense = 3 * (fwd["linear"] + fwd["video_attention_dense"] + fwd["text_attention"])
    work = (
        (3 + r) * (fwd["linear"] + fwd["text_attention"])
        + (ATTENTION_FWD_BWD + r_attention) * fwd["video_attention"]
        + (3 + r) * fwd["predictor"]
        + fwd["selection"] * selection
    )
    return {
        "dense_equiv": dense,
        "work": work,
        "work_video_attention": (ATTENTION_FWD_BWD + r_attention) * fwd["video_attention"],
        **{f"forward_{k}": v for k, v in fwd.items()},
    }


def kept_fractions(cfg: Config, shape: Sequence[int], plans: Any, inputs: dict | None = None) -> list[float]:
    """Per block, the share of the video keys its attention computes under `plans` (a backend name,
    one plan, or one per block) and the runtime `inputs` (DSV per-head keep ratios [depth, H])."""
    depth = cfg.model.depth
    plans = list(plans) if isinstance(plans, (list, tuple)) else [plans] * depth
    layout = layout_of(cfg, shape)
    keep = None if inputs is None or "keep" not in inputs else np.asarray(inputs["keep"], np.float64)
    return [
        plan.kept_fraction(layout, None if keep is None else keep[i]) if isinstance(plan, AttentionPlan) else 1.0
        for i, plan in enumerate(plans)
    ]


def mfu_metrics(dense_equiv: float, work: float, seconds: float, devices: int, peak: float | None) -> dict[str, float]:
    """Per-device TFLOP/s of the model (dense-equivalent) and of the work done, and both MFUs where the
    peak is known."""
    if seconds <= 0 or devices < 1:
        return {}
    per_device = 1.0 / (seconds * devices)
    out = {"tflops_per_device": dense_equiv * per_device / 1e12, "tflops_per_device/work": work * per_device / 1e12}
    if peak:
        out["mfu/dense_equiv"] = dense_equiv * per_device / peak
        out["mfu/work"] = work * per_device / peak
    return out
