"""Command line: `dsv-jax <command> ...` (also `python -m dsv_jax <command> ...`).

    dsv-jax train --config NAME|FILE.yaml|RUN/config.json [--workdir DIR] [--steps N] [--checkpoint STEP]
        [--init-from EXPORT_DIR] [--no-progress] [--status-every SECONDS] [key=value ...]
        [--coordinator HOST:PORT --num-processes N --process-id I]   (several hosts; SLURM / OpenMPI: detected)
        Exit status: 0 trained to the end; 143 (SIGTERM) or 130 (Ctrl-C) stopped early with a checkpoint
        saved (rerun the same command to resume); 1 failed (a diverged run too); 2 a bad argument or input.
    dsv-jax sample --model DIR --out FILE.gif|FILE.mp4 [--prompt TEXT ...] [--negative-prompt TEXT] [--steps N]
        [--shift S] [--solver euler|unipc] [--checkpoint STEP] [--text-encoder umt5:DIR|pkg.module:fn]
        [--codec SPEC] [--weights auto|ema|raw]
    dsv-jax export --workdir RUN --out DIR [--dtype bf16|fp32] [--checkpoint STEP] [--weights auto|ema|raw]
        [--format dsv|diffusers]
    dsv-jax import-weights --from DIR --out DIR [--dtype bf16|fp32]   (a Wan 2.1 transformer: diffusers or original)
    dsv-jax presets [--show NAME]
    dsv-jax eval --workdir DIR [--clips N] [--steps N] [--shift S] [--json FILE] [--gif FILE] [--weights auto|ema|raw]
    dsv-jax prepare-data --input DIR --output DIR [--buckets 1x32x32,8x32x48] [--codec pixel:1x2x2] [...]
        (--codec wan2.1-vae:DIR --text-encoder umt5:DIR: Wan 2.1's VAE and umT5, dsv_jax/data/wan.py)
    dsv-jax fit-cost --config NAME [--out FILE.json] [--batch-sizes 1,2,4] [--target-ms MS] [key=value ...]
    dsv-jax --version

Options and key=value overrides mix in any order. A failure prints one or two lines; --debug adds
the traceback (a training run also appends it to WORKDIR/error.log; a failure that looks like a bug in a
command without a work directory of its own writes it to a temporary file that the message names).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

from dsv_jax.config import PRESETS, ConfigError, config_yaml, get_config, load_config
from dsv_jax.errors import is_disk_full, report
from dsv_jax.host_memory import keep_freed_memory

VIDEO_EXTS = (".gif", ".mp4")


# the options that name a file or folder (argparse dest: flag); an empty value is a mistake, never "here"
PATH_OPTIONS = {
    "workdir": "--workdir",
    "model": "--model",
    "out": "--out",
    "output": "--output",
    "input": "--input",
    "config": "--config",
    "captions": "--captions",
    "json": "--json",
    "gif": "--gif",
    "data": "--data",
    "source": "--from",
    "init_from": "--init-from",
}


def check_paths(args) -> None:
    """An empty or blank path option (`--workdir ""`) stops in one line: it would otherwise mean the
    default (runs/<config>) or the current folder."""
    for dest, flag in PATH_OPTIONS.items():
        value = getattr(args, dest, None)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and not v.strip():
                raise ConfigError(f"{flag} is empty ({v!r}): give a path")


def check_workdir(path: str, flag: str = "--workdir") -> None:
    """A folder the command will make or write into: neither a file nor under one, and writable where it
    exists. Checked before anything is made (nothing is created here)."""
    target = probe = os.path.abspath(path)
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)  # the nearest existing folder, where it will be made
    if not os.path.isdir(probe):
        where = f"{flag} {path!r}" if probe == target else f"{flag} {path!r}: {probe!r}"
        raise ConfigError(f"{where} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = f"{flag} {path!r}" if probe == target else f"{flag} {path!r} ({probe!r})"
        raise ConfigError(f"{where} is not writable (permission denied)")


def is_run_dir(path: str) -> bool:
    """A training work directory: what a run writes first (its config) or keeps (its checkpoints)."""
    return os.path.isfile(os.path.join(path, "config.json")) or os.path.isdir(os.path.join(path, "checkpoints"))


def owned_log_dir(args) -> str | None:
    """Where a failure's traceback may go: the work directory of a training run, when the run made it or it
    is a run's (never a folder of the user's that the run failed to start in); else None."""
    path = getattr(args, "log_dir", None)
    if not path or not os.path.isdir(path):
        return None
    return path if getattr(args, "log_dir_made", False) or is_run_dir(path) else None


def train_config_source(args) -> str:
    """What `train` builds its config on: --config; else, starting from an export (--init-from DIR, or a
    train.init_from=DIR override), the export's config, so that its model is the run's, or, where --workdir
    already holds a checkpoint (which wins over the export: the run resumes), the run's own; else tiny."""
    if args.config:
        return args.config
    init_from = args.init_from or next(
        (o.split("=", 1)[1] for o in reversed(args.overrides) if o.split("=", 1)[0].strip() == "train.init_from"),
        "",
    )
    if not init_from:
        return "tiny"
    from dsv_jax.train.init_from import has_checkpoints, init_config

    saved = os.path.join(args.workdir or "", "config.json")
    if args.workdir and has_checkpoints(os.path.join(args.workdir, "checkpoints")) and os.path.isfile(saved):
        return saved  # the same command resumes even where the export has moved since
    init_config(init_from)  # a folder that is no export stops here, in one line
    return os.path.join(init_from, "config.json")


