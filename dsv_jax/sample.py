"""Euler sampler of the rectified flow, and video files (GIF; MP4 where a video writer is installed).

The flow runs from noise at t = 1 to data at t = 0: x <- x + (t_next - t) * v(x, t). With guidance g,
v = v(empty caption) + g * (v(caption) - v(empty caption)).
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv_jax.config import Config
from dsv_jax.data.codec import decode_latents
from dsv_jax.data.text import tokenize_batch

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = ("a large red circle moving right", "a small yellow square moving down",
                   "a large white triangle moving left", "a small cyan ring moving up")


def default_prompts(cfg: Config) -> tuple[str, ...]:
    """Prompts of the embedded dataset the config trains on (photos or shapes)."""
    if cfg.data.source == "photos":
        from dsv_jax.data.photos import PROMPTS

        return PROMPTS
    return DEFAULT_PROMPTS


def default_shape(cfg: Config) -> tuple[int, int, int]:
    """The longest bucket of the config (most frames, then most pixels)."""
    return max((tuple(s) for s in cfg.data.buckets), key=lambda s: (s[0], s[1] * s[2]))


def generate(cfg: Config, graphdef, params, prompts: Sequence[str], shape: tuple[int, int, int], *,
             steps: int = 30, guidance: float = 3.0, seed: int = 0, attention="auto",
             attention_inputs=None) -> np.ndarray:
    """Latents [len(prompts), T, H, W, C] for `prompts` (built-in text encoder)."""
    if cfg.text.encoder != "builtin":
        raise ValueError("sampling from prompts needs the built-in text encoder (text.encoder=builtin)")
    ids, mask = tokenize_batch(list(prompts) + [""] * len(prompts), cfg.text.max_len, cfg.text.hash_buckets)
    n = len(prompts)
    t_grid = jnp.linspace(1.0, 0.0, steps + 1)

    @jax.jit
    def run(params, ids, mask, key, attention_inputs):
        model = nnx.merge(graphdef, params)
        text, text_mask = model.encode_text({"text_ids": ids, "text_mask": mask})
        x = jax.random.normal(key, (n, *shape, cfg.model.in_channels))

        def velocity(x, t):
            both = jnp.concatenate([x, x])
            v = model(both, jnp.full((2 * n,), t), text, text_mask, attention=attention,
                      attention_inputs=attention_inputs).astype(jnp.float32)
            cond, uncond = v[:n], v[n:]
            return uncond + guidance * (cond - uncond)

        def body(i, x):
            return x + (t_grid[i + 1] - t_grid[i]) * velocity(x, t_grid[i])

        return jax.lax.fori_loop(0, steps, body, x)

    return np.asarray(run(params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(seed), attention_inputs))


def save_video(videos: np.ndarray, path: str, fps: int = 8) -> str:
    """Write uint8 videos [N, T, H, W, 3] side by side (a 1-pixel gap) to .gif or .mp4."""
    n, t, h, w, _ = videos.shape
    canvas = np.zeros((t, h, n * (w + 1) - 1, 3), np.uint8)
    for i in range(n):
        canvas[:, :, i * (w + 1): i * (w + 1) + w] = videos[i]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    import imageio.v3 as iio

    ext = os.path.splitext(path)[1].lower()
    if ext == ".gif":
        iio.imwrite(path, canvas, extension=".gif", duration=1000 // fps, loop=0)
    elif ext == ".mp4":
        # yuv420p needs even sizes: pad with a black row / column
        canvas = np.pad(canvas, ((0, 0), (0, canvas.shape[1] % 2), (0, canvas.shape[2] % 2), (0, 0)))
        errors = []
        for codec in ("libx264", "mpeg4"):  # H.264 where the FFmpeg build has it, else MPEG-4 part 2
            try:
                iio.imwrite(path, canvas, extension=".mp4", fps=fps, plugin="pyav", codec=codec)
                break
            except Exception as e:  # PyAV raises its own error types for a missing encoder
                errors.append(f"{codec}: {e}")
        else:
            raise RuntimeError(f"cannot write {path}: no working video writer ({'; '.join(errors)}); "
                               "pip install 'dsv-jax[video]'")
    else:
        raise ValueError(f"unsupported video extension {ext!r} (use .gif or .mp4)")
    return path


def sample_from_state(cfg: Config, graphdef, params, path: str, *, prompts: Sequence[str] | None = None,
                      shape=None, steps: int = 30, guidance: float = 3.0, seed: int = 0,
                      also_mp4: bool = False, controller_state: dict | None = None) -> list[str]:
    """Generate one video per prompt and write them side by side to `path` (and an MP4 beside a GIF
    when `also_mp4` and a video writer is installed). Returns the paths written. A DSV run samples with
    the sparse plans of its controller state (stage 2 decisions), a window run with its windows."""
    from dsv_jax.dsv.controller import attention_for

    shape = tuple(shape or default_shape(cfg))
    attention, inputs = attention_for(cfg, shape, controller_state)
    latents = generate(cfg, graphdef, params, prompts or default_prompts(cfg), shape, steps=steps, guidance=guidance,
                       seed=seed, attention=attention, attention_inputs=inputs)
    frames = decode_latents(latents, cfg.data.codec)
    written = [save_video(frames, path)]
    if also_mp4 and path.lower().endswith(".gif"):
        try:
            written.append(save_video(frames, os.path.splitext(path)[0] + ".mp4"))
        except RuntimeError as e:
            log.info("no MP4 beside the GIF: %s", e)
    return written


def sample_from_workdir(workdir: str, out: str, *, prompts: Sequence[str] | None = None, steps: int = 30,
                        guidance: float | None = None, seed: int = 0, shape=None, step: int | None = None) -> list[str]:
    """Load the latest (or `step`) checkpoint of a training workdir and write a video of `prompts`."""
    from dsv_jax.train.checkpoint import load_trained

    cfg, graphdef, params, controller, _ = load_trained(workdir, step)
    return sample_from_state(cfg, graphdef, params, out, prompts=prompts, shape=shape,
                             steps=steps, guidance=cfg.train.guidance if guidance is None else guidance, seed=seed,
                             also_mp4=True, controller_state=controller)
