"""Command line: `dsv-jax <command> ...` (also `python -m dsv_jax <command> ...`).

    dsv-jax train --config NAME [--workdir DIR] [--steps N] [key=value ...]
    dsv-jax sample --workdir DIR --out FILE.gif [--prompt TEXT ...] [--steps N]
    dsv-jax eval --workdir DIR [--clips N] [--steps N] [--json FILE] [--gif FILE]
    dsv-jax presets
    dsv-jax prepare-data --input DIR --output DIR [--buckets 1x32x32,8x32x48] [--codec pixel:1x2x2] [...]
    dsv-jax fit-cost --config NAME [--out FILE.json] [--batch-sizes 1,2,4] [--target-ms MS] [key=value ...]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dsv_jax.config import PRESETS, ConfigError, get_config


def _train(args) -> int:
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    cfg = get_config(args.config, overrides)
    workdir = args.workdir or os.path.join("runs", cfg.name)
    from dsv_jax.train.trainer import train

    records = train(cfg, workdir, progress=not args.no_progress)
    if records:
        print(f"trained to step {records[-1]['step']}: loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}"
              f" (workdir {workdir})")
    return 0


def _sample(args) -> int:
    from dsv_jax.sample import sample_from_workdir

    shape = tuple(int(v) for v in args.shape.split(",")) if args.shape else None
    if shape is not None and len(shape) != 3:
        raise ConfigError(f"--shape {args.shape!r} must be T,H,W")
    paths = sample_from_workdir(args.workdir, args.out, prompts=args.prompt or None, steps=args.steps,
                                guidance=args.guidance, seed=args.seed, shape=shape, step=args.checkpoint)
    print("wrote " + ", ".join(paths))
    return 0


def _eval(args) -> int:
    import json

    from dsv_jax.evaluate import evaluate_workdir, json_ready, report

    if args.gif and os.path.splitext(args.gif)[1].lower() not in (".gif", ".mp4"):
        raise ConfigError(f"--gif {args.gif!r} must end in .gif or .mp4")
    if args.clips < 0:
        raise ConfigError(f"--clips {args.clips} must be >= 0")
    cfg, step, results = evaluate_workdir(args.workdir, step=args.checkpoint, batches=args.batches, clips=args.clips,
                                          steps=args.steps, guidance=args.guidance, seed=args.seed)
    print(f"{args.workdir} at step {step} (data.source={cfg.data.source}, attention={cfg.attention})")
    print("\n".join(report(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workdir": args.workdir, "step": step, **json_ready(results)}, f, indent=2)
        print(f"wrote {args.json}")
    if args.gif and "semantic" in results:
        from dsv_jax.data.codec import decode_latents
        from dsv_jax.sample import save_video

        print(f"wrote {save_video(decode_latents(results['semantic']['frames']), args.gif)}")
    return 0


def _presets(args) -> int:
    for name in sorted(PRESETS):
        m = get_config(name).model
        print(f"{name:12s} {m.arch:6s} depth={m.depth:3d} heads={m.heads:3d}x{m.head_dim:<4d} hidden={m.hidden}")
    return 0


def _prepare_data(args) -> int:
    from dsv_jax.data.prepare import prepare

    report = prepare(args.input, args.output, args.buckets, codec=args.codec, captions=args.captions,
                     text_encoder=args.text_encoder, workers=args.workers, shard_size=args.shard_size,
                     frame_stride=args.frame_stride, strict=args.strict, overwrite=args.overwrite,
                     progress=not args.no_progress)
    print(report.summary())
    return 0


def _fit_cost(args) -> int:
    cfg = get_config(args.config, list(args.overrides))
    shapes = shares = None
    if args.data:
        from dsv_jax.data.manifest import Manifest

        manifest = Manifest.load(args.data)
        shapes, shares = manifest.shapes, [b["count"] for b in manifest.buckets if b["count"] > 0]
    elif args.shapes:
        from dsv_jax.data.prepare import parse_buckets

        shapes = parse_buckets(args.shapes)
    from dsv_jax.train.shape_bench import fit_cost

    model = fit_cost(cfg, shapes=shapes, shares=shares, batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
                     target_s=args.target_ms / 1e3 if args.target_ms else None,
                     memory_bytes=int(args.memory_gb * 2 ** 30) if args.memory_gb else None,
                     mem_fraction=args.mem_fraction, iters=args.repeats, progress=not args.no_progress)
    out = args.out or os.path.join("runs", f"{cfg.name}-cost.json")
    model.save(out)
    print(f"t = {model.a * 1e3:.3f} ms + {model.b:.4g} s * B * S^{model.p:.3f}  (R^2 {model.r2:.4f}, "
          f"max error {100 * model.max_rel_error:.1f}%, {len(model.info['points'])} points)")
    print(f"M_mem = {model.m_mem:.0f} tokens, M_comp = {model.m_comp:.4g} (target step "
          f"{1e3 * model.info['target_step_s']:.1f} ms); wrote {out}")
    print(f"train with: data.batching=dual data.cost_model={out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv-jax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train (or resume) a model")
    p.add_argument("--config", default="tiny", help=f"preset: {', '.join(sorted(PRESETS))}")
    p.add_argument("--workdir", help="checkpoints, metrics and samples go here (default runs/<config>)")
    p.add_argument("--steps", type=int, help="total training steps (same as train.steps=N)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. model.depth=8")
    p.set_defaults(fn=_train)

    p = sub.add_parser("sample", help="generate videos from a trained workdir")
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True, help="output .gif or .mp4")
    p.add_argument("--prompt", action="append", help="caption (repeat for several videos)")
    p.add_argument("--steps", type=int, default=30, help="Euler steps")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", help="latent T,H,W (default: the config's longest bucket)")
    p.add_argument("--checkpoint", type=int, help="checkpoint step (default: latest)")
    p.set_defaults(fn=_sample)

    p = sub.add_parser("eval", help="held-out loss and semantic score of a trained workdir")
    p.add_argument("--workdir", required=True)
    p.add_argument("--clips", type=int, default=8,
                   help="videos generated from held-out captions for the semantic score (0: none)")
    p.add_argument("--steps", type=int, default=30, help="Euler steps per generated video")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale (default: the config's)")
    p.add_argument("--batches", type=int, help="held-out batches per bucket (default: the config's train.eval_batches)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", type=int, help="checkpoint step (default: latest)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--gif", help="also write the generated videos side by side to this .gif or .mp4")
    p.set_defaults(fn=_eval)

    p = sub.add_parser("presets", help="list the config presets")
    p.set_defaults(fn=_presets)

    p = sub.add_parser("prepare-data", help="videos/images + captions -> ArrayRecord shards for data.path")
    p.add_argument("--input", required=True, help="folder of videos (mp4 webm mov mkv avi gif) and images")
    p.add_argument("--output", required=True, help="dataset folder to write (train with data.path=DIR)")
    p.add_argument("--buckets", default="1x32x32,1x32x48,1x48x32,8x32x32,8x32x48,16x32x48",
                   help="latent bucket shapes TxHxW, comma separated (T=1: images)")
    p.add_argument("--codec", default="pixel:1x2x2",
                   help="latent codec: pixel, pixel:FTxFHxFW (space-to-depth), or pkg.module:fn (your VAE)")
    p.add_argument("--captions", help="caption manifest (.jsonl or .csv with file, caption); else NAME.txt")
    p.add_argument("--text-encoder", help="pkg.module:fn; fn() returns f(captions) -> (emb [N,L,D], mask [N,L])")
    p.add_argument("--workers", type=int, help="reader processes (default: CPUs - 1)")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    p.add_argument("--frame-stride", type=int, default=1, help="take every N-th frame of a video")
    p.add_argument("--strict", action="store_true", help="stop at the first unreadable file")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already in --output")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=_prepare_data)

    p = sub.add_parser("fit-cost", help="time train steps over (B, S), fit t = a + b*B*S^p, write the budgets")
    p.add_argument("--config", default="tiny", help=f"preset: {', '.join(sorted(PRESETS))}")
    p.add_argument("--out", help="JSON to write (default runs/<config>-cost.json)")
    p.add_argument("--data", help="take the shapes from a prepared dataset's manifest")
    p.add_argument("--shapes", help="latent shapes TxHxW,... (default: the config's data.buckets)")
    p.add_argument("--batch-sizes", default="1,2,4", help="samples per data-parallel device to time")
    p.add_argument("--target-ms", type=float,
                   help="step time M_comp is set for (default: the most even step times at <= 3%% throughput cost)")
    p.add_argument("--memory-gb", type=float, help="memory per device (default: the device's, or RAM on CPU)")
    p.add_argument("--mem-fraction", type=float, default=0.9, help="share of the memory M_mem may use")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per grid point (median)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.set_defaults(fn=_fit_cost)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.fn(args)
    except (ConfigError, PermissionError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"dsv-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