def _train(args) -> int:
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.init_from is not None:
        overrides.append(f"train.init_from={args.init_from}")
    cfg = load_config(train_config_source(args), overrides)  # every value checked before anything is made
    workdir = args.workdir or os.path.join("runs", cfg.name)
    check_workdir(workdir)
    if not args.status_every > 0:
        raise ConfigError(f"--status-every {args.status_every:g} must be > 0 seconds")
    args.log_dir, args.log_dir_made = workdir, not os.path.exists(workdir)
    from dsv_jax.train.distributed import initialize

    initialize(args.coordinator, args.num_processes, args.process_id)  # several processes: SLURM, OpenMPI, flags
    from dsv_jax.train.trainer import TrainingStopped, train

    try:
        records = train(
            cfg, workdir, progress=not args.no_progress, checkpoint=args.checkpoint, status_every=args.status_every
        )
    except TrainingStopped as e:  # not done, not failed: a scheduler requeues on the status (README)
        print(f"dsv-jax train: {e}", file=sys.stderr)
        return e.exit_status
    if records:
        print(finished_line(workdir, records))
    return 0


def finished_line(workdir: str, records: list[dict]) -> str:
    """The end of a run in one line: the training loss, the held-out loss of the last step (from the run's
    metrics.jsonl; with an EMA of the weights that one too, which sample and eval use) and the sample's path."""
    from dsv_jax.train.metrics import read_metrics
    from dsv_jax.train.trainer import sample_path

    step = records[-1]["step"]
    line = f"trained to step {step} in {workdir}: loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}"
    try:
        held = [r for r in read_metrics(workdir) if r.get("step") == step]
    except OSError:  # another host of a multi-host run, whose workdir is not shared
        held = []
    for key, what in (("eval_loss", "held-out loss"), ("train_records_loss", "loss on training records")):
        found = [r for r in held if key in r]
        if found:
            ema = found[-1].get(f"{key}_ema")
            line += f", {what} {found[-1][key]:.4f}" + (f" (EMA of the weights {ema:.4f})" if ema is not None else "")
            break
    if os.path.isfile(sample_path(workdir, step)):
        line += f", sample {sample_path(workdir, step)}"
    return line


def _check_shift(shift: float | None) -> None:
    if shift is not None and not (math.isfinite(shift) and shift > 0):
        raise ConfigError(f"--shift {shift:g} must be a finite number > 0 (1: the uniform time grid)")


