"""Where each Wan 2.1 tensor lives in our parameters, and back (numpy only; no jax, no torch).

Wan checkpoints come in two layouts that hold the same tensors under different names: diffusers'
`WanTransformer3DModel` (`blocks.N.attn1.to_q.weight`, ...) and the original release's `WanModel`
(`blocks.N.self_attn.q.weight`, ...). `original_name` maps the first to the second; everything else here
speaks diffusers' names.

Our parameters differ from Wan's in four ways besides names, each undone exactly on export:
- torch's Linear stores W [out, in]; flax's kernel is W^T [in, out].
- Wan's q / k / v (and cross-attention's k / v) are separate; ours are one fused projection each.
- Wan rotates adjacent channel pairs (2i, 2i + 1) of each RoPE part; we rotate the part's two halves
  (i, i + half; dsv_jax.attention.rope). Permuting the output channels of the self-attention's q and k
  projections (and their RMSNorm scales) inside every head turns one into the other; q . k is unchanged
  because q and k get the same permutation, and RMSNorm over all heads does not see the order.
- The cross-attention norm's weight w is stored as AdaLN's (1 + scale): scale = w - 1.
The patch embedding is a Conv3d with stride = kernel = patch, i.e. a Linear on (pt, ph, pw, C)-ordered
patches, which is how dsv_jax.model.tokens.patchify flattens them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from dsv_jax.attention.rope import axis_dims
from dsv_jax.config import ModelConfig

# -------------------------------------------------------------------------------------------------
# names


_ORIGINAL_NAMES = (  # diffusers -> original release; applied in order
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
    (r"\.attn1\.", ".self_attn."),
    (r"\.attn2\.", ".cross_attn."),
    (r"\.to_(q|k|v)\.", r".\1."),
    (r"\.to_out\.0\.", ".o."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
    (r"\.ffn\.net\.2\.", ".ffn.2."),
    (r"^blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation"),
    (r"^blocks\.(\d+)\.norm2\.", r"blocks.\1.norm3."),  # the cross-attention norm: norm3 in the original
)


def original_name(name: str) -> str:
    """The original Wan release's name of the tensor diffusers calls `name`."""
    for pattern, replacement in _ORIGINAL_NAMES:
        name = re.sub(pattern, replacement, name)
    return name


# -------------------------------------------------------------------------------------------------
# tensor transforms (ours <- Wan, and their inverses)


def rope_permutation(cfg: ModelConfig) -> np.ndarray:
    """perm [hidden]: our channel c of the self-attention's q / k holds Wan's channel perm[c]."""
    within, start = [], 0
    for dim in axis_dims(cfg.head_dim):
        half = dim // 2
        within += [start + 2 * j for j in range(half)] + [start + 2 * j + 1 for j in range(half)]
        start += dim
    within = np.asarray(within)
    return np.concatenate([h * cfg.head_dim + within for h in range(cfg.heads)])


def _conv(w):  # Conv3d [D, C, pt, ph, pw] -> Linear [(pt, ph, pw, C), D]
    return w.transpose(2, 3, 4, 1, 0).reshape(-1, w.shape[0])


@dataclass(frozen=True)
class Place:
    """Where one Wan tensor goes: the leaf of our parameters (`path`; per block when `stacked`, the block
    being the {i} of `name`), the part of the (block's) leaf it fills (`index`), and how it converts."""

    name: str  # diffusers' name; "{i}" stands for the block
    path: tuple[str, ...]
    index: tuple = ()
    to_ours: Callable[[np.ndarray], np.ndarray] = lambda w: w
    to_wan: Callable[[np.ndarray], np.ndarray] = lambda x: x
    stacked: bool = True


def places(cfg: ModelConfig) -> list[Place]:
    """Every tensor of a Wan 2.1 text-to-video transformer and where it lives in a VideoDiT configured as
    Wan (model.final_modulation=timestep, cross_norm=affine, qk_norm_scope=all_heads)."""
    d, perm = cfg.hidden, rope_permutation(cfg)
    inverse = np.argsort(perm)
    all_rows = slice(None)

    def linear(name, path, stacked=True, rows=all_rows, cols=None):
        """A torch Linear: kernel = W^T (its rows optionally permuted), bias; `cols`: the kernel columns
        (and bias entries) it fills in a fused projection."""
        at = () if cols is None else (slice(None), cols)
        unrow = (lambda x: x) if rows is all_rows else (lambda x: x[inverse])
        return [
            Place(f"{name}.weight", (*path, "kernel"), at, lambda w: w[rows].T, lambda k: unrow(k.T), stacked),
            Place(f"{name}.bias", (*path, "bias"), () if cols is None else (cols,), lambda b: b[rows], unrow, stacked),
        ]

    def thirds(j):
        return slice(j * d, (j + 1) * d)

    b, attn, cross = "blocks.{i}.", ("blocks", "attn", "qkv"), ("blocks", "cross", "qkv")
    return [
        Place("patch_embedding.weight", ("patch_embed", "kernel"), (), _conv, lambda k: _unconv(k, cfg), False),
        Place("patch_embedding.bias", ("patch_embed", "bias"), stacked=False),
        *linear("condition_embedder.time_embedder.linear_1", ("time_embed", "fc1"), False),
        *linear("condition_embedder.time_embedder.linear_2", ("time_embed", "fc2"), False),
        *linear("condition_embedder.time_proj", ("shared_mod",), False),
        *linear("condition_embedder.text_embedder.linear_1", ("text_in",), False),
        *linear("condition_embedder.text_embedder.linear_2", ("text_mlp",), False),
        Place(b + "scale_shift_table", ("blocks", "modulation", "table"), (), _untable, _table),
        # self-attention: q, k, v fused; q and k rope-permuted (module docstring), with their norm scales
        *linear(b + "attn1.to_q", (*attn, "qkv"), rows=perm, cols=thirds(0)),
        *linear(b + "attn1.to_k", (*attn, "qkv"), rows=perm, cols=thirds(1)),
        *linear(b + "attn1.to_v", (*attn, "qkv"), cols=thirds(2)),
        Place(b + "attn1.norm_q.weight", (*attn, "q_norm", "scale"), (), lambda w: w[perm], lambda s: s[inverse]),
        Place(b + "attn1.norm_k.weight", (*attn, "k_norm", "scale"), (), lambda w: w[perm], lambda s: s[inverse]),
        *linear(b + "attn1.to_out.0", ("blocks", "attn", "out")),
        # cross-attention: k, v fused; no RoPE, so no permutation
        *linear(b + "attn2.to_q", (*cross, "q")),
        *linear(b + "attn2.to_k", (*cross, "kv"), cols=thirds(0)),
        *linear(b + "attn2.to_v", (*cross, "kv"), cols=thirds(1)),
        Place(b + "attn2.norm_q.weight", (*cross, "q_norm", "scale")),
        Place(b + "attn2.norm_k.weight", (*cross, "k_norm", "scale")),
        *linear(b + "attn2.to_out.0", ("blocks", "cross", "out")),
        # the cross-attention norm's weight as AdaLN's (1 + scale)
        Place(b + "norm2.weight", ("blocks", "cross_norm"), (0,), lambda w: w - 1.0, lambda s: s + 1.0),
        Place(b + "norm2.bias", ("blocks", "cross_norm"), (1,)),
        *linear(b + "ffn.net.0.proj", ("blocks", "mlp", "fc1")),
        *linear(b + "ffn.net.2", ("blocks", "mlp", "fc2")),
        Place("scale_shift_table", ("final", "modulation", "table"), (), _untable, _table, False),
        *linear("proj_out", ("final", "proj"), False),
    ]


