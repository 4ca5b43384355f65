"""Patchify, unpatchify and the tile-major token order.

Latents [B, T, H, W, C] become a token grid (t, h, w) = (T/pt, H/ph, W/pw). Tokens are then
reordered so that every 3D tile of (tt, th, tw) tokens is one contiguous range of the sequence,
tiles in raster order and tokens in raster order inside each tile:

    raster grid (t, h, w)   ->   [tile 0 | tile 1 | ... ]   each tile = tt*th*tw consecutive tokens

Query groups and KV blocks of the sparse kernels are then contiguous ranges, so their loads are
coalesced. The order is a fixed permutation per grid shape (computed once, in numpy), so it costs
one gather on the way in and one on the way out. RoPE uses each token's true (t, h, w) coordinate,
which makes attention independent of the order.

Where a grid dimension is smaller than the tile, the tile shrinks to it (an image has t = 1). Where a
grid does not divide into tiles, it is padded to whole tiles: the edge tiles are partly padding, and
inside every tile the real tokens come first (any order inside a tile is free: RoPE uses the true
coordinates and unpatchify inverts the order). So a KV block of a tile holds its valid keys first, and
one count per block (`kv_valid`) masks the rest in the sparse kernels; dense attention masks keys with
`valid`. `multiple` adds whole padding tiles at the end so that the tile count divides it (context
parallelism: every device holds whole tiles).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class TokenLayout:
    grid: tuple[int, int, int]  # token grid (t, h, w)
    tile: tuple[int, int, int]  # effective tile (never larger than the grid)
    n_real: int  # tokens carrying data
    seq_len: int  # tokens after padding to whole tiles
    order: np.ndarray  # [seq_len] raster index of each sequence position; padding points at n_real
    coords: np.ndarray  # [seq_len, 3] (t, h, w) of each position (padding: its padded-grid coordinate)
    valid: np.ndarray  # [seq_len] bool: the position holds a real token

    @property
    def tile_size(self) -> int:
        return int(np.prod(self.tile))

    @property
    def padded(self) -> bool:
        return self.seq_len != self.n_real

    @functools.cached_property
    def valid_positions(self) -> np.ndarray:
        """Sequence positions of the real tokens, ascending."""
        return np.flatnonzero(self.valid).astype(np.int32)

    def kv_valid(self, kv_block: int) -> np.ndarray:
        """int32 [seq_len // kv_block]: the valid keys of each KV block (they come first in the block)."""
        return self.valid.reshape(-1, kv_block).sum(axis=1).astype(np.int32)


@functools.lru_cache(maxsize=256)
def token_layout(grid: tuple[int, int, int], tile: tuple[int, int, int], multiple: int = 1) -> TokenLayout:
    """Tile-major layout of a token grid (see the module docstring); `multiple`: the tile count is
    padded to a multiple of it with whole padding tiles."""
    grid = tuple(int(g) for g in grid)
    tile = tuple(min(int(t), g) for t, g in zip(tile, grid))
    padded = tuple(-(-g // t) * t for g, t in zip(grid, tile))
    nt = [p // t for p, t in zip(padded, tile)]
    # Coordinates of the padded grid, enumerated tile-major: (tile_t, tile_h, tile_w, in_t, in_h, in_w).
    it = np.indices((nt[0], nt[1], nt[2], tile[0], tile[1], tile[2])).reshape(6, -1)
    coords = np.stack([it[i] * tile[i] + it[i + 3] for i in range(3)], axis=1)
    size = int(np.prod(tile))
    extra = -int(np.prod(nt)) % max(1, int(multiple))
    if extra:  # whole padding tiles, placed after the grid along t
        pad = np.indices((extra, *tile)).reshape(4, -1)
        coords = np.concatenate([coords, np.stack([padded[0] + pad[0] * tile[0] + pad[1], pad[2], pad[3]], 1)])
    valid = np.all(coords < np.array(grid), axis=1)
    # Inside each tile, the real tokens first (stable: raster order within the tile otherwise).
    rank = np.argsort((np.arange(len(coords)) // size) * 2 + ~valid, kind="stable")
    coords, valid = coords[rank], valid[rank]
    n_real = int(valid.sum())
    raster = (coords[:, 0] * grid[1] + coords[:, 1]) * grid[2] + coords[:, 2]
    order = np.where(valid, raster, n_real).astype(np.int32)
    return TokenLayout(
        grid=grid,
        tile=tile,
        n_real=n_real,
        seq_len=len(coords),
        order=order,
        coords=coords.astype(np.int32),
        valid=valid,
    )


def grid_shape(latent_shape: tuple[int, int, int], patch: tuple[int, int, int]) -> tuple[int, int, int]:
    """Token grid of latents of shape (T, H, W); a clear error where the patch does not divide."""
    if any(s % p for s, p in zip(latent_shape, patch)):
        raise ValueError(f"latent shape (T, H, W)={tuple(latent_shape)} is not divisible by patch {tuple(patch)}")
    return tuple(s // p for s, p in zip(latent_shape, patch))


def patchify(latents: jnp.ndarray, patch: tuple[int, int, int], tile: tuple[int, int, int], multiple: int = 1):
    """[B, T, H, W, C] -> (tokens [B, S, pt*ph*pw*C] in tile-major order, layout); padding tokens are zero."""
    b, t, h, w, c = latents.shape
    pt, ph, pw = patch
    gt, gh, gw = grid_shape((t, h, w), patch)
    layout = token_layout((gt, gh, gw), tuple(tile), multiple)
    x = latents.reshape(b, gt, pt, gh, ph, gw, pw, c).transpose(0, 1, 3, 5, 2, 4, 6, 7)
    x = x.reshape(b, gt * gh * gw, pt * ph * pw * c)
    if layout.padded:
        x = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
    return jnp.take(x, jnp.asarray(layout.order), axis=1), layout


def unpatchify(tokens: jnp.ndarray, layout: TokenLayout, patch: tuple[int, int, int], channels: int):
    """Inverse of `patchify`: tokens [B, S, pt*ph*pw*C] -> latents [B, T, H, W, C]."""
    b = tokens.shape[0]
    gt, gh, gw = layout.grid
    pt, ph, pw = patch
    inverse = np.empty(layout.n_real, np.int32)
    inverse[layout.order[layout.valid]] = layout.valid_positions
    x = jnp.take(tokens, jnp.asarray(inverse), axis=1)
    x = x.reshape(b, gt, gh, gw, pt, ph, pw, channels).transpose(0, 1, 4, 2, 5, 3, 6, 7)
    return x.reshape(b, gt * pt, gh * ph, gw * pw, channels)