def _sample(args) -> int:
    _check_shift(args.shift)
    from dsv_jax.sample import sample_from_workdir

    try:
        shape = tuple(int(v) for v in args.shape.split(",")) if args.shape else None
    except ValueError:
        shape = ()
    if shape is not None and (len(shape) != 3 or min(shape) < 1):
        raise ConfigError(f"--shape {args.shape!r} must be three positive sizes T,H,W")
    for out in args.out:
        if os.path.splitext(out)[1].lower() not in VIDEO_EXTS:
            raise ConfigError(f"--out {out!r}: the file name must end in {' or '.join(VIDEO_EXTS)}")
    paths = sample_from_workdir(
        args.model,
        args.out,
        prompts=args.prompt or None,
        steps=args.steps,
        guidance=args.guidance,
        seed=args.seed,
        shape=shape,
        step=args.checkpoint,
        text_encoder=args.text_encoder,
        weights=args.weights,
        shift=args.shift,
        negative_prompt=args.negative_prompt,
        solver=args.solver,
        codec=args.codec,
    )
    print("wrote " + ", ".join(paths))
    return 0


def _export(args) -> int:
    check_workdir(args.out, "--out")
    if args.format == "diffusers":
        from dsv_jax.wan.convert import export_diffusers

        if not os.path.isdir(args.workdir):
            raise ConfigError(f"--workdir {args.workdir!r} is not a directory")
        out = export_diffusers(
            args.workdir,
            args.out,
            dtype=args.dtype,
            overwrite=args.overwrite,
            step=args.checkpoint,
            weights=args.weights,
        )
        print(f"exported {args.workdir} to {out} in diffusers' Wan layout (WanTransformer3DModel.from_pretrained)")
        return 0
    from dsv_jax.export import export

    out = export(
        args.workdir, args.out, dtype=args.dtype, step=args.checkpoint, overwrite=args.overwrite, weights=args.weights
    )
    files = [f + "/" if os.path.isdir(os.path.join(out, f)) else f for f in sorted(os.listdir(out))]
    print(f"exported {args.workdir} to {out}: {', '.join(files)} (load it with dsv_jax.load_model({out!r}))")
    if "dsv.json" not in files:
        print("  no dsv.json: it holds DSV's sparse-attention decisions, written for attention=dsv runs only")
    return 0


def _import_weights(args) -> int:
    check_workdir(args.out, "--out")
    from dsv_jax.wan.convert import import_weights

    out = import_weights(args.source, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"imported {args.source} to {out} (load it with dsv_jax.load_model({out!r}); train from it with --init-from)")
    return 0


def _eval(args) -> int:
    import json

    _check_shift(args.shift)
    from dsv_jax.evaluate import evaluate_workdir, json_ready, report, run_description
    from dsv_jax.sample import default_shape, sampler_shift

    if args.gif and os.path.splitext(args.gif)[1].lower() not in (".gif", ".mp4"):
        raise ConfigError(f"--gif {args.gif!r} must end in .gif or .mp4")
    if args.clips < 0:
        raise ConfigError(f"--clips {args.clips} must be >= 0")
    cfg, step, results = evaluate_workdir(
        args.workdir,
        step=args.checkpoint,
        weights=args.weights,
        batches=args.batches,
        clips=args.clips,
        steps=args.steps,
        guidance=args.guidance,
        seed=args.seed,
        shift=args.shift,
    )
    print(f"{args.workdir} at step {step} ({run_description(cfg)})")
    print("\n".join(report(results)))
    if args.json:
        with open(args.json, "w") as f:
            sampler = {
                "clips": args.clips,
                "steps": args.steps,
                "seed": args.seed,
                "guidance": cfg.train.guidance if args.guidance is None else args.guidance,
                "shift": sampler_shift(cfg, default_shape(cfg), args.shift),
            }
            json.dump({"workdir": args.workdir, "step": step, "sampler": sampler, **json_ready(results)}, f, indent=2)
        print(f"wrote {args.json}")
    if args.gif and "semantic" in results:
        from dsv_jax.data.codec import decode_latents
        from dsv_jax.sample import save_video

        print(f"wrote {save_video(decode_latents(results['semantic']['frames']), args.gif)}")
    return 0


def _presets(args) -> int:
    if args.show:
        print(config_yaml(get_config(args.show)), end="")
        return 0
    rows = preset_table()
    widths = [max(len(k), *(len(r[k]) for r in rows)) for k in rows[0]]
    for line in [list(rows[0])] + [list(r.values()) for r in rows]:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip())
    print("(each DiT preset is also accepted as NAME-dit, e.g. 2.7b-dit)")
    return 0


