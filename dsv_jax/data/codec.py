"""The latent codec: how frames become the latents the model trains on, and back.

A codec is named by a spec string, stored in the dataset manifest and in `data.codec`, so that
prepare-data, training and the sampler agree:

    "pixel"            RGB pixels as latents: [T, H, W, 3] in [-1, 1] (the embedded dataset's space)
    "pixel:FTxFHxFW"   pixel patches: space-to-depth of FT x FH x FW pixels into 3*FT*FH*FW channels,
                       e.g. "pixel:1x2x2" maps [T, 2H, 2W, 3] frames to [T, H, W, 12] latents
    "wan2.1-vae:DIR"   Wan 2.1's VAE (diffusers' AutoencoderKLWan in DIR; data/wan.py): 16 channels,
                       4x in time (causally: 1 + 4k frames -> 1 + k), 8x in space
    "pkg.module:fn"    your own codec (a VAE): fn() returns an object with the Codec interface below

The Codec interface (what a real VAE wrapper provides):

    name: str                                  the spec string
    channels: int                              latent channels C
    pixel_shape(latent_shape) -> (T, H, W)     frames needed for a latent (t, h, w) bucket
    encode(frames uint8 [T, H, W, 3]) -> array [t, h, w, C]
        uint8 output means "pixel values": training maps it to [-1, 1] (x / 127.5 - 1);
        floating output is stored as float16 and trained on as it is.
    decode(latents float32 [..., t, h, w, C]) -> uint8 frames [..., T, H, W, 3]

prepare-data calls `encode` in its main process (where a GPU VAE would live), never in the file
readers; training only reads stored arrays and never loads the codec.

Text encoders are named the same way (`get_text_encoder`): "umt5:DIR" is Wan's umT5 (data/wan.py),
"pkg.module:make" your own, make() returning f(captions) -> (embeddings [N, L, D], mask [N, L]).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

import numpy as np


def encode_frames(frames_uint8: np.ndarray) -> np.ndarray:
    """[..., T, H, W, 3] uint8 -> float32 latents in [-1, 1]."""
    return frames_uint8.astype(np.float32) / 127.5 - 1.0


def decode_latents(latents: np.ndarray, codec: str = "pixel") -> np.ndarray:
    """Latents [..., T, H, W, C] of `codec` (a spec string; "" is the pixel codec) -> uint8 frames."""
    return get_codec(codec).decode(latents)


def latents_from_stored(stored: np.ndarray) -> np.ndarray:
    """A stored latent array -> float32 model latents (uint8 holds pixel values, see the module doc)."""
    if stored.dtype == np.uint8:
        return encode_frames(stored)
    return np.asarray(stored, np.float32)


def _to_uint8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.round((np.asarray(x, np.float32) + 1.0) * 127.5), 0, 255).astype(np.uint8)


@dataclass(frozen=True)
class PixelPatchCodec:
    """Deterministic, lossless space-to-depth of pixel patches (ft, fh, fw) into latent channels."""

    factors: tuple[int, int, int] = (1, 1, 1)

    @property
    def name(self) -> str:
        return "pixel" if self.factors == (1, 1, 1) else "pixel:" + "x".join(map(str, self.factors))

    @property
    def channels(self) -> int:
        ft, fh, fw = self.factors
        return 3 * ft * fh * fw

    def pixel_shape(self, latent_shape) -> tuple[int, int, int]:
        return tuple(int(s) * f for s, f in zip(latent_shape, self.factors))

    def encode(self, frames: np.ndarray) -> np.ndarray:
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(f"pixel codec encodes uint8 frames [T, H, W, 3], got {frames.dtype} {frames.shape}")
        (t, h, w, _), (ft, fh, fw) = frames.shape, self.factors
        if t % ft or h % fh or w % fw:
            raise ValueError(f"frames {frames.shape[:3]} are not divisible by the codec's patch {self.factors}")
        x = frames.reshape(t // ft, ft, h // fh, fh, w // fw, fw, 3)
        return np.ascontiguousarray(x.transpose(0, 2, 4, 1, 3, 5, 6).reshape(t // ft, h // fh, w // fw, self.channels))

    def decode(self, latents: np.ndarray) -> np.ndarray:
        x = _to_uint8(latents)
        if x.shape[-1] != self.channels:
            raise ValueError(
                f"codec {self.name!r} decodes {self.channels} latent channels, got {x.shape[-1]} "
                f"(latents {x.shape}); is data.codec the codec the data was prepared with?"
            )
        if self.factors == (1, 1, 1):  # pixels: any leading shape
            return x
        *lead, t, h, w, _ = x.shape
        ft, fh, fw = self.factors
        x = x.reshape(*lead, t, h, w, ft, fh, fw, 3)
        n = len(lead)
        order = [*range(n), n, n + 3, n + 1, n + 4, n + 2, n + 5, n + 6]
        return np.ascontiguousarray(x.transpose(order).reshape(*lead, t * ft, h * fh, w * fw, 3))


_PIXEL = re.compile(r"^pixel(?::(\d+)x(\d+)x(\d+))?$")


def get_codec(spec: str = "pixel"):
    """The codec named by `spec` (see the module doc). "" means "pixel"."""
    spec = (spec or "pixel").strip()
    m = _PIXEL.match(spec)
    if m:
        factors = tuple(int(g) for g in m.groups()) if m.group(1) else (1, 1, 1)
        if any(f < 1 for f in factors):
            raise ValueError(f"codec {spec!r}: patch factors must be >= 1")
        return PixelPatchCodec(factors)
    if spec.startswith("wan2.1-vae:"):
        from dsv_jax.data.wan import vae_codec

        return vae_codec(spec)
    return load_callable(spec, "codec")()


def is_builtin_text_encoder(spec: str | None) -> bool:
    """A text encoder spec of this package (umt5:DIR), as opposed to a pkg.module:make hook."""
    return bool(spec) and spec.strip().startswith("umt5:")


def get_text_encoder(spec: str):
    """The text encoder named by `spec`: f(captions) -> (embeddings [N, L, D], mask [N, L]). "umt5:DIR"
    is built in (data/wan.py; its `spec` attribute is the canonical spec); else a "pkg.module:make" hook,
    made once here."""
    if is_builtin_text_encoder(spec):
        from dsv_jax.data.wan import umt5_encoder

        return umt5_encoder(spec)
    return load_callable(spec, "text encoder")()


def load_callable(spec: str, what: str):
    """'pkg.module:attr' -> the attribute (a hook for user code: a VAE, a text encoder)."""
    if ":" not in spec:
        raise ValueError(f"{what} {spec!r} is neither built in nor of the form 'package.module:callable'")
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import {module!r} ({e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {spec!r} is not callable")
    return obj
