"""Sampler of the rectified flow, and video files (GIF; MP4 through PyAV's FFmpeg).

    frames = dsv_jax.generate(dsv_jax.load_model("models/tiny"), ["a red circle moving left"], seed=0)
    # uint8 [N, T, H, W, 3]; `dsv-jax sample` writes the same videos (generate -> save_video)

The flow runs from noise at t = 1 to data at t = 0 on a grid of t moved towards noise by the run's
train.sample_shift (dsv_jax/train/loss.py: shift_timesteps), with the run's train.sample_solver: Euler,
x <- x + (t_next - t) * v(x, t), or Wan's second-order UniPC (dsv_jax/solvers.py). With guidance g,
v = v(negative) + g * (v(caption) - v(negative)), where the negative is the empty caption of training or a
negative prompt. The sampling loop is compiled once per model, shape, prompt count, step count and solver,
and reused by later calls.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv_jax.config import Config
from dsv_jax.data.codec import decode_latents, get_text_encoder, is_builtin_text_encoder
from dsv_jax.data.synthetic import PROMPTS
from dsv_jax.data.text import tokenize_batch
from dsv_jax.solvers import SOLVERS, make_schedule, time_grid, unipc_step  # noqa: F401  (time_grid: public here)
from dsv_jax.train.loss import resolution_shift

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
    """The text encoder that sampling needs: None for the built-in one, else that of `spec` (as prepare-data's
    --text-encoder: umt5:DIR, or a `pkg.module:make` hook, made once). `hint`: the spec the run's dataset was
    prepared with, used when `spec` is not given and the hint is a built-in spec (umt5:DIR)."""
    if cfg.text.encoder == "builtin":
        if spec:
            log.warning("--text-encoder %s is not used: this model has the built-in text encoder", spec)
        return None
    if not spec and is_builtin_text_encoder(hint):
        spec = hint
    if not spec:
        raise ValueError(
            "this model was trained on precomputed text embeddings (text.encoder=precomputed): pass "
            f"--text-encoder pkg.module:make{f' (its dataset was prepared with {hint})' if hint else ''}"
        )
    return get_text_encoder(spec)


def prompt_batch(
    cfg: Config,
    prompts: Sequence[str],
    text_encoder: Callable | None = None,
    negative_prompt: str | Sequence[str] | None = None,
) -> dict[str, np.ndarray]:
    """The text inputs of guided sampling: the prompts, then as many unconditional captions. Those are the
    empty caption, as caption dropout made it in training (negative_prompt None), else the negative prompt
    (one for all prompts, or one per prompt) encoded like the prompts: tokenized, or by `text_encoder`."""
    n = len(prompts)
    negatives = _negatives(negative_prompt, n)
    if cfg.text.encoder == "builtin":
        ids, mask = tokenize_batch(list(prompts) + (negatives or [""] * n), cfg.text.max_len, cfg.text.hash_buckets)
        return {"text_ids": ids, "text_mask": mask}
    if text_encoder is None:
        raise ValueError("sampling a text.encoder=precomputed model needs its text encoder (--text-encoder)")
    captions = list(prompts)
    if negatives is not None:  # one negative prompt for all is encoded once
        captions += negatives[:1] if len(set(negatives)) == 1 else negatives
    emb, mask = (np.asarray(a) for a in text_encoder(captions))
    want = (len(captions), cfg.text.max_len, cfg.model.text_dim)
    if emb.shape != want or mask.shape != want[:2]:
        raise ValueError(
            f"the text encoder returned embeddings {emb.shape} and mask {mask.shape} for {len(captions)} captions; "
            f"the model takes [{len(captions)}, text.max_len={want[1]}, model.text_dim={want[2]}] "
            f"and [{len(captions)}, {want[1]}]"
        )
    emb, mask = emb.astype(np.float32), mask.astype(bool)
    if negatives is None:  # a dropped caption: zero embeddings, one valid token
        emb = np.concatenate([emb, np.zeros_like(emb)])
        mask = np.concatenate([mask, np.broadcast_to(np.arange(want[1]) == 0, mask.shape)])
    elif len(captions) == n + 1:  # one negative prompt, encoded once, for every prompt
        emb = np.concatenate([emb[:n], np.repeat(emb[n:], n, axis=0)])
        mask = np.concatenate([mask[:n], np.repeat(mask[n:], n, axis=0)])
    return {"text_emb": emb, "text_mask": mask}


def _negatives(negative_prompt: str | Sequence[str] | None, n: int) -> list[str] | None:
    """`negative_prompt` as one caption per prompt (None stays None: the empty caption of training)."""
    if negative_prompt is None:
        return None
    if isinstance(negative_prompt, str):
        return [negative_prompt] * n
    negatives = list(negative_prompt)
    if len(negatives) != n or not all(isinstance(c, str) for c in negatives):
        raise ValueError(
            f"negative_prompt must be a caption or a list of one caption per prompt ({n}), got {negative_prompt!r}"
        )
    return negatives


def sampler_shift(cfg: Config, shape: tuple[int, int, int], shift: float | None = None) -> float:
    """The time grid's shift for clips of latent `shape`: `shift` as given (absolute, at any shape), else the
    run's train.sample_shift, scaled by sqrt(T H W / train.resolution_shift_ref) when that is set."""
    if shift is not None:
        return shift
    return cfg.train.sample_shift * resolution_shift(cfg.train, math.prod(shape))


