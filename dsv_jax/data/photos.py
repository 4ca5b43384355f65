"""The embedded photo dataset (data.source=photos): a camera moving over a real photograph, objects cut
from other photographs moving across it, and a caption that says what moves where.

    frames, caption = render(seed, (step, row), (16, 64, 64))
    caption == "the cat moves right in front of the coin moving up over the brick wall, camera pans down"

The photographs are the sample images inside the scikit-image wheel (`pip install 'dsv-jax[photos]'`;
the files are located with importlib and read with Pillow, scikit-image itself is never imported;
their licences are listed in docs/guide/data.md), or a copy of those files in $DSV_JAX_PHOTOS_DIR. Each clip
draws, from (seed, key) alone:
  * a scene (SCENES), seen through a window that pans left/right/up/down, zooms in/out, or stays still
    (CAMERA); "camera pans left" means the window moves left, so the picture slides right;
  * one or two objects (OBJECTS: an elliptical, rectangular or silhouette cut of a photo), each moving in
    one direction in frame coordinates; the first named is drawn in front of the second (occlusion).
Images (T = 1) have a still camera and still objects. Frames are RGB in [-1, 1] (the pixel codec).

Held-out captions: one in HELD_OUT of the (object, direction, scene) combinations of the first object is
never drawn for training (split="train") and is the only kind drawn for evaluation (split="eval"), so the
held-out loss and the semantic metric (data/semantic.py) see captions the model never trained on.

Cost: photographs are decoded once per process and resized once per frame size (cached); a clip is a
few array slices per frame (pans, stills) or one vectorised bilinear gather (zooms), plus a few slices
per object: ~7 ms for 16 x 64 x 64 pixels, ~20 ms for 16 x 128 x 128 on one CPU core.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

DIRECTIONS = {"left": (0.0, -1.0), "right": (0.0, 1.0), "up": (-1.0, 0.0), "down": (1.0, 0.0)}
CAMERA = ("pans left", "pans right", "pans up", "pans down", "zooms in", "zooms out", "is still")
ZOOM = 0.6  # window size at the tight end of a zoom, relative to the wide end
VIEW = 0.55  # the wide window covers this share of the photograph along its limiting side
HELD_OUT = 8  # one in HELD_OUT (object, direction, scene) combinations is evaluation-only
MAX_SIDE = 640  # photos are kept at most this many pixels on their longer side
MAX_CAPTION_WORDS = 18  # the longest caption (two objects, a two-word scene), without the start token


@dataclass(frozen=True)
class Scene:
    file: str
    tint: tuple[float, float, float] | None = None  # colour given to a grayscale texture


@dataclass(frozen=True)
class Cutout:
    file: str
    box: tuple[int, int, int, int] | None  # (y0, y1, x0, x1) in the photo; None: the whole photo
    cut: str  # ellipse | rect | silhouette (the dark pixels of a black-on-white drawing)
    size: float  # the longer side, as a share of the frame's shorter side
    fill: tuple[str, tuple[int, int, int, int]] | None = None  # a silhouette's texture: (file, box) of a photo


SCENES = {
    "brick wall": Scene("brick.png", tint=(0.80, 0.45, 0.35)),
    "grass": Scene("grass.png", tint=(0.45, 0.80, 0.30)),
    "gravel": Scene("gravel.png"),
    "stars": Scene("hubble_deep_field.jpg"),
    "launch pad": Scene("rocket.jpg"),
    "cells": Scene("ihc.png"),
    "cameraman": Scene("camera.png"),
    "coins": Scene("coins.png"),
}
OBJECTS = {
    "cat": Cutout("chelsea.png", (5, 295, 60, 400), "ellipse", 0.5),
    "cup": Cutout("coffee.png", (10, 395, 70, 485), "ellipse", 0.5),
    "astronaut": Cutout("astronaut.png", (5, 330, 95, 325), "ellipse", 0.5),
    "rocket": Cutout("rocket.jpg", (115, 425, 275, 370), "rect", 0.55),
    "horse": Cutout("horse.png", None, "silhouette", 0.5, fill=("coffee.png", (250, 400, 0, 200))),  # wood grain
    "coin": Cutout("coins.png", (14, 73, 305, 364), "ellipse", 0.3),
    "eye": Cutout("retina.jpg", (10, 1401, 10, 1401), "ellipse", 0.4),
}
PROMPTS = (
    "the cat moves right over the brick wall, camera pans up",
    "the cup moves left over the grass, camera zooms in",
    "the rocket moves up over the stars, camera is still",
    "the horse moves right in front of the coin moving left over the gravel, camera pans left",
)
FILES = sorted({s.file for s in SCENES.values()} | {o.file for o in OBJECTS.values()})
# Caption words the built-in tokenizer must know (data/text.py lists them).
WORDS = sorted(
    {w for name in [*SCENES, *OBJECTS, *CAMERA] for w in name.split()}
    | {"the", "moves", "moving", "in", "front", "of", "over", "camera"}
)


# -- the photographs -----------------------------------------------------------------------------------


def data_dir() -> str:
    """The folder with every photo used here: $DSV_JAX_PHOTOS_DIR if set (a copy of those files, e.g. on a
    machine without scikit-image), else scikit-image's data folder (found without importing scikit-image)."""
    folder = os.environ.get("DSV_JAX_PHOTOS_DIR")
    if not folder:
        spec = importlib.util.find_spec("skimage")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(
                "data.source=photos needs the photos of scikit-image: pip install 'dsv-jax[photos]' "
                "(or pip install scikit-image, or set DSV_JAX_PHOTOS_DIR to a copy of its data folder)"
            )
        folder = os.path.join(list(spec.submodule_search_locations)[0], "data")
    missing = [f for f in FILES if not os.path.exists(os.path.join(folder, f))]
    if missing:
        raise ImportError(f"data.source=photos: {folder} lacks {missing} (scikit-image >= 0.19 ships them)")
    return folder


