"""VideoDiT: a diffusion transformer on video latents, as DiT (cross-attention to text) or MMDiT.

    latents [B,T,H,W,C] -> patchify (tile-major tokens) -> N x block -> final AdaLN + linear -> unpatchify

    DiT block (Wan-like)                         MMDiT block (SD3-like), video and text streams
      y = AdaLN(x; shift1, scale1)                 y_s = AdaLN(x_s; shift1_s, scale1_s)   per stream s
      h = x + gate1 * SelfAttn(y)                  q, k, v = concat_s QKV_s(y_s)
      h = h + CrossAttn(LN(h), text)               o_s = JointAttn(q, k, v)[s]
      y = AdaLN(h; shift2, scale2)                 h_s = x_s + gate1_s * Out_s(o_s)
      x = h + gate2 * MLP(y)                       x_s = h_s + gate2_s * MLP_s(AdaLN(h_s; shift2_s, scale2_s))

The gated residual and the AdaLN that follows it are one call (`gated_modulate`), which the fused
kernel implements in one pass. Blocks are created stacked (a leading layer axis on every parameter),
so the forward can `lax.scan` over them (one compiled block) or loop over them when blocks need
different static attention plans; checkpoints are the same either way.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dsv_jax.attention.rope import apply_rope, rotary
from dsv_jax.config import ModelConfig
from dsv_jax.dsv.plan import as_plan, tiled
from dsv_jax.dsv.predictor import LowRankPredictor
from dsv_jax.model.attention import context_backend, joint_attention, remat_policy
from dsv_jax.model.layers import (
    MLP,
    QKV,
    BlockContext,
    CrossAttention,
    Modulation,
    SelfAttention,
    TimestepEmbedder,
    compute_dtype,
    gated_modulate,
    linear,
    merge_heads,
    modulate,
    position_features,
)
from dsv_jax.model.tokens import patchify, unpatchify


def _predictor(cfg: ModelConfig, rank: int, rope: bool, rngs: nnx.Rngs):
    """The block's DSV predictor (low-rank W_Q^lr, W_K^lr on the attention input), or None."""
    return LowRankPredictor(cfg, rank, rngs, rope=rope) if rank else None


class DiTBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, predictor_rank: int = 0, predictor_rope: bool = True):
        self.cfg = cfg
        self.modulation = Modulation(cfg, 6, rngs)
        self.attn = SelfAttention(cfg, rngs)
        self.cross = CrossAttention(cfg, rngs)
        self.mlp = MLP(cfg, cfg.mlp_hidden, rngs)
        if cfg.cross_norm == "affine":  # the cross-attention norm's learned scale and bias, as (1 + scale, shift)
            self.cross_norm = nnx.Param(jnp.zeros((2, cfg.hidden), jnp.float32))
        self.predictor = _predictor(cfg, predictor_rank, predictor_rope, rngs)

    def __call__(self, x, ctx: BlockContext, plan, inputs=None):
        """-> (x, aux); aux: the attention plan's DSV outputs (predictor loss, profile statistics)."""
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.unstack(self.modulation(ctx.cond), axis=1)
        y = modulate(x, scale1, shift1, self.cfg)
        o, aux = self.attn(y, ctx, plan, self.predictor, inputs)
        cross_scale, cross_shift = self._cross_norm(scale1)
        h, y = gated_modulate(x, o, gate1, cross_scale, cross_shift, self.cfg)
        h = h + self.cross(y, ctx, plan)
        y = modulate(h, scale2, shift2, self.cfg)
        return h + (gate2[:, None] * self.mlp(y)).astype(h.dtype), aux

    def _cross_norm(self, like):
        """(scale, shift) [B, D] of the norm before cross-attention: none, or its learned affine."""
        if self.cfg.cross_norm == "plain":
            return jnp.zeros_like(like), jnp.zeros_like(like)
        scale, shift = self.cross_norm[...]
        return jnp.broadcast_to(scale, like.shape), jnp.broadcast_to(shift, like.shape)


class MMDiTBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, predictor_rank: int = 0, predictor_rope: bool = True):
        self.cfg = cfg
        self.mod_video, self.mod_text = Modulation(cfg, 6, rngs), Modulation(cfg, 6, rngs)
        self.qkv_video, self.qkv_text = QKV(cfg, rngs), QKV(cfg, rngs)
        self.out_video = linear(cfg.hidden, cfg.hidden, cfg, rngs)
        self.out_text = linear(cfg.hidden, cfg.hidden, cfg, rngs)
        self.mlp_video = MLP(cfg, cfg.mlp_hidden, rngs)
        self.mlp_text = MLP(cfg, cfg.text_mlp_hidden, rngs)
        self.predictor = _predictor(cfg, predictor_rank, predictor_rope, rngs)  # video tokens only

    def __call__(self, x, ctx: BlockContext, plan, inputs=None):
        xv, xt = x
        mv = jnp.unstack(self.mod_video(ctx.cond), axis=1)
        mt = jnp.unstack(self.mod_text(ctx.text_cond), axis=1)
        yv = modulate(xv, mv[1], mv[0], self.cfg)
        qv, kv, vv = self.qkv_video(yv)
        qt, kt, vt = self.qkv_text(modulate(xt, mt[1], mt[0], self.cfg))
        qv, kv = apply_rope(qv, ctx.rope), apply_rope(kv, ctx.rope)
        ov, ot, aux = joint_attention((qv, kv, vv), (qt, kt, vt), ctx, plan, yv, self.predictor, inputs)
        hv, yv = gated_modulate(xv, self.out_video(merge_heads(ov)), mv[2], mv[4], mv[3], self.cfg)
        ht, yt = gated_modulate(xt, self.out_text(merge_heads(ot)), mt[2], mt[4], mt[3], self.cfg)
        xv = hv + (mv[5][:, None] * self.mlp_video(yv)).astype(hv.dtype)
        xt = ht + (mt[5][:, None] * self.mlp_text(yt)).astype(ht.dtype)
        return (xv, xt), aux


class FinalLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.modulation = Modulation(cfg, 2, rngs)
        self.proj = linear(cfg.hidden, cfg.patch_dim, cfg, rngs, zero_init=True)

    def __call__(self, x, cond):
        shift, scale = jnp.unstack(self.modulation(cond), axis=1)
        return self.proj(modulate(x, scale, shift, self.cfg))