def sampler_solver(cfg: Config, solver: str | None = None) -> str:
    """The flow ODE solver: `solver` as given, else the run's train.sample_solver (dsv_jax/solvers.py)."""
    solver = cfg.train.sample_solver if solver is None else solver
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r} is not one of {', '.join(SOLVERS)}")
    return solver


def generate_latents(
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
    negative_prompt: str | Sequence[str] | None = None,
    solver: str | None = None,
    noise=None,
    stop_after: int | None = None,
) -> np.ndarray:
    """Latents [len(prompts), T, H, W, C] for `prompts` (`text_encoder`, `negative_prompt`: see `prompt_batch`;
    `shift`: of the time grid, see `sampler_shift`; `solver`: "euler" or "unipc", default the run's
    train.sample_solver). `noise`: the initial latents [len(prompts), T, H, W, C] (default: drawn from `seed`).
    `stop_after`: run only the first that many of the `steps` steps and return the latents there (still
    noisy): for checks against another sampler's steps. Guidance 1 runs the conditional branch alone."""
    n = len(prompts)
    shape = tuple(int(s) for s in shape)
    schedule = make_schedule(sampler_solver(cfg, solver), steps, sampler_shift(cfg, shape, shift))
    guided = guidance != 1.0
    batch = prompt_batch(cfg, prompts, text_encoder, negative_prompt if guided else None)
    batch = {k: jnp.asarray(v if guided else v[:n]) for k, v in batch.items()}
    if noise is None:
        noise = jax.random.normal(jax.random.key(seed), (n, *shape, cfg.model.in_channels))
    elif np.shape(noise) != (n, *shape, cfg.model.in_channels):
        raise ValueError(f"noise has shape {np.shape(noise)}; sampling takes {(n, *shape, cfg.model.in_channels)}")
    run = schedule.steps if stop_after is None else int(stop_after)
    if not 0 <= run <= schedule.steps:
        raise ValueError(f"stop_after={stop_after} must be between 0 and steps={schedule.steps}")
    if isinstance(attention, list):  # a plan per block: static, so hashable
        attention = tuple(attention)
    latents = _sample(
        graphdef,
        params,
        batch,
        jnp.asarray(noise, jnp.float32),
        attention_inputs,
        jnp.asarray(schedule.sigmas),
        jnp.asarray(schedule.timesteps),
        None if schedule.coefficients is None else jnp.asarray(schedule.coefficients),
        jnp.float32(guidance),
        jnp.int32(run),
        attention=attention,
        solver=schedule.solver,
        guided=guided,
    )
    return np.asarray(latents)


