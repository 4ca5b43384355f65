"""Euler sampler of the rectified flow, and video files (GIF; MP4 through PyAV's FFmpeg).

The flow runs from noise at t = 1 to data at t = 0: x <- x + (t_next - t) * v(x, t), on a uniform grid
of t moved towards noise by the run's train.sample_shift (dsv_jax/train/loss.py: shift_timesteps). With
guidance g, v = v(empty caption) + g * (v(caption) - v(empty caption)).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv_jax.config import Config
from dsv_jax.data.codec import decode_latents, load_callable
from dsv_jax.data.synthetic import PROMPTS
from dsv_jax.data.text import tokenize_batch
from dsv_jax.train.loss import resolution_shift, shift_timesteps

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = PROMPTS  # the shapes' (data/synthetic.py)


def default_prompts(cfg: Config) -> tuple[str, ...]:
    """Prompts of the data source the config trains on (photos or shapes)."""
    from dsv_jax.data.feed import source_of

    return source_of(cfg).prompts


def default_shape(cfg: Config) -> tuple[int, int, int]:
    """The longest bucket of the config (most frames, then most pixels)."""
    return max((tuple(s) for s in cfg.data.buckets), key=lambda s: (s[0], s[1] * s[2]))


def load_text_encoder(cfg: Config, spec: str | None, hint: str | None = None) -> Callable | None:
    """The text encoder that sampling needs: None for the built-in one, else the `pkg.module:make` hook
    (as prepare-data's --text-encoder) made once. `hint`: the hook the run's dataset was prepared with."""
    if cfg.text.encoder == "builtin":
        if spec:
            log.warning("--text-encoder %s is not used: this model has the built-in text encoder", spec)
        return None
    if not spec:
        raise ValueError(
            "this model was trained on precomputed text embeddings (text.encoder=precomputed): pass "
            f"--text-encoder pkg.module:make{f' (its dataset was prepared with {hint})' if hint else ''}"
        )
    return load_callable(spec, "text encoder")()


def prompt_batch(cfg: Config, prompts: Sequence[str], text_encoder: Callable | None = None) -> dict[str, np.ndarray]:
    """The text inputs of guided sampling: the prompts, then as many empty captions (the unconditional
    half, as caption dropout made it in training)."""
    n = len(prompts)
    if cfg.text.encoder == "builtin":
        ids, mask = tokenize_batch(list(prompts) + [""] * n, cfg.text.max_len, cfg.text.hash_buckets)
        return {"text_ids": ids, "text_mask": mask}
    if text_encoder is None:
        raise ValueError("sampling a text.encoder=precomputed model needs its text encoder (--text-encoder)")
    emb, mask = (np.asarray(a) for a in text_encoder(list(prompts)))
    want = (n, cfg.text.max_len, cfg.model.text_dim)
    if emb.shape != want or mask.shape != want[:2]:
        raise ValueError(
            f"the text encoder returned embeddings {emb.shape} and mask {mask.shape} for {n} prompts; "
            f"the model takes [{n}, text.max_len={want[1]}, model.text_dim={want[2]}] "
            f"and [{n}, {want[1]}]"
        )
    dropped = np.arange(want[1]) == 0  # a dropped caption: zero embeddings, one valid token
    return {
        "text_emb": np.concatenate([emb.astype(np.float32), np.zeros(want, np.float32)]),
        "text_mask": np.concatenate([mask.astype(bool), np.broadcast_to(dropped, (n, want[1]))]),
    }


def time_grid(steps: int, shift: float = 1.0) -> jax.Array:
    """The sampler's `steps + 1` timesteps, from 1 (noise) down to 0 (data)."""
    return shift_timesteps(jnp.linspace(1.0, 0.0, steps + 1), shift)


def sampler_shift(cfg: Config, shape: tuple[int, int, int], shift: float | None = None) -> float:
    """The time grid's shift for clips of latent `shape`: `shift` as given (absolute, at any shape), else the
    run's train.sample_shift, scaled by sqrt(T H W / train.resolution_shift_ref) when that is set."""
    if shift is not None:
        return shift
    return cfg.train.sample_shift * resolution_shift(cfg.train, math.prod(shape))


def generate(
    cfg: Config,
    graphdef,
    params,
    prompts: Sequence[str],
    shape: tuple[int, int, int],
    *,
    steps: int = 30,
    guidance: float = 3.0,
    seed: int = 0,
    attention="auto",
    attention_inputs=None,
    text_encoder: Callable | None = None,
    shift: float | None = None,
) -> np.ndarray:
    """Latents [len(prompts), T, H, W, C] for `prompts` (`text_encoder`: see `prompt_batch`; `shift`: of
    the time grid, see `sampler_shift`)."""
    batch = {k: jnp.asarray(v) for k, v in prompt_batch(cfg, prompts, text_encoder).items()}
    n = len(prompts)
    t_grid = time_grid(steps, sampler_shift(cfg, shape, shift))

    @jax.jit
    def run(params, batch, key, attention_inputs):
        model = nnx.merge(graphdef, params)
        text, text_mask = model.encode_text(batch)
        x = jax.random.normal(key, (n, *shape, cfg.model.in_channels))

        def velocity(x, t):
            both = jnp.concatenate([x, x])
            v = model(
                both, jnp.full((2 * n,), t), text, text_mask, attention=attention, attention_inputs=attention_inputs
            ).astype(jnp.float32)
            cond, uncond = v[:n], v[n:]
            return uncond + guidance * (cond - uncond)

        def body(i, x):
            return x + (t_grid[i + 1] - t_grid[i]) * velocity(x, t_grid[i])

        return jax.lax.fori_loop(0, steps, body, x)

    return np.asarray(run(params, batch, jax.random.key(seed), attention_inputs))


def save_video(videos: np.ndarray, path: str, fps: int = 8) -> str:
    """Write uint8 videos [N, T, H, W, 3] side by side (a 1-pixel gap) to .gif or .mp4."""
    n, t, h, w, _ = videos.shape
    canvas = np.zeros((t, h, n * (w + 1) - 1, 3), np.uint8)
    for i in range(n):
        canvas[:, :, i * (w + 1) : i * (w + 1) + w] = videos[i]
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
            raise RuntimeError(
                f"cannot write {path}: PyAV's FFmpeg has no working H.264 or MPEG-4 encoder "
                f"({'; '.join(errors)}); write a .gif instead"
            )
    else:
        raise ValueError(f"unsupported video extension {ext!r} (use .gif or .mp4)")
    return path


def sample_from_state(
    cfg: Config,
    graphdef,
    params,
    path: str | Sequence[str],
    *,
    prompts: Sequence[str] | None = None,
    shape=None,
    steps: int = 30,
    guidance: float = 3.0,
    seed: int = 0,
    controller_state: dict | None = None,
    text_encoder: Callable | None = None,
    shift: float | None = None,
) -> list[str]:
    """Generate one video per prompt and write them side by side to `path` (or to each of several
    paths, .gif or .mp4: the same videos). Returns the paths written. A DSV run samples with the sparse
    plans of its controller state (stage 2 decisions), a window run with its windows."""
    from dsv_jax.dsv.policy import make_policy

    paths = [path] if isinstance(path, str) else list(path)
    shape = tuple(shape or default_shape(cfg))
    policy = make_policy(cfg, controller_state)
    attention, inputs = policy.plans(shape, train=False), policy.inputs(shape, train=False)
    latents = generate(
        cfg,
        graphdef,
        params,
        prompts or default_prompts(cfg),
        shape,
        steps=steps,
        guidance=guidance,
        seed=seed,
        attention=attention,
        attention_inputs=inputs,
        text_encoder=text_encoder,
        shift=shift,
    )
    if not np.isfinite(latents).all():
        raise ValueError("the sampled videos hold NaN/Inf: the model's parameters are not usable; nothing written")
    frames = decode_latents(latents, cfg.data.codec)
    return [save_video(frames, p) for p in paths]


def sample_from_workdir(
    workdir: str,
    out: str | Sequence[str],
    *,
    prompts: Sequence[str] | None = None,
    steps: int = 30,
    guidance: float | None = None,
    seed: int = 0,
    shape=None,
    step: int | None = None,
    text_encoder: str | None = None,
    weights: str = "auto",
    shift: float | None = None,
) -> list[str]:
    """Load an exported model (`dsv-jax export`) or the newest readable (or `step`) checkpoint of a
    training workdir and write a video of `prompts` to `out` (one path or several); nothing else is
    written. `text_encoder` (pkg.module:make) encodes the prompts for a model trained on precomputed
    text embeddings. `weights` (a training workdir): see `load_trained`; default the EMA of the weights
    where the run kept one. `shift`: of the sampler's time grid (default: the run's, see `sampler_shift`)."""
    from dsv_jax.export import load_for_sampling

    cfg, graphdef, params, controller, hint = load_for_sampling(workdir, step, weights)
    encoder = load_text_encoder(cfg, text_encoder, hint)
    return sample_from_state(
        cfg,
        graphdef,
        params,
        out,
        prompts=prompts,
        shape=shape,
        steps=steps,
        guidance=cfg.train.guidance if guidance is None else guidance,
        seed=seed,
        controller_state=controller,
        text_encoder=encoder,
        shift=shift,
    )
