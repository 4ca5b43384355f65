"""The embedded dataset: procedurally drawn videos of moving shapes, with captions that describe them.

Nothing is downloaded. Sample (seed, key) is a pure function of its arguments: the same on every host
and after every restart. Each clip shows one coloured shape on a dark background moving in a
direction (or still, for images, T = 1); its caption names the size, colour, shape and motion, e.g.
"a small red circle moving left". Frames are RGB in [-1, 1], the latent space of the pixel codec.

`SyntheticFeed` streams an embedded dataset (these shapes, or another renderer such as the photos of
`data/photos.py`) as bucketed batches; `dsv_jax.data.feed.SOURCES` opens it for data.source=synthetic
and photos.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from dsv_jax.config import Config
from dsv_jax.data.bucketing import batch_rule, tokens_per_sample, warn_over_memory
from dsv_jax.data.text import tokenize_batch

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
# What `dsv-jax sample` draws without --prompt for a model trained on the shapes.
PROMPTS = (
    "a large red circle moving right",
    "a small yellow square moving down",
    "a large white triangle moving left",
    "a small cyan ring moving up",
)


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


class SyntheticFeed:
    """An embedded dataset as an infinite, deterministic stream of bucketed batches (a `data.feed.Feed`).

    Step s draws its bucket from (seed, s) and renders sample j of that step from (seed, s, j) with
    `renderer(seed, key, shape) -> (frames, caption)` (default: the shapes' `render`): the position in the
    stream is the whole state, and every host computes the same bucket schedule. The eval split renders
    samples of another seed, never trained on.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        batch_multiple: int = 1,
        process_index: int = 0,
        process_count: int = 1,
        split: str = "train",
        renderer: Callable | None = None,
    ):
        if renderer is None and cfg.data.resolved_source != "synthetic":
            raise ValueError(
                f"SyntheticFeed draws the shapes unless given renderer=; data.source={cfg.data.source} opens "
                "with dsv_jax.data.feed.make_feed(cfg)"
            )
        self.cfg = cfg
        self.shapes = [tuple(s) for s in cfg.data.buckets]
        weights = np.asarray(cfg.data.bucket_weights, np.float64)
        self.probs = weights / weights.sum()
        self.seed = cfg.data.seed + (0 if split == "train" else 1_000_003)
        self.heldout = split == "eval"
        self.batch_multiple = max(batch_multiple, process_count)
        self.process_index, self.process_count = process_index, process_count
        self.position = 0
        for shape in self.shapes:
            if any(s % p for s, p in zip(shape, cfg.model.patch)):
                raise ValueError(f"data.buckets entry {shape} is not divisible by model.patch {cfg.model.patch}")
        self.rule = batch_rule(cfg.data, self.batch_multiple)
        self.render = render if renderer is None else renderer
        if split == "train":
            seq = {"x".join(map(str, s)): tokens_per_sample(s, cfg.model.patch) for s in self.shapes}
            warn_over_memory(self.rule, seq)

    def batch_size(self, shape) -> int:
        return self.rule(tokens_per_sample(shape, self.cfg.model.patch))

    def bucket_at(self, position: int) -> tuple[int, int, int]:
        rng = np.random.default_rng([self.seed, position, 0x5EED])
        return self.shapes[int(rng.choice(len(self.shapes), p=self.probs))]

    def batch_at(self, position: int, shape=None) -> dict[str, np.ndarray]:
        shape = shape or self.bucket_at(position)
        b = self.batch_size(shape)
        per_host = b // self.process_count
        rows = range(self.process_index * per_host, (self.process_index + 1) * per_host)
        clips = [self.render(self.seed, (position, j), shape) for j in rows]
        latents = np.stack([c[0] for c in clips])
        ids, mask = tokenize_batch([c[1] for c in clips], self.cfg.text.max_len, self.cfg.text.hash_buckets)
        return {"latents": latents, "text_ids": ids, "text_mask": mask}

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    def get_state(self) -> dict:
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        self.position = int(state["position"])

    def close(self) -> None:
        pass  # nothing runs in the background