@functools.partial(jax.jit, static_argnames=("graphdef", "attention", "solver", "guided"))
def _sample(
    graphdef,
    params,
    batch,
    noise,
    attention_inputs,
    sigmas,
    timesteps,
    coefficients,
    guidance,
    run,
    *,
    attention,
    solver,
    guided,
):
    """The sampling loop: `run` steps of `solver` on the levels `sigmas` from `noise` (module-level, so that jax
    caches its program between calls; one program per model, shape, prompt count, step count and solver)."""
    n = noise.shape[0]
    model = nnx.merge(graphdef, params)
    text, text_mask = model.encode_text(batch)

    def velocity(x, t):
        if not guided:
            v = model(x, t, text, text_mask, attention=attention, attention_inputs=attention_inputs, time_scale=1.0)
            return v.astype(jnp.float32)
        # Both branches in one call on 2n rows rather than two calls on n rows: the same FLOPs, and at small n
        # the taller matmuls fill the hardware better and the weights stream once per step instead of twice
        # (at long clips the two are equally fast). The price, twice one call's transient activations
        # (nothing is kept for a backward pass), is small next to the weights: Wan 14B at 480p holds about
        # 1 GB in a block's widest activation per clip, against 28 GB of bf16 weights.
        v = model(
            jnp.concatenate([x, x]),
            t,
            text,
            text_mask,
            attention=attention,
            attention_inputs=attention_inputs,
            time_scale=1.0,
        )
        positive, negative = v[:n].astype(jnp.float32), v[n:].astype(jnp.float32)
        return negative + guidance * (positive - negative)  # Wan's order of operations

    if solver == "euler":

        def euler(i, x):
            return x + (sigmas[i + 1] - sigmas[i]) * velocity(x, timesteps[i])

        return jax.lax.fori_loop(0, run, euler, noise)

    def unipc(i, carry):
        x, x_last, m_prev2, m_prev = carry
        m = x - sigmas[i] * velocity(x, timesteps[i])  # the prediction of the clean latents
        corrected, x_next = unipc_step(x, x_last, m_prev2, m_prev, m, coefficients[i])
        return x_next, corrected, m_prev, m

    zeros = jnp.zeros_like(noise)
    return jax.lax.fori_loop(0, run, unipc, (noise, zeros, zeros, zeros))[0]


def latent_shape(cfg: Config, frames: int | None = None, height: int | None = None, width: int | None = None):
    """The latent (T, H, W) whose decoded video is `frames` x `height` x `width` pixels under the run's codec
    (None: that size of the config's longest bucket); a size the codec cannot make, or whose latent the
    model's patch does not divide, is a ValueError naming the sizes that work."""
    from dsv_jax.data.codec import get_codec

    codec = get_codec(cfg.data.codec)
    base = tuple(default_shape(cfg))
    out = list(base)
    for axis, (name, want) in enumerate((("frames", frames), ("height", height), ("width", width))):
        if want is None:
            continue
        if isinstance(want, bool) or not isinstance(want, (int, np.integer)) or want < 1:
            raise ValueError(f"{name}={want!r} must be a positive whole number of pixels")
        pixels = functools.partial(_pixels_along, codec, base, axis)
        step = cfg.model.patch[axis]
        # the codec maps sizes monotonically: the patch multiples around `want` by bisection
        lo, hi = 0, max(1, int(want))
        while pixels(hi * step) < want:
            hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if pixels(mid * step) < want else (lo, mid)
        if pixels(hi * step) != want:
            near = sorted({pixels(n * step) for n in (lo, hi) if n > 0})
            raise ValueError(
                f"{name} {want} is not a size this model makes: its latents are a multiple of {step} "
                f"(model.patch) and codec {codec.name!r} decodes those to {' or '.join(map(str, near))} near it"
            )
        out[axis] = hi * step
    return tuple(out)