@functools.lru_cache(maxsize=None)
def _photo(file: str) -> np.ndarray:
    """A photo as float32 RGB [H, W, 3] in [0, 1], at most
    MAX_SIDE pixels on its longer side (frames are far smaller; this bounds memory and resize time)."""
    from PIL import Image

    with Image.open(os.path.join(data_dir(), file)) as img:
        img = img.convert("RGB")
        scale = MAX_SIDE / max(img.size)
        if scale < 1:
            img = img.resize((round(img.width * scale), round(img.height * scale)), Image.Resampling.LANCZOS)
        return np.asarray(img, np.float32) / 255.0


def _resize(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """Antialiased resize of float [H, W, C] in [0, 1] (Pillow's Lanczos, per channel)."""
    from PIL import Image

    chans = [
        np.asarray(Image.fromarray(pixels[..., c]).resize((width, height), Image.Resampling.LANCZOS))
        for c in range(pixels.shape[-1])
    ]
    return np.clip(np.stack(chans, -1), 0.0, 1.0)


@functools.lru_cache(maxsize=64)
def scene_pixels(name: str, height: int, width: int) -> np.ndarray:
    """Scene `name` as RGB float32 [Hp, Wp, 3], scaled so that a height x width window covers VIEW of it."""
    scene = SCENES[name]
    rgb = _photo(scene.file)
    if scene.tint is not None:  # grayscale texture: colour it, keeping highlights
        rgb = np.clip(rgb.mean(-1, keepdims=True) * np.asarray(scene.tint, np.float32) * 1.3, 0.0, 1.0)
    ph, pw = rgb.shape[:2]
    scale = max(height / (VIEW * ph), width / (VIEW * pw))
    return _resize(rgb, max(height + 2, round(ph * scale)), max(width + 2, round(pw * scale))).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _scaled_box(obj: Cutout) -> tuple[int, int, int, int]:
    """The object's box in `_photo` pixels (boxes are given in the file's own pixels)."""
    ph, pw = _photo(obj.file).shape[:2]
    if obj.box is None:
        return 0, ph, 0, pw
    scale = pw / _photo_width(obj.file)
    return tuple(int(round(v * scale)) for v in obj.box)


@functools.lru_cache(maxsize=None)
def _photo_width(file: str) -> int:
    """The file's own width in pixels (boxes are given in these)."""
    from PIL import Image

    with Image.open(os.path.join(data_dir(), file)) as img:
        return img.width


def object_size(name: str, height: int, width: int) -> tuple[int, int]:
    """(h, w) in pixels of object `name` in a height x width frame."""
    obj = OBJECTS[name]
    y0, y1, x0, x1 = _scaled_box(obj)
    bh, bw = y1 - y0, x1 - x0
    long_side = max(2.0, obj.size * min(height, width))
    return max(2, round(long_side * bh / max(bh, bw))), max(2, round(long_side * bw / max(bh, bw)))


@functools.lru_cache(maxsize=256)
def cutout(name: str, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Object `name` as drawn in a height x width frame: (rgb float32 [h, w, 3], alpha float32 [h, w])."""
    obj = OBJECTS[name]
    pixels = _photo(obj.file)
    if obj.box is not None:
        y0, y1, x0, x1 = _scaled_box(obj)
        pixels = pixels[y0:y1, x0:x1]
    if obj.cut == "silhouette":
        alpha = 1.0 - pixels.mean(-1)
        file, (y0, y1, x0, x1) = obj.fill
        scale = _photo(file).shape[1] / _photo_width(file)
        texture = _photo(file)[round(y0 * scale) : round(y1 * scale), round(x0 * scale) : round(x1 * scale)]
        rgb = _resize(texture, *alpha.shape)
    else:
        rgb = pixels
        bh, bw = rgb.shape[:2]
        if obj.cut == "ellipse":
            yy, xx = np.mgrid[:bh, :bw]
            alpha = (((yy + 0.5) / bh - 0.5) ** 2 + ((xx + 0.5) / bw - 0.5) ** 2 <= 0.25).astype(np.float32)
        else:
            alpha = np.ones((bh, bw), np.float32)
    h, w = object_size(name, height, width)
    out = _resize(np.concatenate([rgb, alpha[..., None]], -1).astype(np.float32), h, w)
    return out[..., :3].astype(np.float32), out[..., 3].astype(np.float32)


# -- what a clip shows ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mover:
    name: str
    direction: str | None  # None: still (images)
    start: tuple[float, float]  # top-left corner at frame 0 (pixels)
    velocity: tuple[float, float]  # pixels per frame


@dataclass(frozen=True)
class Clip:
    scene: str
    camera: str  # one of CAMERA
    centre: tuple[float, float]  # window centre at frame 0 in scene pixels
    pan: tuple[float, float]  # window centre motion per frame (scene pixels)
    zoom: tuple[float, float]  # window size at the first and the last frame (1: the wide window)
    movers: tuple[Mover, ...]  # front to back


def held_out(obj: str, direction: str | None, scene: str) -> bool:
    """Whether a first object in this direction over this scene is reserved for evaluation. A diagonal
    of the (object, direction, scene) grid, so that every object and direction is held out equally often
    (and the chance levels of data/semantic.py hold on the held-out captions)."""
    o, s = list(OBJECTS).index(obj), list(SCENES).index(scene)
    d = list(DIRECTIONS).index(direction) if direction else 0
    return (o + d + s) % HELD_OUT == 0


def _compatible(obj: str, scene: str) -> bool:
    return OBJECTS[obj].file != SCENES[scene].file  # no rocket cut out of the launch pad it stands on


def _mover(rng, name: str, direction: str | None, t: int, h: int, w: int) -> Mover:
    oh, ow = object_size(name, h, w)
    room = np.array([max(h - oh, 0), max(w - ow, 0)], np.float64)
    if direction is None or t == 1:
        return Mover(name, None, tuple(rng.uniform(0, room + 1e-9)), (0.0, 0.0))
    unit = np.array(DIRECTIONS[direction])
    travel = rng.uniform(0.35, 0.6) * np.array([h, w]) * np.abs(unit)
    travel = np.minimum(travel, np.maximum(room, 1.0) * np.abs(unit))  # stay inside where the frame allows
    start = rng.uniform(0, np.maximum(room - travel, 0) + 1e-9)
    start = np.where(unit < 0, start + travel, start)  # moving left/up: start on the far side
    return Mover(name, direction, tuple(start), tuple(unit * travel / (t - 1)))


def plan(seed: int, key: tuple[int, ...], shape: tuple[int, int, int], split: str = "train") -> Clip:
    """Everything clip (seed, key) of latent shape (T, H, W) shows, drawn from (seed, key, split) alone."""
    t, h, w = shape
    rng = np.random.default_rng([seed, *key, 0 if split == "train" else 1])
    video = t > 1
    while True:  # the split decides which (object, direction, scene) combinations may come first
        scene = list(SCENES)[rng.integers(len(SCENES))]
        obj = list(OBJECTS)[rng.integers(len(OBJECTS))]
        direction = list(DIRECTIONS)[rng.integers(len(DIRECTIONS))] if video else None
        if _compatible(obj, scene) and held_out(obj, direction, scene) == (split == "eval"):
            break
    names = [obj]
    if rng.random() < 0.4:
        other = [o for o in OBJECTS if o != obj and _compatible(o, scene)]
        names.append(other[rng.integers(len(other))])
    movers = [
        _mover(rng, n, direction if i == 0 else (list(DIRECTIONS)[rng.integers(4)] if video else None), t, h, w)
        for i, n in enumerate(names)
    ]
    camera = CAMERA[rng.integers(len(CAMERA))] if video else "is still"
    ph, pw = scene_pixels(scene, h, w).shape[:2]
    zoom, pan = (1.0, 1.0), np.zeros(2)
    if camera.startswith("zooms"):
        zoom = (1.0, ZOOM) if camera == "zooms in" else (ZOOM, 1.0)
    elif camera.startswith("pans"):
        unit = np.array(DIRECTIONS[camera.split()[1]])
        pan = unit * rng.uniform(0.2, 0.35) * np.array([h, w]) / (t - 1)
    travel = pan * (t - 1)
    lo = np.array([h, w]) / 2 + np.maximum(-travel, 0)
    hi = np.array([ph, pw]) - np.array([h, w]) / 2 - np.maximum(travel, 0) - 1.0  # the bilinear neighbour
    centre = rng.uniform(lo, np.maximum(hi, lo + 1e-9))
    return Clip(scene, camera, tuple(centre), tuple(pan), zoom, tuple(movers))


def caption_of(clip: Clip) -> str:
    first, *rest = clip.movers
    video = first.direction is not None
    text = f"the {first.name}" + (f" moves {first.direction}" if video else "")
    for m in rest:
        text += f" in front of the {m.name}" + (f" moving {m.direction}" if video else "")
    text += f" over the {clip.scene}"
    return text + (f", camera {clip.camera}" if video else "")


def caption(seed: int, key: tuple[int, ...], shape: tuple[int, int, int], split: str = "train") -> str:
    return caption_of(plan(seed, key, shape, split))


def parse_caption(text: str) -> dict | None:
    """The inverse of `caption_of`: {"objects": [(name, direction or None), ...] front to back, "scene",
    "camera"} (camera None for images), or None if `text` is not a caption of this source."""
    words = text.lower().replace(",", " ").split()
    objects, scene, camera, i = [], None, None, 0
    while i < len(words):
        if words[i] == "the" and i + 1 < len(words) and words[i + 1] in OBJECTS:
            direction = words[i + 3] if i + 3 < len(words) and words[i + 2] in ("moves", "moving") else None
            objects.append((words[i + 1], direction if direction in DIRECTIONS else None))
        elif words[i] == "over" and i + 2 < len(words):
            rest = " ".join(words[i + 2 :])
            scene = next((s for s in SCENES if rest == s or rest.startswith(s + " ")), None)
        elif words[i] == "camera":
            camera = " ".join(words[i + 1 : i + 3])
            camera = camera if camera in CAMERA else None
        i += 1
    if not objects or scene is None:
        return None
    return {"objects": objects, "scene": scene, "camera": camera}


# -- drawing ---------------------------------------------------------------------------------------------


def _windows(clip: Clip, t: int, h: int, w: int) -> np.ndarray:
    """The scene seen through the camera window of each frame: float32 [T, H, W, 3] in [0, 1]."""
    pixels = scene_pixels(clip.scene, h, w)
    ph, pw = pixels.shape[:2]
    steps = np.arange(t, dtype=np.float64)
    centre = np.asarray(clip.centre)[None] + steps[:, None] * np.asarray(clip.pan)[None]  # [T, 2]
    z0, z1 = clip.zoom
    zoom = z0 * (z1 / z0) ** (steps / max(t - 1, 1))  # geometric: a steady zoom
    ys = centre[:, :1] + (np.arange(h) + 0.5 - h / 2)[None] * zoom[:, None] - 0.5  # [T, H] pixel rows
    xs = centre[:, 1:] + (np.arange(w) + 0.5 - w / 2)[None] * zoom[:, None] - 0.5
    ys, xs = np.clip(ys, 0, ph - 1.001), np.clip(xs, 0, pw - 1.001)
    y0, x0 = ys.astype(np.int64), xs.astype(np.int64)
    wy, wx = (ys - y0).astype(np.float32), (xs - x0).astype(np.float32)
    if z0 == z1 == 1.0:  # a pan: each frame is a slice at a constant sub-pixel offset
        out = np.empty((t, h, w, 3), np.float32)
        for i in range(t):
            a, b, fy, fx = y0[i, 0], x0[i, 0], wy[i, 0], wx[i, 0]
            top = pixels[a : a + h, b : b + w] * (1 - fx) + pixels[a : a + h, b + 1 : b + w + 1] * fx
            bottom = pixels[a + 1 : a + h + 1, b : b + w] * (1 - fx) + pixels[a + 1 : a + h + 1, b + 1 : b + w + 1] * fx
            out[i] = top * (1 - fy) + bottom * fy
        return out
    flat = pixels.reshape(-1, 3)
    idx = y0[:, :, None] * pw + x0[:, None, :]  # [T, H, W] top-left neighbours
    fy, fx = wy[:, :, None, None], wx[:, None, :, None]
    top = flat[idx] * (1 - fx) + flat[idx + 1] * fx
    bottom = flat[idx + pw] * (1 - fx) + flat[idx + pw + 1] * fx
    return top * (1 - fy) + bottom * fy


def _paste(frame: np.ndarray, rgb: np.ndarray, alpha: np.ndarray, top: int, left: int) -> None:
    """Alpha-blend an object onto a frame in place, clipped to the frame."""
    h, w = frame.shape[:2]
    oh, ow = alpha.shape
    y0, x0, y1, x1 = max(top, 0), max(left, 0), min(top + oh, h), min(left + ow, w)
    if y0 >= y1 or x0 >= x1:
        return
    a = alpha[y0 - top : y1 - top, x0 - left : x1 - left, None]
    region = frame[y0:y1, x0:x1]
    region += a * (rgb[y0 - top : y1 - top, x0 - left : x1 - left] - region)


def draw(clip: Clip, shape: tuple[int, int, int]) -> np.ndarray:
    """Frames float32 [T, H, W, 3] in [-1, 1] of a planned clip."""
    t, h, w = shape
    frames = _windows(clip, t, h, w)
    for mover in reversed(clip.movers):  # back to front: the first named occludes the others
        rgb, alpha = cutout(mover.name, h, w)
        for i in range(t):
            top = round(mover.start[0] + i * mover.velocity[0])
            left = round(mover.start[1] + i * mover.velocity[1])
            _paste(frames[i], rgb, alpha, top, left)
    return (frames * 2.0 - 1.0).astype(np.float32)


def render(
    seed: int, key: tuple[int, ...], shape: tuple[int, int, int], split: str = "train"
) -> tuple[np.ndarray, str]:
    """The clip for (seed, key) at latent shape (T, H, W): (frames float32 [T, H, W, 3] in [-1, 1], caption)."""
    clip = plan(seed, key, tuple(shape), split)
    return draw(clip, tuple(shape)), caption_of(clip)


def renderer(cfg, split: str = "train"):
    """render(seed, key, shape) -> (frames, caption) of a run's feed (`data.feed.SOURCES["photos"]`): its
    held-out captions only for split="eval". Fails now, not in the prefetch thread, when the photos are
    missing."""
    data_dir()
    if cfg.text.encoder == "builtin" and cfg.text.max_len < MAX_CAPTION_WORDS + 1:
        log.warning(
            "data.source=photos: captions have up to %d words and text.max_len=%d tokens cuts the longest "
            "(set text.max_len=%d)",
            MAX_CAPTION_WORDS,
            cfg.text.max_len,
            MAX_CAPTION_WORDS + 1,
        )
    return functools.partial(render, split=split)