def _untable(t):  # [1, n, D] -> [n, D]
    return t[0]


def _table(x):
    return x[None]


def _unconv(k, cfg: ModelConfig):
    pt, ph, pw = cfg.patch
    return k.reshape(pt, ph, pw, cfg.in_channels, cfg.hidden).transpose(4, 3, 0, 1, 2)


def tensor_places(cfg: ModelConfig) -> dict[str, tuple[Place, int | None]]:
    """Diffusers' name of every Wan tensor -> (its Place, its block or None)."""
    out = {}
    for place in places(cfg):
        if place.stacked:
            out.update({place.name.format(i=i): (place, i) for i in range(cfg.depth)})
        else:
            out[place.name] = (place, None)
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Diffusers' name -> shape of every tensor of a Wan 2.1 text-to-video transformer configured as `cfg`."""
    d, f, (pt, ph, pw) = cfg.hidden, cfg.mlp_hidden, cfg.patch
    shapes = {
        "patch_embedding.weight": (d, cfg.in_channels, pt, ph, pw),
        "patch_embedding.bias": (d,),
        "condition_embedder.time_embedder.linear_1.weight": (d, 256),
        "condition_embedder.time_embedder.linear_1.bias": (d,),
        "condition_embedder.time_embedder.linear_2.weight": (d, d),
        "condition_embedder.time_embedder.linear_2.bias": (d,),
        "condition_embedder.time_proj.weight": (6 * d, d),
        "condition_embedder.time_proj.bias": (6 * d,),
        "condition_embedder.text_embedder.linear_1.weight": (d, cfg.text_dim),
        "condition_embedder.text_embedder.linear_1.bias": (d,),
        "condition_embedder.text_embedder.linear_2.weight": (d, d),
        "condition_embedder.text_embedder.linear_2.bias": (d,),
        "scale_shift_table": (1, 2, d),
        "proj_out.weight": (cfg.patch_dim, d),
        "proj_out.bias": (cfg.patch_dim,),
    }
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        shapes[b + "scale_shift_table"] = (1, 6, d)
        for attn in ("attn1", "attn2"):
            for x in ("to_q", "to_k", "to_v", "to_out.0"):
                shapes[f"{b}{attn}.{x}.weight"], shapes[f"{b}{attn}.{x}.bias"] = (d, d), (d,)
            shapes[f"{b}{attn}.norm_q.weight"] = shapes[f"{b}{attn}.norm_k.weight"] = (d,)
        shapes[b + "norm2.weight"] = shapes[b + "norm2.bias"] = (d,)
        shapes[b + "ffn.net.0.proj.weight"], shapes[b + "ffn.net.0.proj.bias"] = (f, d), (f,)
        shapes[b + "ffn.net.2.weight"], shapes[b + "ffn.net.2.bias"] = (d, f), (d,)
    return shapes


def _leaf(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def place_tensor(params: dict, name: str, tensor: np.ndarray, where: dict) -> None:
    """Write Wan's tensor `name` into our parameters `params` (nested dict of preallocated numpy leaves);
    `where` = tensor_places(cfg)."""
    place, block = where[name]
    leaf = _leaf(params, place.path)
    target = leaf[block] if block is not None else leaf
    target[place.index] = place.to_ours(np.asarray(tensor, np.float32))


def to_wan(params: dict, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(diffusers name, tensor) of every Wan tensor, from our VideoDiT parameters (a nested pure dict)."""
    for name, (place, block) in tensor_places(cfg).items():
        leaf = np.asarray(_leaf(params, place.path))
        part = (leaf[block] if block is not None else leaf)[place.index]
        yield name, np.ascontiguousarray(place.to_wan(np.asarray(part, np.float32)))