def _pixels_along(codec, base, axis: int, n: int) -> int:
    """Pixels along `axis` of the latent `base` with that axis set to `n`."""
    return int(codec.pixel_shape(tuple(n if a == axis else base[a] for a in range(3)))[axis])


def generate(
    model: Any,
    prompts: str | Sequence[str],
    *,
    frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    seed: int = 0,
    shift: float | None = None,
    text_encoder: Callable | str | None = None,
    negative_prompt: str | Sequence[str] | None = None,
    solver: str | None = None,
    codec: str | None = None,
) -> np.ndarray:
    """Videos of `prompts` from a loaded model: uint8 frames [len(prompts), frames, height, width, 3].

    `model`: a `LoadedModel` (`dsv_jax.load_model(DIR)`: an export or a training workdir) or such a
    directory. The prompts are tokenized with the model's text config (text.encoder=builtin); a model
    trained on precomputed embeddings needs `text_encoder`, the hook its data was prepared with
    (`f(captions) -> (embeddings, mask)`, or its "pkg.module:make" or "umt5:DIR" spec; a umt5:DIR spec
    the data was prepared with is used by default). The latents are decoded with the run's codec (data.codec,
    e.g. wan2.1-vae:DIR). `frames`, `height`, `width`:
    the video's size in pixels (default: the config's longest bucket, decoded); `steps`, `guidance`,
    `solver` (default: the run's train.sample_steps, train.guidance, train.sample_solver) and `shift`
    (default: the run's, see `sampler_shift`) as `dsv-jax sample`'s. `negative_prompt`: the caption that
    guidance steers away from (one, or one per prompt), encoded like the prompts; default the empty caption
    of training. `codec`: decode with this codec spec instead of the run's data.codec (see `with_codec`).
    The same arguments give the same videos; `dsv-jax sample` writes these frames."""
    if isinstance(model, (str, os.PathLike)):
        from dsv_jax.export import load_model

        model = load_model(os.fspath(model))
    cfg = with_codec(model.config, codec)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a caption or a non-empty list of captions, got {prompts!r}")
    if isinstance(text_encoder, str) or (text_encoder is None and cfg.text.encoder != "builtin"):
        text_encoder = load_text_encoder(cfg, text_encoder, (model.info or {}).get("text_encoder"))
    graphdef, params = nnx.split(model.model, nnx.Param)
    return sample_frames(
        cfg,
        graphdef,
        params,
        prompts,
        latent_shape(cfg, frames, height, width),
        controller_state=model.dsv_state,
        steps=cfg.train.sample_steps if steps is None else steps,
        guidance=cfg.train.guidance if guidance is None else guidance,
        seed=seed,
        text_encoder=text_encoder,
        shift=shift,
        negative_prompt=negative_prompt,
        solver=solver,
    )


def with_codec(cfg: Config, codec: str | None) -> Config:
    """`cfg` decoding with `codec` (a spec of data/codec.py) in place of its data.codec: the same VAE at another
    folder, or the VAE of a model whose config names none (an imported Wan 2.1 transformer: wan2.1-vae:DIR).
    The codec's latent channels must be the model's."""
    if not codec:
        return cfg
    import dataclasses

    from dsv_jax.data.codec import get_codec

    channels = get_codec(codec).channels
    if channels != cfg.model.in_channels:
        raise ValueError(
            f"codec {codec!r} has {channels} latent channels; this model takes "
            f"model.in_channels={cfg.model.in_channels}"
        )
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, codec=codec))


