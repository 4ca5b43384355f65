"""Videos labelled for a person to read (the end-of-run sample): each panel scaled up (nearest neighbour) to a
readable height, its prompt written under it in PIL's default font. `save_video` lays the panels side by side."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

MIN_HEIGHT = 128  # pixels: a 32-pixel tiny-preset frame is drawn 4 times larger
PAD = 3  # pixels around the caption's lines


def _font():
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=12)  # a scalable font (Pillow >= 10.1 with FreeType)
    except TypeError:  # older Pillow: the fixed bitmap font
        return ImageFont.load_default()


def wrap(text: str, width: float, length) -> list[str]:
    """`text` in lines of at most `width` (measured by `length`), broken between words (a word longer
    than a line stands alone on its line)."""
    lines, line = [], ""
    for word in text.split():
        candidate = f"{line} {word}".strip()
        if line and length(candidate) > width:
            lines.append(line)
            candidate = word
        line = candidate
    return lines + [line] if line else lines or [""]


def labelled(videos: np.ndarray, captions: Sequence[str], min_height: int = MIN_HEIGHT) -> np.ndarray:
    """uint8 videos [N, T, H, W, 3] with `captions` (one per video) -> [N, T, k*H + strip, k*W, 3]: each
    frame scaled k = ceil(min_height / H) times (nearest), a white caption on black below it."""
    from PIL import Image, ImageDraw

    n, t, h, w, _ = videos.shape
    if len(captions) != n:
        raise ValueError(f"{len(captions)} captions for {n} videos")
    k = max(1, math.ceil(min_height / h))
    big = videos.repeat(k, axis=2).repeat(k, axis=3)
    font = _font()
    width = k * w
    texts = [wrap(c, width - 2 * PAD, font.getlength) for c in captions]
    line_h = font.getbbox("Ag")[3] + 2
    strip = 2 * PAD + line_h * max(len(lines) for lines in texts)
    out = np.zeros((n, t, k * h + strip, width, 3), np.uint8)
    out[:, :, : k * h] = big
    for i, lines in enumerate(texts):
        label = Image.new("RGB", (width, strip))
        draw = ImageDraw.Draw(label)
        for j, line in enumerate(lines):
            draw.text((PAD, PAD + j * line_h), line, fill=(255, 255, 255), font=font)
        out[i, :, k * h :] = np.asarray(label)
    return out
