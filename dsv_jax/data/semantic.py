"""Does a clip show what its caption says? A semantic score for the embedded datasets, whose generators
know the truth. Pure numpy: frames [T, H, W, 3] in [-1, 1] and the caption are all it needs.

Each caption yields a few multiple-choice questions; the clip answers each by measurement, and the
score is the share answered right. Chance (the share a clip unrelated to its caption gets right in
expectation, since the captions' choices are drawn uniformly) is reported beside it.

    synthetic shapes ("a small red circle moving left")
      colour   the palette colour nearest to the most salient pixels (far from the frame's median)   1/8
      shape    the shape whose template, at the captioned size, best matches the salience map (NCC)    1/6
      motion   direction of the centroid of the captioned colour, first half to second half            1/4
    photos ("the cat moves right in front of the coin moving up over the grass, camera pans down")
      object   the cut-out (data/photos.py) that best matches the frames (masked NCC), among all
               objects but the other one named                                                        1/6-1/7
      motion   direction of the first object's best-match position, first half to second half         1/4
      camera   pans: direction opposite to the picture's shift (phase correlation of frame pairs, the 1/4
               named objects' best-match boxes faded out); zooms: in if the four quadrants move apart 1/2
               (the picture grows), else out
Stills (T = 1) answer colour / shape / object only; "camera is still" asks nothing.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import NamedTuple

import numpy as np

from dsv_jax.data import photos, synthetic


class Answer(NamedTuple):
    """One question about one clip: answered right, the chance of that, what the caption says (truth) and
    what the clip showed (said; "none" when the measurement found nothing, e.g. no motion)."""

    right: bool
    chance: float
    truth: str
    said: str


def _answer(truth: str, said: str | None, chance: float) -> Answer:
    return Answer(said == truth, chance, truth, said or "none")


SYNTHETIC_CAPTION = re.compile(r"^a (small|large) (\w+) (\w+)(?: moving (\w+))?$")


def parse(caption: str) -> dict | None:
    """{"source": "synthetic" | "photos", ...the caption's facts} or None when neither source wrote it."""
    m = SYNTHETIC_CAPTION.match(caption.strip().lower())
    if m and m.group(2) in synthetic.COLOURS and m.group(3) in synthetic.SHAPES:
        return {
            "source": "synthetic",
            "large": m.group(1) == "large",
            "colour": m.group(2),
            "shape": m.group(3),
            "direction": m.group(4) if m.group(4) in synthetic.DIRECTIONS else None,
        }
    facts = photos.parse_caption(caption)
    return None if facts is None else {"source": "photos", **facts}


# -- measurements ----------------------------------------------------------------------------------------


def direction_of(dy: float, dx: float) -> str | None:
    """The direction (left/right/up/down) of a displacement, by its larger component; None if zero."""
    if dy == 0 and dx == 0:
        return None
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


def _halves_shift(points: np.ndarray) -> tuple[float, float]:
    """Mean position of the second half of a track [T, 2] minus that of the first half."""
    half = len(points) // 2
    return tuple(points[len(points) - half :].mean(0) - points[:half].mean(0))


class Matcher:
    """Masked normalised cross-correlation of templates with every frame of a clip [T, H, W, C]: the
    frames' spectra are computed once and shared by all templates."""

    def __init__(self, frames: np.ndarray):
        self.shape = frames.shape
        f = np.moveaxis(np.asarray(frames, np.float64), -1, 1)  # [T, C, H, W]
        self.spec, self.spec_sq = np.fft.rfft2(f), np.fft.rfft2(f * f)

    def _correlate(self, spec, kernel):
        """sum_m kernel[m] * image[u + m] for every offset u with the kernel inside: [..., H-h+1, W-w+1]."""
        h, w = self.shape[1:3]
        kh, kw = kernel.shape[-2:]
        out = np.fft.irfft2(spec * np.conj(np.fft.rfft2(kernel, s=(h, w))), s=(h, w))
        return out[..., : h - kh + 1, : w - kw + 1]

    def __call__(self, template: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """[T, H-h+1, W-w+1] for a template [h, w, C] with pixel weights `mask` [h, w]: 1 where the frame
        under the mask is an affine copy of the template (-1 everywhere if it does not fit)."""
        t, h, w, _ = self.shape
        if template.shape[0] > h or template.shape[1] > w:
            return np.full((t, 1, 1), -1.0)
        total = mask.sum()
        tpl = np.moveaxis(np.asarray(template, np.float64), -1, 0)  # [C, h, w]
        centred = (tpl - (mask * tpl).sum((1, 2), keepdims=True) / total) * mask
        num = self._correlate(self.spec, centred[None]).sum(1)
        s1, s2 = self._correlate(self.spec, mask[None, None]), self._correlate(self.spec_sq, mask[None, None])
        var_f = np.maximum(s2 - s1 * s1 / total, 0.0).sum(1)
        var_t = (centred * centred / np.maximum(mask, 1e-12)).sum()
        return num / np.sqrt(var_f * var_t + 1e-9)


def phase_shift(a: np.ndarray, b: np.ndarray, weight: np.ndarray | None = None) -> tuple[float, float]:
    """(dy, dx) with b ~ a moved by (dy, dx) pixels, by phase correlation of 2D images (sub-pixel).
    `weight` [H, W] in [0, 1] fades out pixels to ignore (moving objects) in both images."""
    h, w = a.shape
    window = np.outer(np.hanning(h), np.hanning(w)) * (1.0 if weight is None else weight)
    mean = lambda x: (x * window).sum() / max(window.sum(), 1e-9)
    fa, fb = np.fft.fft2((a - mean(a)) * window), np.fft.fft2((b - mean(b)) * window)
    cross = np.conj(fa) * fb
    surface = np.real(np.fft.ifft2(cross / (np.abs(cross) + 1e-9)))
    py, px = np.unravel_index(np.argmax(surface), surface.shape)

    def refine(m1, m0, p1):  # the vertex of a parabola through three samples around the peak
        denom = m1 - 2 * m0 + p1
        return 0.0 if abs(denom) < 1e-12 else 0.5 * (m1 - p1) / denom

    dy = py + refine(surface[py - 1, px], surface[py, px], surface[(py + 1) % h, px])
    dx = px + refine(surface[py, px - 1], surface[py, px], surface[py, (px + 1) % w])
    return (dy - h if dy > h / 2 else dy), (dx - w if dx > w / 2 else dx)


def _pairs(t: int) -> list[tuple[int, int]]:
    stride = max(1, t // 4)  # several frames apart: a slow zoom moves quadrants by under a pixel per frame
    return [(i, i + stride) for i in range(0, t - stride, stride)]


def camera_motion(frames: np.ndarray, background: np.ndarray | None = None) -> tuple[tuple[float, float], float]:
    """((dy, dx) total shift of the picture, divergence) over a clip [T, H, W, 3]: the divergence sums the
    outward shift of the four quadrants (> 0: the picture grows, the camera zooms in). `background`
    [T, H, W] in [0, 1] weights the pixels that show the scene (0 on moving objects)."""
    gray = frames.mean(-1)
    h, w = gray.shape[1:]
    shift, divergence = np.zeros(2), 0.0
    top, bottom, left, right = slice(0, h // 2), slice(h - h // 2, h), slice(0, w // 2), slice(w - w // 2, w)
    quads = [((top, left), (-1, -1)), ((top, right), (-1, 1)), ((bottom, left), (1, -1)), ((bottom, right), (1, 1))]
    for i, j in _pairs(len(gray)):
        weight = None if background is None else background[i] * background[j]
        shift += phase_shift(gray[i], gray[j], weight)
        for (ys, xs), (oy, ox) in quads:
            dy, dx = phase_shift(gray[i][ys, xs], gray[j][ys, xs], None if weight is None else weight[ys, xs])
            divergence += (oy * dy + ox * dx) / np.sqrt(2)
    return (float(shift[0]), float(shift[1])), float(divergence)


def object_mask(tracks, sizes, shape, feather: int = 2) -> np.ndarray:
    """[T, H, W] weights: 0 inside the boxes of tracked objects (top-left corners [T, 2], sizes (h, w)),
    1 elsewhere, with a linear ramp of `feather` pixels so that the holes add no sharp edges."""
    t, h, w = shape
    out = np.ones(shape)
    yy, xx = np.arange(h)[:, None], np.arange(w)[None, :]
    for track, (oh, ow) in zip(tracks, sizes):
        for i, (top, left) in enumerate(track):
            dy = np.maximum(np.maximum(top - yy, yy - (top + oh - 1)), 0)
            dx = np.maximum(np.maximum(left - xx, xx - (left + ow - 1)), 0)
            out[i] *= np.clip(np.maximum(dy, dx) / max(feather, 1), 0, 1)
    return out


def _salience(frame: np.ndarray) -> np.ndarray:
    return np.linalg.norm(frame - np.median(frame.reshape(-1, 3), axis=0), axis=-1)


# -- the questions -----------------------------------------------------------------------------------------


def _synthetic(frames: np.ndarray, facts: dict) -> dict[str, Answer]:
    t, h, w, _ = frames.shape
    palette = {k: np.asarray(v, np.float64) / 127.5 - 1 for k, v in synthetic.COLOURS.items()}
    names, colours = list(palette), np.stack(list(palette.values()))
    out = {}
    votes = np.zeros(len(names))
    for frame in frames:
        flat, sal = frame.reshape(-1, 3), _salience(frame).ravel()
        top = flat[np.argsort(sal)[-max(1, sal.size // 20) :]]  # the 5% most salient pixels
        nearest = np.argmin(((top[:, None] - colours[None]) ** 2).sum(-1), axis=1)
        votes += np.bincount(nearest, minlength=len(names))
    out["colour"] = _answer(facts["colour"], names[int(np.argmax(votes))], 1 / len(names))

    r = min(h, w) * (0.28 if facts["large"] else 0.17)
    size = int(np.ceil(2 * r)) + 2
    yy, xx = np.mgrid[:size, :size] + 0.5 - size / 2
    matcher = Matcher(np.stack([_salience(f) for f in frames])[..., None])
    scores = {
        kind: matcher(synthetic.shape_mask(kind, yy, xx, r)[..., None], np.ones((size, size))).max((1, 2)).mean()
        for kind in synthetic.SHAPES
    }
    out["shape"] = _answer(facts["shape"], max(scores, key=scores.get), 1 / len(synthetic.SHAPES))

    if t > 1 and facts["direction"]:
        weight = np.exp(-np.sum((frames - palette[facts["colour"]]) ** 2, axis=-1) * 20) + 1e-12
        grid = np.mgrid[:h, :w].astype(np.float64)
        centroids = np.stack([(grid * wt).sum((1, 2)) / wt.sum() for wt in weight])
        seen = direction_of(*_halves_shift(centroids))
        out["motion"] = _answer(facts["direction"], seen, 1 / len(synthetic.DIRECTIONS))
    return out


def _photos(frames: np.ndarray, facts: dict) -> dict[str, Answer]:
    t, h, w, _ = frames.shape
    out = {}
    named = [name for name, _ in facts["objects"]]
    (first, direction), others = facts["objects"][0], named[1:]
    candidates = [o for o in photos.OBJECTS if o not in others]
    matcher, scores, tracks = Matcher(frames), {}, {}
    for name in dict.fromkeys(candidates + others):
        rgb, alpha = photos.cutout(name, h, w)
        maps = matcher(rgb * 2 - 1, alpha)
        scores[name] = float(maps.max((1, 2)).mean())
        tracks[name] = np.array([np.unravel_index(np.argmax(m), m.shape) for m in maps], np.float64)
    out["object"] = _answer(first, max(candidates, key=scores.get), 1 / len(candidates))
    if t > 1 and direction:
        out["motion"] = _answer(direction, direction_of(*_halves_shift(tracks[first])), 1 / len(photos.DIRECTIONS))
    camera = facts.get("camera") or ""
    if t > 1 and camera.startswith(("pans", "zooms")):
        # the scene's motion, without the named objects (where the clip shows them best)
        background = object_mask([tracks[n] for n in named], [photos.object_size(n, h, w) for n in named], (t, h, w))
        shift, divergence = camera_motion(frames, background)
        if camera.startswith("pans"):
            opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
            seen = direction_of(*shift)  # the picture's shift: the camera pans the other way
            out["camera"] = _answer(camera, None if seen is None else f"pans {opposite[seen]}", 1 / 4)
        else:
            out["camera"] = _answer(camera, "zooms in" if divergence > 0 else "zooms out", 1 / 2)
    return out


def score_clip(frames: np.ndarray, caption: str) -> dict[str, Answer] | None:
    """{question: Answer} for one clip [T, H, W, 3] in [-1, 1]; None if the caption is not one of the
    embedded datasets'."""
    facts = parse(caption)
    if facts is None:
        return None
    frames = np.asarray(frames, np.float64)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [T, H, W, 3], got {frames.shape}")
    return (_synthetic if facts["source"] == "synthetic" else _photos)(frames, facts)


def score_clips(clips, captions) -> dict:
    """Accuracy and chance per question over clips, and overall (all answers pooled):
    {"questions": {name: {"accuracy", "chance", "n", "confusion"}}, "accuracy", "chance", "n", "stderr",
    "unscored"}. confusion: {what the captions said: {what the clips showed: count}}, e.g. shape
    {"ring": {"circle": 3, "ring": 1}}: which answers a model gets wrong, and into what.

    stderr: the standard error of the overall accuracy over clips (the spread of the clips' own shares of
    right answers / sqrt(clips); nan below two clips). Per clip, not per answer: the answers of one clip
    are not independent (a clip that shows no object fails its shape and motion questions together)."""
    answers: dict[str, list[Answer]] = {}
    per_clip: list[float] = []
    unscored = 0
    for frames, caption in zip(clips, captions):
        result = score_clip(frames, caption)
        if result is None:
            unscored += 1
            continue
        for name, answer in result.items():
            answers.setdefault(name, []).append(answer)
        if result:
            per_clip.append(float(np.mean([a.right for a in result.values()])))
    pooled = [a for v in answers.values() for a in v]
    summary = lambda items: {
        "accuracy": float(np.mean([a.right for a in items])) if items else float("nan"),
        "chance": float(np.mean([a.chance for a in items])) if items else float("nan"),
        "n": len(items),
    }
    stderr = float(np.std(per_clip, ddof=1) / np.sqrt(len(per_clip))) if len(per_clip) > 1 else float("nan")
    questions = {k: {**summary(v), "confusion": confusion(v)} for k, v in sorted(answers.items())}
    return {"questions": questions, **summary(pooled), "stderr": stderr, "unscored": unscored}


def confusion(answers) -> dict[str, dict[str, int]]:
    """{truth: {said: count}} of Answers, truths and answers in sorted order."""
    table: dict[str, Counter] = {}
    for a in answers:
        table.setdefault(a.truth, Counter())[a.said] += 1
    return {t: dict(sorted(c.items())) for t, c in sorted(table.items())}


def format_misses(score: dict, most: int = 4) -> str:
    """One line of the commonest wrong answers per question ('' if none), e.g.
    'misses: shape square->circle 6, ring->circle 3; motion up->left 2'."""
    parts = []
    for name, q in score["questions"].items():
        wrong = Counter({(t, s): n for t, said in q.get("confusion", {}).items() for s, n in said.items() if s != t})
        if wrong:
            parts.append(f"{name} " + ", ".join(f"{t}->{s} {n}" for (t, s), n in wrong.most_common(most)))
    return "misses: " + "; ".join(parts) if parts else ""


def format_score(score: dict) -> str:
    """One line: 'semantic score 0.833 +- 0.061 (chance 0.240): colour 1.00/0.12 (n=8), ...'."""
    parts = [f"{k} {v['accuracy']:.2f}/{v['chance']:.2f} (n={v['n']})" for k, v in score["questions"].items()]
    stderr = score.get("stderr", float("nan"))  # absent in results written before it existed
    spread = f" +- {stderr:.3f}" if np.isfinite(stderr) else ""
    return (
        f"semantic score {score['accuracy']:.3f}{spread} (chance {score['chance']:.3f}): "
        + ", ".join(parts)
        + (f"; {score['unscored']} captions not scorable" if score["unscored"] else "")
    )
