"""Does a trained model's motion follow its caption? A probe of a shapes run (`data.source` synthetic).

For moving clips x0 of the embedded dataset (renderer seed 123), noised to x_t = (1 - t) x0 + t eps, the
model's prediction of x0 (x_t - t v) is measured for the object's displacement (salience centroid, second
half of the frames minus the first) along the clip's true direction, with three captions: the clip's own, the same
with the direction word flipped (left <-> right, up <-> down), and the empty caption. A model whose motion
follows the text moves the object the flipped way under the flipped caption; one that reads motion only
from the noisy input gives the same displacement under both, and at t = 1 (pure noise) has no motion to
read, so a sample's direction is left to chance.

    python -m experiments.motion_probe --workdir runs/tiny [--name motion_probe]
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv_jax.data import synthetic
from dsv_jax.export import load_for_sampling
from dsv_jax.sample import prompt_batch
from experiments import harness

FLIP = {"left": "right", "right": "left", "up": "down", "down": "up"}
TIMES = (0.98, 0.95, 0.9, 0.8, 0.6, 0.4)


def centroid_shift(frames) -> np.ndarray:
    """[N, 2] (dy, dx) pixels: the salience-weighted centroid (distance of each pixel from its frame's median
    colour, above the frame's mean distance) of the second half of each clip's frames minus the first half's.
    frames [N, T, H, W, C]."""
    f = np.asarray(frames, np.float64)
    t, h, w = f.shape[1:4]
    sal = np.linalg.norm(f - np.median(f, axis=(2, 3), keepdims=True), axis=-1)
    sal = np.maximum(sal - sal.mean(axis=(2, 3), keepdims=True), 0.0)
    yy, xx = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    mass = sal.sum(axis=(2, 3)) + 1e-9
    centre = np.stack([(sal * yy).sum(axis=(2, 3)) / mass, (sal * xx).sum(axis=(2, 3)) / mass], -1)
    half = t // 2
    return centre[:, t - half :].mean(1) - centre[:, :half].mean(1)


def moving_clips(n: int, shape, seed: int = 123):
    """n clips of the embedded dataset that move, their captions and unit directions [n, 2] (dy, dx)."""
    clips, captions, key = [], [], 0
    while len(clips) < n:
        frames, caption = synthetic.render(seed, (key,), shape)
        key += 1
        if " moving " in caption:
            clips.append(frames)
            captions.append(caption)
    directions = np.array([synthetic.DIRECTIONS[c.rsplit(" ", 1)[1]] for c in captions])
    return np.stack(clips), captions, directions


def flipped(caption: str) -> str:
    head, word = caption.rsplit(" ", 1)
    return f"{head} {FLIP[word]}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="a training workdir (or export) of a shapes model")
    p.add_argument("--clips", type=int, default=48)
    p.add_argument("--shape", type=int, nargs=3, default=(8, 32, 32), help="latent T H W of the probe clips")
    p.add_argument("--name", default="motion_probe")
    p.add_argument("--quick", action="store_true", help="(for the harness: run on the CPU)")
    args = p.parse_args()
    cfg, graphdef, params, *_ = load_for_sampling(args.workdir)
    x0, captions, directions = moving_clips(args.clips, tuple(args.shape))
    x0 = jnp.asarray(x0)

    @jax.jit
    def predict_x0(params, batch, xt, t):
        model = nnx.merge(graphdef, params)
        text, mask = model.encode_text(batch)
        v = model(xt, jnp.full((xt.shape[0],), t), text, mask).astype(jnp.float32)
        return xt - t * v

    def along(frames):  # displacement along each clip's true direction, pixels
        return (centroid_shift(frames) * directions).sum(-1)

    texts = {"caption": captions, "flipped": [flipped(c) for c in captions], "empty": [""] * len(captions)}
    batches = {k: {n: jnp.asarray(a[: len(v)]) for n, a in prompt_batch(cfg, v).items()} for k, v in texts.items()}
    rows = []
    truth = float(along(x0).mean())
    for i, t in enumerate(TIMES):
        xt = (1 - t) * x0 + t * jax.random.normal(jax.random.key(i), x0.shape)
        row = {"t": t, "noisy_input": float(along(xt).mean())}
        for k, batch in batches.items():
            shift = along(predict_x0(params, batch, xt, jnp.float32(t)))
            row[k] = float(shift.mean())
            row[f"{k}_share_positive"] = float(np.mean(shift > 0))
        rows.append(row)
    harness.print_table(
        rows, ["t", "noisy_input", "caption", "flipped", "empty", "caption_share_positive", "flipped_share_positive"]
    )
    print(f"the clips themselves: {truth:+.2f} px along their direction")
    harness.write_results(
        args.name,
        {
            "workdir": args.workdir,
            "config": cfg.name,
            "clips": args.clips,
            "latent_shape": list(args.shape),
            "truth_px": truth,
            "units": "mean displacement (px) of the x0 prediction's salience centroid, "
            "second half of the frames minus the first, along each clip's "
            "true direction",
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