def sample_frames(
    cfg: Config,
    graphdef,
    params,
    prompts: Sequence[str],
    shape: tuple[int, int, int],
    *,
    controller_state: dict | None = None,
    steps: int = 30,
    guidance: float = 3.0,
    seed: int = 0,
    text_encoder: Callable | None = None,
    shift: float | None = None,
    negative_prompt: str | Sequence[str] | None = None,
    solver: str | None = None,
) -> np.ndarray:
    """uint8 videos [N, T', H', W', 3] of `prompts` at latent `shape`, with the attention the run's
    controller state decided (DSV stage-2 plans, windows): what `generate` and every sampling command run."""
    from dsv_jax.dsv.policy import make_policy

    policy = make_policy(cfg, controller_state)
    latents = generate_latents(
        cfg,
        graphdef,
        params,
        prompts,
        shape,
        steps=steps,
        guidance=guidance,
        seed=seed,
        attention=policy.plans(shape, train=False),
        attention_inputs=policy.inputs(shape, train=False),
        text_encoder=text_encoder,
        shift=shift,
        negative_prompt=negative_prompt,
        solver=solver,
    )
    if not np.isfinite(latents).all():
        raise ValueError("the sampled videos hold NaN/Inf: the model's parameters are not usable; nothing written")
    return decode_latents(latents, cfg.data.codec)


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
    labels: bool = False,
) -> list[str]:
    """Generate one video per prompt and write them side by side to `path` (or to each of several
    paths, .gif or .mp4: the same videos). Returns the paths written. A DSV run samples with the sparse
    plans of its controller state (stage 2 decisions), a window run with its windows. `labels`: each video
    scaled up to a readable size with its prompt under it (dsv_jax/labels.py), as the end-of-run sample is."""
    paths = [path] if isinstance(path, str) else list(path)
    prompts = list(prompts or default_prompts(cfg))
    frames = sample_frames(
        cfg,
        graphdef,
        params,
        prompts,
        tuple(shape or default_shape(cfg)),
        controller_state=controller_state,
        steps=steps,
        guidance=guidance,
        seed=seed,
        text_encoder=text_encoder,
        shift=shift,
    )
    if labels:
        from dsv_jax.labels import labelled

        frames = labelled(frames, prompts)
    return [save_video(frames, p) for p in paths]


def sample_from_workdir(
    workdir: str,
    out: str | Sequence[str],
    *,
    prompts: Sequence[str] | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    seed: int = 0,
    shape=None,
    step: int | None = None,
    text_encoder: str | None = None,
    weights: str = "auto",
    shift: float | None = None,
    negative_prompt: str | None = None,
    solver: str | None = None,
    codec: str | None = None,
) -> list[str]:
    """Load an exported model (`dsv-jax export`) or the newest readable (or `step`) checkpoint of a
    training workdir and write a video of `prompts` to `out` (one path or several); nothing else is
    written. `text_encoder` (umt5:DIR or pkg.module:make) encodes the prompts for a model trained on
    precomputed text embeddings. `weights` (a training workdir): see `load_trained`; default the EMA of the
    weights where the run kept one. `shift`, `steps`, `guidance`, `solver`, `negative_prompt`, `codec`: see
    `generate`."""
    from dsv_jax.data.codec import get_codec
    from dsv_jax.export import load_model
    from dsv_jax.model.tokens import grid_shape

    model = load_model(workdir, step=step, weights=weights)
    cfg = model.config
    if shape:
        grid_shape(tuple(shape), cfg.model.patch)  # a latent --shape the patch does not divide: said in latents
    size = get_codec(codec or cfg.data.codec).pixel_shape(tuple(shape)) if shape else (None, None, None)
    frames = generate(
        model,
        list(prompts or default_prompts(cfg)),
        frames=size[0],
        height=size[1],
        width=size[2],
        steps=steps,
        guidance=guidance,
        seed=seed,
        shift=shift,
        text_encoder=load_text_encoder(cfg, text_encoder, model.info.get("text_encoder")),
        negative_prompt=negative_prompt,
        solver=solver,
        codec=codec,
    )
    return [save_video(frames, p) for p in ([out] if isinstance(out, str) else list(out))]