def _count(n: float) -> str:
    """1593008 -> '1.59M' (three significant digits)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def listed_presets() -> list[str]:
    """The presets by name, without the NAME-dit aliases (accepted everywhere a preset is)."""
    return [name for name in sorted(PRESETS) if not (name.endswith("-dit") and name[: -len("-dit")] in PRESETS)]


def preset_table(names=None) -> list[dict[str, str]]:
    """One row per preset: architecture, sizes, parameters (counted from the config, as the model has
    them: dsv_jax/model/size.py) and tokens; `dsv-jax presets` prints it and docs/guide/training.md's table
    shows it. No jax: the listing takes a fraction of a second."""
    from dsv_jax.model.size import parameter_count

    rows = []
    for name in names or listed_presets():
        cfg = get_config(name)
        m = cfg.model
        params = parameter_count(cfg)
        tokens = [math.prod(s // p for s, p in zip(shape, m.patch)) for shape in cfg.data.buckets]
        rows.append(
            {
                "preset": name,
                "arch": "MMDiT" if m.arch == "mmdit" else "DiT",
                "blocks x heads x dim": f"{m.depth} x {m.heads} x {m.head_dim}",
                "hidden": str(m.hidden),
                "parameters": _count(params),
                "DSV predictors": "+" + _count(parameter_count(get_config(name, ["attention=dsv"])) - params),
                "video tokens / sample": f"{min(tokens):,}-{max(tokens):,}",
                "tokens / batch": f"{cfg.data.tokens_per_batch:,}",
                "text tokens": str(cfg.text.max_len),
            }
        )
    return rows


def _prepare_data(args) -> int:
    check_workdir(args.output, "--output")
    from dsv_jax.data.prepare import prepare

    report = prepare(
        args.input,
        args.output,
        args.buckets,
        codec=args.codec,
        captions=args.captions,
        text_encoder=args.text_encoder,
        workers=args.workers,
        shard_size=args.shard_size,
        frame_stride=args.frame_stride,
        strict=args.strict,
        overwrite=args.overwrite,
        eval_fraction=args.eval_fraction,
        progress=not args.no_progress,
    )
    print(report.summary())
    return 0


def _fit_cost(args) -> int:
    cfg = load_config(args.config, list(args.overrides))
    shapes = shares = None
    if args.data:
        from dsv_jax.data.manifest import Manifest

        manifest = Manifest.load(args.data)
        shapes, shares = manifest.shapes, [b["count"] for b in manifest.buckets if b["count"] > 0]
    elif args.shapes:
        from dsv_jax.data.prepare import parse_buckets

        shapes = parse_buckets(args.shapes)
    from dsv_jax.train.shape_bench import fit_cost

    model = fit_cost(
        cfg,
        shapes=shapes,
        shares=shares,
        batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
        target_s=args.target_ms / 1e3 if args.target_ms else None,
        memory_bytes=int(args.memory_gb * 2**30) if args.memory_gb else None,
        mem_fraction=args.mem_fraction,
        iters=args.repeats,
        progress=not args.no_progress,
    )
    out = args.out or os.path.join("runs", f"{cfg.name}-cost.json")
    model.save(out)
    print(
        f"t = {model.a * 1e3:.3f} ms + {model.b:.4g} s * B * S^{model.p:.3f}  (R^2 {model.r2:.4f}, "
        f"max error {100 * model.max_rel_error:.1f}%, {len(model.info['points'])} points)"
    )
    print(
        f"M_mem = {model.m_mem:.0f} tokens, M_comp = {model.m_comp:.4g} (target step "
        f"{1e3 * model.info['target_step_s']:.1f} ms); wrote {out}"
    )
    print(f"train with: data.batching=dual data.cost_model={out}")
    return 0


CONFIG_HELP = (
    f"a preset ({', '.join(listed_presets())}; NAME-dit: the DiT preset NAME) or a YAML / JSON config file "
    "whose 'name:' is the preset it extends (a run's config.json re-runs it; default tiny)"
)

NO_PROGRESS_HELP = "no progress bar (none is drawn either where stderr is not a terminal)"


SHIFT_HELP = (
    "time-grid shift at the sampled shape (> 1: more steps near noise; default: the run's "
    "train.sample_shift, scaled to the shape when train.resolution_shift_ref is set)"
)

WEIGHTS_HELP = (
    "which weights of a training workdir's checkpoint: auto (default) the EMA of the weights where the "
    "run kept one (train.ema_decay > 0), else the trained weights; ema; raw (the trained weights)"
)


def version_line() -> str:
    """`dsv-jax --version`: the installed package's version, or in a source checkout that pip never installed
    the one in dsv_jax/__init__.py; with jax's and Python's, which a bug report needs too."""
    import platform
    from importlib import metadata

    from dsv_jax import __version__

    try:
        ours = metadata.version("dsv-jax")
    except metadata.PackageNotFoundError:
        ours = f"{__version__} (source checkout, not installed)"
    try:
        jax = metadata.version("jax")
    except metadata.PackageNotFoundError:
        jax = "not installed"
    return f"dsv-jax {ours}; jax {jax}; Python {platform.python_version()}"


class Parser(argparse.ArgumentParser):
    """Usage errors in one line (argparse prints the whole usage block first)."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dsv-jax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)  # accepted before or after the command
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging (orbax and absl too)"
    )
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="print the full traceback of a failure"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (orbax and absl too)")
    parser.add_argument("--debug", action="store_true", help="print the full traceback of a failure")
    parser.add_argument("--version", action="version", version=version_line(), help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train (or resume) a model", parents=[common])
    p.add_argument("--config", help=CONFIG_HELP + " (default: tiny; with --init-from, the export's config)")
    p.add_argument("--workdir", help="checkpoints, metrics and samples go here (default runs/<config>)")
    p.add_argument("--steps", type=int, help="total training steps (same as train.steps=N)")
    p.add_argument(
        "--checkpoint",
        type=int,
        metavar="STEP",
        help="resume from this checkpoint step (default: the newest readable one); newer steps "
        "are moved to checkpoints-set-aside/",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (none is drawn either where stderr is not a terminal); status lines instead",
    )
    p.add_argument(
        "--status-every",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="without a progress bar, log the step, loss, tokens/s and ETA (or what it is compiling) at "
        "least this often (default 30)",
    )
    p.add_argument(
        "--init-from",
        metavar="DIR",
        help="start a new run from the model weights of an export (dsv-jax export, import-weights); its model "
        "config must be the run's (without --config the run takes the export's config); a checkpoint in the "
        "workdir wins (same as train.init_from=DIR)",
    )
    p.add_argument("--coordinator", help="multi-process run: HOST:PORT of process 0 (SLURM / OpenMPI: detected)")
    p.add_argument("--num-processes", type=int, help="multi-process run: number of processes")
    p.add_argument("--process-id", type=int, help="multi-process run: this process's index")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. model.depth=8")
    p.set_defaults(fn=_train)

    p = sub.add_parser("sample", help="generate videos from an exported model or a training workdir", parents=[common])
    p.add_argument(
        "--model",
        "--workdir",
        dest="model",
        required=True,
        metavar="DIR",
        help="an exported model (dsv-jax export) or a training workdir",
    )
    p.add_argument(
        "--out",
        required=True,
        action="append",
        help="output .gif or .mp4 (repeat for both: the same videos in each file)",
    )
    p.add_argument("--prompt", action="append", help="caption (repeat for several videos)")
    p.add_argument(
        "--negative-prompt",
        metavar="TEXT",
        help="the caption guidance steers away from, for every prompt, encoded as the prompts are (default: the "
        'empty caption of training; "" encodes the empty string, as Wan\'s pipeline does without one)',
    )
    p.add_argument("--steps", type=int, help="sampling steps (default: the config's train.sample_steps)")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale (default: the config's)")
    p.add_argument("--shift", type=float, help=SHIFT_HELP)
    p.add_argument(
        "--solver",
        choices=("euler", "unipc"),
        help="flow ODE solver: euler, or unipc (Wan's second-order multistep) (default: train.sample_solver)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the initial noise (default 0)")
    p.add_argument("--shape", help="latent T,H,W (default: the config's longest bucket)")
    p.add_argument(
        "--checkpoint",
        type=int,
        metavar="STEP",
        help="checkpoint step of a training workdir (default: the newest readable one)",
    )
    p.add_argument(
        "--text-encoder",
        help="umt5:DIR or pkg.module:fn, as prepare-data's: encodes the prompts of a model trained on precomputed "
        "text embeddings (default: a umt5:DIR its dataset was prepared with)",
    )
    p.add_argument(
        "--codec",
        help="decode with this codec instead of the run's data.codec, e.g. wan2.1-vae:DIR (an imported Wan model, "
        "or the VAE moved)",
    )
    p.add_argument("--weights", choices=("auto", "ema", "raw"), default="auto", help=WEIGHTS_HELP)
    p.set_defaults(fn=_sample)

    p = sub.add_parser("eval", help="held-out loss and semantic score of a trained workdir", parents=[common])
    p.add_argument("--workdir", required=True, metavar="DIR", help="the training workdir to evaluate")
    p.add_argument(
        "--clips",
        type=int,
        default=8,
        help="videos generated from held-out captions for the semantic score (0: none; default 8)",
    )
    p.add_argument("--steps", type=int, default=30, help="sampling steps per generated video (default 30)")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale (default: the config's)")
    p.add_argument("--shift", type=float, help=SHIFT_HELP)
    p.add_argument("--batches", type=int, help="held-out batches per bucket (default: the config's train.eval_batches)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated videos' noise (default 0)")
    p.add_argument("--checkpoint", type=int, metavar="STEP", help="checkpoint step (default: the newest readable one)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--gif", help="also write the generated videos side by side to this .gif or .mp4")
    p.add_argument("--weights", choices=("auto", "ema", "raw"), default="auto", help=WEIGHTS_HELP)
    p.set_defaults(fn=_eval)

    p = sub.add_parser(
        "export", help="write a trained model's parameters, config and DSV plans for inference", parents=[common]
    )
    p.add_argument("--workdir", required=True, help="the training workdir")
    p.add_argument("--out", required=True, help="folder to write (load it with dsv_jax.load_model(DIR))")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="parameter dtype (default bf16)")
    p.add_argument("--checkpoint", type=int, metavar="STEP", help="checkpoint step (default: the newest readable one)")
    p.add_argument("--overwrite", action="store_true", help="replace what --out holds")
    p.add_argument("--weights", choices=("auto", "ema", "raw"), default="auto", help=WEIGHTS_HELP)
    p.add_argument(
        "--format",
        choices=("dsv", "diffusers"),
        default="dsv",
        help="dsv (default): our export, for dsv_jax.load_model; diffusers: a Wan model in diffusers' layout "
        "(WanTransformer3DModel.from_pretrained), from a training workdir or an export such as import-weights'",
    )
    p.set_defaults(fn=_export)

    p = sub.add_parser(
        "import-weights",
        help="import a Wan 2.1 text-to-video transformer (diffusers or original safetensors) as an export",
        parents=[common],
    )
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="DIR",
        help="a Wan transformer folder: config.json and *.safetensors (sharded with an index, or one file), in "
        "diffusers' layout or the original release's; a diffusers pipeline folder is read for its transformer/",
    )
    p.add_argument("--out", required=True, help="export folder to write (dsv_jax.load_model(DIR), train --init-from)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="parameter dtype (default bf16)")
    p.add_argument("--overwrite", action="store_true", help="replace what --out holds")
    p.set_defaults(fn=_import_weights)

    p = sub.add_parser("presets", help="list the config presets with their parameter counts", parents=[common])
    p.add_argument("--show", metavar="NAME", help="print preset NAME as YAML (a starting point for --config FILE)")
    p.set_defaults(fn=_presets)

    p = sub.add_parser(
        "prepare-data", help="videos/images + captions -> ArrayRecord shards for data.path", parents=[common]
    )
    p.add_argument("--input", required=True, help="folder of videos (mp4 webm mov mkv avi gif) and images")
    p.add_argument("--output", required=True, help="dataset folder to write (train with data.path=DIR)")
    p.add_argument(
        "--buckets",
        default="1x32x32,1x32x48,1x48x32,8x32x32,8x32x48,16x32x48",
        help="latent bucket shapes TxHxW, comma separated (T=1: images; default %(default)s)",
    )
    p.add_argument(
        "--codec",
        default="pixel:1x2x2",
        help="latent codec: pixel, pixel:FTxFHxFW (space-to-depth), wan2.1-vae:DIR[?dtype=bf16&tiling=1] (Wan 2.1's "
        "VAE), or pkg.module:fn (your VAE) (default %(default)s)",
    )
    p.add_argument("--captions", help="caption manifest (.jsonl or .csv with file, caption); else NAME.txt")
    p.add_argument(
        "--text-encoder",
        help="umt5:DIR[?max_len=512&dtype=bf16] (Wan's umT5), or pkg.module:fn; fn() returns "
        "f(captions) -> (emb [N,L,D], mask [N,L])",
    )
    p.add_argument("--workers", type=int, help="reader processes (default: CPUs - 1)")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default %(default)s)")
    p.add_argument("--frame-stride", type=int, default=1, help="take every N-th frame of a video (default 1: all)")
    p.add_argument("--strict", action="store_true", help="stop at the first unreadable file")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already in --output")
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="hold out this share of the files (by a hash of their names) for evaluation (default 0: none)",
    )
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    p.set_defaults(fn=_prepare_data)

    p = sub.add_parser(
        "fit-cost", help="time train steps over (B, S), fit t = a + b*B*S^p, write the budgets", parents=[common]
    )
    p.add_argument("--config", default="tiny", help=CONFIG_HELP)
    p.add_argument("--out", help="JSON to write (default runs/<config>-cost.json)")
    p.add_argument("--data", help="take the shapes from a prepared dataset's manifest")
    p.add_argument("--shapes", help="latent shapes TxHxW,... (default: the config's data.buckets)")
    p.add_argument(
        "--batch-sizes", default="1,2,4", help="samples per data-parallel device to time (default %(default)s)"
    )
    p.add_argument(
        "--target-ms",
        type=float,
        help="step time M_comp is set for (default: the most even step times at <= 3%% throughput cost)",
    )
    p.add_argument("--memory-gb", type=float, help="memory per device (default: the device's, or RAM on CPU)")
    p.add_argument(
        "--mem-fraction", type=float, default=0.9, help="share of the memory M_mem may use (default %(default)s)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed steps per grid point (median; default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.set_defaults(fn=_fit_cost)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """argparse takes positionals (the overrides) only in one run, so `a=1 --steps 5 b=2` leaves b=2
    over: key=value items left over join the overrides, in command-line order."""
    args, extra = parser.parse_known_args(argv)
    overrides = [x for x in extra if "=" in x and not x.startswith("-")]
    unknown = [x for x in extra if x not in overrides or not hasattr(args, "overrides")]
    if unknown:
        print(
            f"dsv-jax {args.command}: error: unrecognized arguments: {' '.join(unknown)} "
            f"(see dsv-jax {args.command} --help)",
            file=sys.stderr,
        )
        sys.exit(2)
    if overrides:
        args.overrides = list(args.overrides) + overrides
    return args


def setup_logging(verbose: bool, debug: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # orbax logs its writer threads' failures with tracebacks; the error we raise says it in a line
    quiet = {
        "absl": logging.CRITICAL,
        "orbax": logging.CRITICAL,
        "asyncio": logging.CRITICAL,
        "tensorboardX": logging.ERROR,
        "jax._src": logging.WARNING,
    }
    for noisy, level in quiet.items():
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose or debug else level)


# the commands that run XLA:CPU programs step after step (dsv_jax/host_memory.py)
HOST_MEMORY_COMMANDS = ("train", "sample", "eval", "fit-cost")


def main(argv=None) -> int:
    args = parse_args(build_parser(), argv)
    debug = getattr(args, "debug", False)
    setup_logging(getattr(args, "verbose", False), debug)
    if args.command in HOST_MEMORY_COMMANDS:
        keep_freed_memory()  # before jax starts its threads: the arenas they get are made after this
    try:
        check_paths(args)
        code = args.fn(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:  # `dsv-jax presets | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"dsv-jax {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        code = report(args.command, e, workdir=owned_log_dir(args), debug=debug)
        if is_disk_full(e) and not debug:  # writers flushing at exit fail on the same full disk: already said
            sys.stderr.flush()
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
        return code


if __name__ == "__main__":
    sys.exit(main())
