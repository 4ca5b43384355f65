"""Building blocks of the video DiT: embeddings, AdaLN modulation, attention layers, MLP."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dsv_jax.attention import attention
from dsv_jax.attention.rope import apply_rope, axis_frequencies
from dsv_jax.config import ModelConfig
from dsv_jax.model.attention import context_backend, self_attention
from pallas_kernels.adaln import adaln_modulate, gated_residual_adaln

zeros = nnx.initializers.zeros_init()


def compute_dtype(cfg: ModelConfig):
    if cfg.dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return jnp.dtype(cfg.dtype)


def linear(din: int, dout: int, cfg: ModelConfig, rngs: nnx.Rngs, *, zero_init: bool = False, dtype=None):
    kw = {"kernel_init": zeros, "bias_init": zeros} if zero_init else {}
    return nnx.Linear(din, dout, dtype=dtype or compute_dtype(cfg), param_dtype=jnp.float32, rngs=rngs, **kw)


# The two AdaLN calls of the model. Every block goes through these, so the fused kernel replaces them
# all at once (model.adaln_impl).
def modulate(x, scale, shift, cfg: ModelConfig):
    return adaln_modulate(x, scale, shift, impl=cfg.adaln_impl)


def gated_modulate(residual, branch, gate, scale, shift, cfg: ModelConfig):
    return gated_residual_adaln(residual, branch, gate, scale, shift, impl=cfg.adaln_impl)


def timestep_features(t: jax.Array, dim: int = 256, max_period: float = 10000.0, scale: float = 1000.0) -> jax.Array:
    """Sinusoidal features [cos | sin] of scale x t: t in [0, 1] scaled to [0, 1000] as diffusion models do
    (scale 1: t is already in those units, as diffusers' Wan passes it)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    time = t.astype(jnp.float32) if scale == 1 else scale * t.astype(jnp.float32)
    args = time[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def position_features(coords, dim: int, max_period: float = 10000.0) -> jax.Array:
    """Fixed sin-cos features [S, dim] float32 of token coordinates `coords` [S, 3] (t, h, w), the axes
    splitting the channels as RoPE splits a head (rope.axis_frequencies): sines in the first half, cosines in the
    second. Evaluated in the program from the coordinates (S x 3 numbers), not embedded as a table: at
    2.7B and 128k tokens the table alone would be a 1 GiB constant."""
    angles = jnp.concatenate(
        [
            jnp.asarray(coords, jnp.float32)[:, axis, None] * jnp.asarray(f, jnp.float32)[None]
            for axis, f in enumerate(axis_frequencies(dim, max_period))
        ],
        axis=1,
    )
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=1)


class TimestepEmbedder(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.fc1 = linear(256, cfg.hidden, cfg, rngs, dtype=jnp.float32)
        self.fc2 = linear(cfg.hidden, cfg.hidden, cfg, rngs, dtype=jnp.float32)

    def __call__(self, t, scale: float = 1000.0):
        return self.fc2(nnx.silu(self.fc1(timestep_features(t, scale=scale))))


class Modulation(nnx.Module):
    """Per-sample (shift, scale, gate, ...) vectors [B, n, D] from the conditioning.

    per_block: a zero-initialised Linear on silu(c) [B, D] (DiT's AdaLN-Zero).
    single: the model projects silu(c) once to [B, n, D]; each block adds its own zero-initialised
    table [n, D] (adaLN-single). Either way every gate starts at zero, so each block starts as identity.
    """

    def __init__(self, cfg: ModelConfig, n: int, rngs: nnx.Rngs):
        self.n, self.mode = n, cfg.adaln
        if cfg.adaln == "per_block":
            self.proj = linear(cfg.hidden, n * cfg.hidden, cfg, rngs, zero_init=True, dtype=jnp.float32)
        else:
            self.table = nnx.Param(jnp.zeros((n, cfg.hidden), jnp.float32))

    def __call__(self, cond):
        if self.mode == "per_block":
            out = self.proj(nnx.silu(cond))
            return out.reshape(out.shape[0], self.n, -1)
        return cond + self.table[None]


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, width: int, rngs: nnx.Rngs):
        self.fc1 = linear(cfg.hidden, width, cfg, rngs)
        self.fc2 = linear(width, cfg.hidden, cfg, rngs)

    def __call__(self, x):
        return self.fc2(nnx.gelu(self.fc1(x), approximate=True))


class QKV(nnx.Module):
    """Projections to per-head q, k, v [B, S, H, Dh], with RMS-normalised q and k (stable in bf16): over each
    head's channels, or over all heads' together (model.qk_norm_scope=all_heads, Wan's)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, kv_from: int | None = None):
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.cross = kv_from is not None
        if self.cross:
            self.q = linear(cfg.hidden, cfg.hidden, cfg, rngs)
            self.kv = linear(kv_from, 2 * cfg.hidden, cfg, rngs)
        else:
            self.qkv = linear(cfg.hidden, 3 * cfg.hidden, cfg, rngs)
        self.norm_width = cfg.hidden if cfg.qk_norm_scope == "all_heads" else cfg.head_dim

        def qk_norm():
            if cfg.qk_norm:
                return nnx.RMSNorm(self.norm_width, epsilon=1e-6, dtype=compute_dtype(cfg), rngs=rngs)
            return None

        self.q_norm, self.k_norm = qk_norm(), qk_norm()

    def __call__(self, x, context=None):
        b, s = x.shape[:2]
        if self.cross:
            q = self.q(x).reshape(b, s, self.heads, self.head_dim)
            k, v = jnp.split(self.kv(context).reshape(b, context.shape[1], 2, self.heads, self.head_dim), 2, axis=2)
            k, v = k[:, :, 0], v[:, :, 0]
        else:
            q, k, v = jnp.moveaxis(self.qkv(x).reshape(b, s, 3, self.heads, self.head_dim), 2, 0)
        if self.q_norm is not None:
            q, k = self._norm(self.q_norm, q), self._norm(self.k_norm, k)
        return q, k, v

    def _norm(self, norm, x):
        """x [B, S, H, Dh] normalised over the norm's width: one head's channels, or all heads'."""
        return norm(x.reshape(*x.shape[:-2], -1, self.norm_width)).reshape(x.shape)


def merge_heads(o):
    return o.reshape(o.shape[0], o.shape[1], -1)


class SelfAttention(nnx.Module):
    """Video self-attention: QKV, 3D RoPE, the attention entry point, output projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.qkv = QKV(cfg, rngs)
        self.out = linear(cfg.hidden, cfg.hidden, cfg, rngs)

    def __call__(self, x, ctx: "BlockContext", plan, predictor=None, inputs=None):
        """-> (output, aux): aux holds the DSV predictor loss / profile statistics the plan asks for."""
        q, k, v = self.qkv(x)
        q, k = apply_rope(q, ctx.rope), apply_rope(k, ctx.rope)
        o, aux = self_attention(q, k, v, x, ctx, plan, predictor, inputs)
        return self.out(merge_heads(o)), aux


class CrossAttention(nnx.Module):
    """Video queries attend to the (projected) text tokens; valid text tokens are a prefix."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.qkv = QKV(cfg, rngs, kv_from=cfg.hidden)
        self.out = linear(cfg.hidden, cfg.hidden, cfg, rngs)

    def __call__(self, x, ctx: "BlockContext", plan=None):
        q, k, v = self.qkv(x, ctx.text)
        cp = context_backend(plan)
        if cp is not None:  # context parallelism: per device, on its share of the queries
            o = cp.cross_attention(q, k, v, kv_lens=ctx.text_lens)
        else:
            o = attention(q, k, v, backend="auto", kv_lens=ctx.text_lens)
        return self.out(merge_heads(o))


@dataclasses.dataclass
class BlockContext:
    """What every block needs besides its input (built once per forward, shared by all blocks)."""

    cond: jax.Array  # [B, D] (per_block AdaLN) or [B, n, D] (adaLN-single) conditioning
    text: jax.Array  # [B, L, D] projected text tokens
    text_lens: jax.Array  # [B] valid text tokens (a prefix)
    rope: tuple  # (cos, sin) [S, Dh / 2] of the video tokens' rotary angles (attention.rope.rotary)
    n_real: int  # valid video tokens (static)
    text_cond: jax.Array | None = None  # MMDiT text-stream conditioning
    layout: Any = None  # the TokenLayout (static): grid, tile, coordinates, which positions are padding
