"""The embedded dataset: procedurally drawn videos of moving shapes, with captions that describe them.

Nothing is downloaded. Sample (seed, key) is a pure function of its arguments: the same on every host
and after every restart. Each clip shows one coloured shape on a dark background moving in a
direction (or still, for images, T = 1); its caption names the size, colour, shape and motion, e.g.
"a small red circle moving left". Frames are RGB in [-1, 1], the latent space of the pixel codec.
"""

from __future__ import annotations

import numpy as np

COLOURS = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 240),
    "yellow": (240, 220, 40),
    "cyan": (40, 220, 230),
    "magenta": (220, 50, 220),
    "white": (240, 240, 240),
    "orange": (250, 140, 20),
}
SHAPES = ("circle", "square", "triangle", "ring", "cross", "diamond")
DIRECTIONS = {"left": (0.0, -1.0), "right": (0.0, 1.0), "up": (-1.0, 0.0), "down": (1.0, 0.0)}


def shape_mask(shape: str, dy: np.ndarray, dx: np.ndarray, r: float) -> np.ndarray:
    """Soft coverage in [0, 1] of `shape` of radius r at offsets (dy, dx) from its centre."""
    ady, adx = np.abs(dy), np.abs(dx)
    if shape == "circle":
        dist = np.sqrt(dy**2 + dx**2) - r
    elif shape == "square":
        dist = np.maximum(ady, adx) - 0.8 * r
    elif shape == "diamond":
        dist = (ady + adx) / np.sqrt(2) - 0.75 * r
    elif shape == "ring":
        dist = np.abs(np.sqrt(dy**2 + dx**2) - 0.75 * r) - 0.28 * r
    elif shape == "cross":
        arm = 0.3 * r
        dist = np.minimum(np.maximum(ady - r, adx - arm), np.maximum(ady - arm, adx - r))
    elif shape == "triangle":  # pointing up, centred
        dist = np.maximum(dy - 0.6 * r, (-dy * 0.5 + adx * 0.866) - 0.45 * r)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return np.clip(0.5 - dist, 0.0, 1.0)


def render(seed: int, key: tuple[int, ...], shape: tuple[int, int, int]) -> tuple[np.ndarray, str]:
    """The clip for (seed, key) at latent shape (T, H, W): (frames float32 [T, H, W, 3] in [-1, 1], caption)."""
    t, h, w = shape
    rng = np.random.default_rng([seed, *key])
    colour = list(COLOURS)[rng.integers(len(COLOURS))]
    kind = SHAPES[rng.integers(len(SHAPES))]
    large = rng.random() < 0.5
    r = min(h, w) * (0.28 if large else 0.17)
    background = rng.uniform(0.0, 0.15, size=3)
    if t == 1:
        direction, vel = None, np.zeros(2)
    else:
        direction = list(DIRECTIONS)[rng.integers(len(DIRECTIONS))]
        speed = rng.uniform(0.35, 0.6) * np.array([h, w]) / max(t - 1, 1)
        vel = np.array(DIRECTIONS[direction]) * speed
    # Start so that the whole path stays (mostly) inside the frame.
    travel = vel * (t - 1)
    lo = np.maximum(r, r - travel)
    hi = np.maximum(lo + 1, np.array([h, w]) - r - np.maximum(travel, 0))
    start = rng.uniform(lo, hi)
    yy, xx = np.meshgrid(np.arange(h) + 0.5, np.arange(w) + 0.5, indexing="ij")
    centres = start[None] + np.arange(t)[:, None] * vel[None]
    cover = shape_mask(kind, yy[None] - centres[:, 0, None, None], xx[None] - centres[:, 1, None, None], r)
    rgb = np.array(COLOURS[colour]) / 255.0
    frames = background * (1 - cover[..., None]) + rgb * cover[..., None]
    size = "large" if large else "small"
    caption = f"a {size} {colour} {kind}" + (f" moving {direction}" if direction else "")
    return (frames * 2.0 - 1.0).astype(np.float32), caption