class VideoDiT(nnx.Module):
    """velocity = model(latents [B,T,H,W,C], timesteps [B] (or one for all: a Python float) in [0,1],
    text [B,L,Dt], text_mask [B,L])."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, predictor_rank: int = 0, predictor_rope: bool = True):
        """predictor_rank > 0 gives every block a DSV low-rank predictor (attention=dsv)."""
        self.cfg = cfg
        d = cfg.hidden
        self.patch_embed = linear(cfg.patch_dim, d, cfg, rngs)
        self.time_embed = TimestepEmbedder(cfg, rngs)
        self.text_in = linear(cfg.text_dim, d, cfg, rngs)
        self.text_mlp = linear(d, d, cfg, rngs)
        mmdit = cfg.arch == "mmdit"
        if mmdit:
            self.pooled_text = linear(d, d, cfg, rngs, dtype=jnp.float32)
        if cfg.adaln == "single":  # the shared projection of adaLN-single (video, text, final)
            self.shared_mod = linear(d, cfg.shared_modulation_rows * d, cfg, rngs, zero_init=True, dtype=jnp.float32)
        block_cls = MMDiTBlock if mmdit else DiTBlock

        @nnx.split_rngs(splits=cfg.depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return block_cls(cfg, rngs, predictor_rank, predictor_rope)

        self.blocks = make_blocks(rngs)
        self.final = FinalLayer(cfg, rngs)

    def __call__(
        self,
        latents,
        timesteps,
        text,
        text_mask,
        *,
        attention: Any | Sequence[Any] = "auto",
        attention_inputs=None,
        return_aux: bool = False,
        time_scale: float = 1000.0,
    ):
        """`time_scale`: the timestep embedding sees time_scale x timesteps (1000: timesteps in [0, 1]; 1:
        timesteps already in [0, 1000], as diffusers' Wan takes them, so that they reach it unrounded).
        `attention`: the video self-attention backend name or AttentionPlan for every block, or one
        per block. `attention_inputs`: runtime arrays of the plans with a leading block axis (DSV's
        per-head keep ratios). With `return_aux`, returns (velocity, aux): the blocks' DSV outputs
        stacked over blocks (predictor loss [depth], profile statistics [depth, H, ...])."""
        cfg = self.cfg
        dtype = compute_dtype(cfg)
        if latents.ndim != 5 or latents.shape[-1] != cfg.in_channels:
            raise ValueError(f"latents must be [B, T, H, W, {cfg.in_channels}], got {latents.shape}")
        if text.ndim != 3 or text.shape[-1] != cfg.text_dim or text_mask.shape != text.shape[:2]:
            raise ValueError(
                f"text must be [B, L, {cfg.text_dim}] with text_mask [B, L]; got {text.shape}, {text_mask.shape}"
            )
        b = latents.shape[0]
        timesteps = jnp.asarray(timesteps, jnp.float32)
        if timesteps.ndim > 1 or timesteps.size not in (1, b):
            raise ValueError(f"timesteps must be one value or [B={b}] values, got shape {timesteps.shape}")
        timesteps = jnp.broadcast_to(timesteps.reshape(-1), (b,))
        cp = context_backend(attention[0] if isinstance(attention, (list, tuple)) else attention)
        # Tiles serve sparse attention (query tiles, KV blocks); where every block attends densely, tokens stay
        # in raster order, so a grid that does not divide into tiles is not padded: dense attention would
        # spend time on the padding (Wan at 480p: 15% more tokens, 32% more attention).
        tile = cfg.tile if tiled(attention) else (1, 1, 1)
        # context parallelism: every device holds whole tiles, and the tokens stay sharded over the sequence
        tokens, layout = patchify(latents.astype(dtype), cfg.patch, tile, cp.token_multiple if cp else 1)
        x = self.patch_embed(tokens)
        if cfg.absolute_position:
            x = x + position_features(layout.coords, cfg.hidden).astype(x.dtype)
        if cp is not None:
            x = cp.constrain(x)

        if cfg.text_mask:
            text_lens = jnp.sum(text_mask.astype(jnp.int32), axis=1)
        else:  # every text position is attended (Wan: its encoder's zero-filled tail too)
            text_lens = jnp.full((b,), text.shape[1], jnp.int32)
        txt = self.text_mlp(nnx.gelu(self.text_in(text.astype(dtype)), approximate=True))
        c = self.time_embed(timesteps, time_scale)
        ctx = BlockContext(
            cond=c,
            text=txt,
            text_lens=text_lens,
            rope=rotary(layout.coords, cfg.head_dim, cfg.rope_theta),
            n_real=layout.n_real,
            layout=layout,
        )
        if cfg.arch == "mmdit":
            mask = text_mask.astype(jnp.float32)[..., None]
            pooled = jnp.sum(txt.astype(jnp.float32) * mask, 1) / jnp.maximum(jnp.sum(mask, 1), 1.0)
            c = c + self.pooled_text(pooled)
            ctx.cond = c
        final_cond = c
        if cfg.adaln == "single":
            shared = self.shared_mod(nnx.silu(c)).reshape(b, -1, cfg.hidden)
            # rows: video 0:6, then the final layer's 2 (unless it takes the timestep embedding itself, as
            # Wan's head does), then MMDiT's text stream 6
            ctx.cond, rest = shared[:, :6], shared[:, 6:]
            if cfg.final_modulation == "timestep":
                final_cond = c[:, None]
            else:
                final_cond, rest = rest[:, :2], rest[:, 2:]
            ctx.text_cond = rest if cfg.arch == "mmdit" else None
        else:
            ctx.text_cond = c

        h = (x, txt) if cfg.arch == "mmdit" else x
        h, aux = self._run_blocks(h, ctx, attention, attention_inputs)
        x = h[0] if cfg.arch == "mmdit" else h
        out = self.final(x, final_cond)
        velocity = unpatchify(out, layout, cfg.patch, cfg.in_channels).astype(latents.dtype)
        return (velocity, aux) if return_aux else velocity

    def _run_blocks(self, h, ctx, attention, inputs=None):
        """-> (h, aux): aux is each block's output dict stacked over blocks (scan ys, or stacked by hand)."""
        cfg = self.cfg
        plans = list(attention) if isinstance(attention, (list, tuple)) else [attention] * cfg.depth
        if len(plans) != cfg.depth:
            raise ValueError(f"got {len(plans)} attention plans for {cfg.depth} blocks")
        plans = [as_plan(p) for p in plans]
        graphdef, stacked = nnx.split(self.blocks)

        def run(h, layer_state, plan, layer_inputs):
            return nnx.merge(graphdef, layer_state)(h, ctx, plan, layer_inputs)

        policy = remat_policy(cfg.remat_keep_attention)
        if cfg.scan_layers and all(p == plans[0] for p in plans):

            def body(h, xs):
                layer_state, layer_inputs = xs
                return run(h, layer_state, plans[0], layer_inputs)

            if cfg.remat:
                body = jax.checkpoint(body, prevent_cse=False, policy=policy)
            return jax.lax.scan(body, h, (stacked, inputs))
        step = jax.checkpoint(run, static_argnums=(2,), policy=policy) if cfg.remat else run
        auxes = []
        for i, plan in enumerate(plans):
            layer = jax.tree.map(lambda a: a[i], (stacked, inputs))
            h, aux = step(h, layer[0], plan, layer[1])
            auxes.append(aux)
        if any(a.keys() != auxes[0].keys() for a in auxes):
            raise ValueError(f"attention plans return different outputs per block: {[sorted(a) for a in auxes]}")
        return h, jax.tree.map(lambda *a: jnp.stack(a), *auxes)
