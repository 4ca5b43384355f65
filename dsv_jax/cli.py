"""Command line: `dsv-jax <command> ...` (also `python -m dsv_jax <command> ...`).

    dsv-jax train --config NAME [--workdir DIR] [--steps N] [key=value ...]
    dsv-jax sample --workdir DIR --out FILE.gif [--prompt TEXT ...] [--steps N]
    dsv-jax presets
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


def _presets(args) -> int:
    for name in sorted(PRESETS):
        m = get_config(name).model
        print(f"{name:12s} {m.arch:6s} depth={m.depth:3d} heads={m.heads:3d}x{m.head_dim:<4d} hidden={m.hidden}")
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

    p = sub.add_parser("presets", help="list the config presets")
    p.set_defaults(fn=_presets)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.fn(args)
    except (ConfigError, PermissionError, FileNotFoundError, ValueError) as e:
        print(f"dsv-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
