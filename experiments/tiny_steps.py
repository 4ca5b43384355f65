"""How many training steps the `tiny-motion` preset needs before its samples show the prompted colour, shape
and motion (README's first run): trains runs through the CLI, several at once (one process each: a
tiny model leaves most of a GPU, and most of its host's cores, idle), then scores chosen checkpoints of each.

    python -m experiments.tiny_steps                         # the study on one GPU (the steps* runs)
    python -m experiments.tiny_steps --runs iso_h64_3800,iso_h256_900 model.dtype=float32   # other widths
    python -m experiments.tiny_steps --runs steps2000,steps8000 model.dtype=float32   # overrides for every run
    python -m experiments.tiny_steps --quick                 # CPU: 20 steps, 2 clips, 1 seed; proves the script works

A checkpoint's score has two parts:
  held out  `dsv_jax.evaluate.semantic_eval`: --clips videos from held-out captions, the share of colour,
            shape and motion questions answered right (what `dsv-jax eval --clips N` prints)
  README    the four README prompts (dsv_jax.sample.DEFAULT_PROMPTS), each sampled with --seeds seeds at the
            run's guidance: per prompt, in how many seeds the clip shows colour, shape and motion all right
Writes experiments/results/tiny_steps.json (--quick: tiny_steps_quick.json) after every run and, per run, the
README prompts' frames (seed 0; of 8 frames the 1st, 3rd, 6th and 8th) at its last scored checkpoint:
results/samples/tiny_steps_<run>.png (copied to $OUT too). A run that fails, or a checkpoint that cannot be
scored, is recorded with its error and the study goes on.
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import numpy as np

from experiments import harness


class Run(NamedTuple):
    name: str
    steps: int  # train.steps: the length of the learning-rate schedule too
    score: tuple[int, ...]  # checkpoint steps to score
    overrides: tuple[str, ...] = ()


RUNS = (
    Run("steps2000", 2000, (1000, 2000)),  # the preset as README's CPU command runs it (~6 min on 2 cores)
    Run("steps3000", 3000, (3000,)),
    Run("steps4000", 4000, (4000,)),
    Run("steps8000", 8000, (8000,)),
    Run("steps16000", 16000, (8000, 12000, 16000)),
    # About the 2-core CPU time of steps2000 ("iso": within -13% to +20% of it by the CPU step times in
    # results/tiny_cpu_step_widths.jsonl, experiments/step_time.py) with a narrower, wider or shallower model
    Run("iso_h64_3800", 3800, (3800,), ("model.hidden=64", "model.heads=2")),
    Run("iso_h64_b3072_1900", 1900, (1900,), ("model.hidden=64", "model.heads=2", "data.tokens_per_batch=3072")),
    Run("iso_h96_b2048_2000", 2000, (2000,), ("model.hidden=96", "model.heads=3", "data.tokens_per_batch=2048")),
    Run("h64_8000", 8000, (8000,), ("model.hidden=64", "model.heads=2")),
    Run("iso_h256_900", 900, (900,), ("model.hidden=256", "model.heads=4")),
    Run("h256_2000", 2000, (2000,), ("model.hidden=256", "model.heads=4")),
    Run("h256_4000", 4000, (4000,), ("model.hidden=256", "model.heads=4")),
    Run("iso_d2_3700", 3700, (3700,), ("model.depth=2",)),
    Run("iso_d3_2600", 2600, (2600,), ("model.depth=3",)),
    Run("d2_8000", 8000, (8000,), ("model.depth=2",)),
    Run("adam_b2_095_2000", 2000, (2000,), ("train.b2=0.95",)),  # Adam's second moment over ~20 steps, not ~100
)
DEFAULT_RUNS = tuple(r.name for r in RUNS if r.name.startswith("steps"))  # the rest on request (--runs)
QUICK_RUNS = (Run("quick", 20, (10, 20)),)


# -- scoring ------------------------------------------------------------------------------------------------


def readme_answers(clips_by_seed, prompts) -> dict[str, list[dict]]:
    """{prompt: one dict per seed: what the clip showed for each question, and "all": every answer right}
    for clips_by_seed [seeds][prompts] of frames [T, H, W, 3] in [-1, 1]."""
    from dsv_jax.data.semantic import score_clip

    out: dict[str, list[dict]] = {p: [] for p in prompts}
    for clips in clips_by_seed:
        for prompt, frames in zip(prompts, clips):
            answers = score_clip(frames, prompt)
            out[prompt].append(
                {**{k: a.said for k, a in answers.items()}, "all": all(a.right for a in answers.values())}
            )
    return out


def prompts_shown(answers: dict[str, list[dict]], min_share: float = 0.5) -> int:
    """How many prompts show colour, shape and motion all right in at least `min_share` of their seeds."""
    return sum(np.mean([a["all"] for a in seeds]) >= min_share for seeds in answers.values())


def score_checkpoint(workdir: str, step: int, *, clips: int, seeds: int, frames_png: str | None = None) -> dict:
    """The checkpoint's weights as `dsv-jax eval` and `sample` take them (the EMA where the run kept one)."""
    from dsv_jax.data.codec import decode_latents, encode_frames
    from dsv_jax.dsv.policy import make_policy
    from dsv_jax.evaluate import semantic_eval
    from dsv_jax.export import load_for_sampling
    from dsv_jax.sample import DEFAULT_PROMPTS, default_shape, generate_latents

    start = time.perf_counter()
    cfg, graphdef, params, controller, _ = load_for_sampling(workdir, step, "auto")
    held_out = semantic_eval(cfg, graphdef, params, controller, clips=clips)["score"]
    shape = tuple(default_shape(cfg))
    policy = make_policy(cfg, controller)
    attention, inputs = policy.plans(shape, train=False), policy.inputs(shape, train=False)
    videos = [
        decode_latents(
            generate_latents(
                cfg,
                graphdef,
                params,
                DEFAULT_PROMPTS,
                shape,
                steps=30,
                guidance=cfg.train.guidance,
                seed=seed,
                attention=attention,
                attention_inputs=inputs,
            ),
            cfg.data.codec,
        )
        for seed in range(seeds)
    ]
    answers = readme_answers([encode_frames(v) for v in videos], DEFAULT_PROMPTS)
    if frames_png:
        save_frames(videos[0], frames_png)
    return {
        "step": step,
        "held_out": {
            "accuracy": held_out["accuracy"],
            "stderr": held_out["stderr"],
            **{k: q["accuracy"] for k, q in held_out["questions"].items()},
            "clips": clips,
        },
        "readme_all_right": {p: sum(a["all"] for a in v) for p, v in answers.items()},
        "readme_prompts_shown": prompts_shown(answers),
        "readme": answers,
        "seeds": seeds,
        "score_s": time.perf_counter() - start,
    }


def save_frames(videos: np.ndarray, path: str, scale: int = 3) -> str:
    """uint8 videos [N, T, H, W, 3] -> one PNG: a row per video, frames 0, T//3, 2T//3 and T-1 of each."""
    from PIL import Image

    t = videos.shape[1]
    picks = sorted({0, t // 3, (2 * t) // 3, t - 1})
    rows = [
        np.concatenate([np.pad(v[i], ((1, 1), (1, 1), (0, 0)), constant_values=96) for i in picks], 1) for v in videos
    ]
    img = np.concatenate(rows, 0)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(img).resize((img.shape[1] * scale, img.shape[0] * scale), Image.NEAREST).save(path)
    if os.environ.get("OUT"):  # the device tool brings $OUT back
        shutil.copy(path, os.environ["OUT"])
    return path


# -- the runs -------------------------------------------------------------------------------------------------

# set by this script for every run: the schedule and which checkpoints exist
OWN_KEYS = ("train.steps", "train.ckpt_every", "train.keep_checkpoints", "train.sample_at_end")


def train_command(run: Run, workdir: str, config: str, overrides: list[str]) -> list[str]:
    """`dsv-jax train` for `run`: a checkpoint at every step of run.score (every gcd of them), all kept."""
    if not run.score or max(run.score) > run.steps or min(run.score) < 1:
        raise ValueError(f"run {run.name}: score steps {run.score} must lie in 1..{run.steps}")
    every = math.gcd(*run.score)
    return [
        sys.executable,
        "-m",
        "dsv_jax",
        "train",
        "--config",
        config,
        "--workdir",
        workdir,
        "--no-progress",
        f"train.steps={run.steps}",
        f"train.ckpt_every={every}",
        f"train.keep_checkpoints={run.steps // every + 1}",
        "train.sample_at_end=false",
        *run.overrides,
        *overrides,
    ]


def train_all(runs, root: str, config: str, overrides: list[str], parallel: int) -> dict:
    """Train `runs`, `parallel` at once: {name: {"exit", "train_wall_s", "concurrent_runs", ...}}."""
    env = dict(
        os.environ,
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
        XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.1"),
    )
    out, pending = {}, list(runs)
    while pending:
        batch, pending = pending[:parallel], pending[parallel:]
        live = {}
        try:
            for run in batch:
                workdir = os.path.join(root, run.name)
                shutil.rmtree(workdir, ignore_errors=True)  # never resume an older run of the same name
                log = open(os.path.join(root, f"{run.name}.log"), "w")
                proc = subprocess.Popen(
                    train_command(run, workdir, config, overrides), stdout=log, stderr=subprocess.STDOUT, env=env
                )
                live[run.name] = (run, log, proc, time.perf_counter())
            while live:
                for name, (run, log, proc, start) in list(live.items()):
                    if proc.poll() is not None:
                        log.close()
                        out[name] = {
                            "steps": run.steps,
                            "overrides": [*run.overrides, *overrides],
                            "train_wall_s": time.perf_counter() - start,
                            "concurrent_runs": len(batch),
                            "exit": proc.returncode,
                        }
                        del live[name]
                time.sleep(0.5)
        finally:
            for _, log, proc, _ in live.values():  # interrupted: no orphaned training processes
                proc.kill()
                log.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--runs",
        help=f"comma-separated names among {','.join(r.name for r in RUNS)} (default: {','.join(DEFAULT_RUNS)})",
    )
    p.add_argument("--config", default="tiny-motion")
    p.add_argument("--clips", type=int, default=48)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--parallel", type=int, default=8, help="runs trained at once")
    p.add_argument("--workdir", help="where the runs go (default: a temporary folder, removed afterwards)")
    p.add_argument("--name", default="tiny_steps")
    p.add_argument("--quick", action="store_true", help="CPU, one 20-step run: proves the script works")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")
    args = p.parse_intermixed_args()
    own = [o for o in args.overrides if o.split("=", 1)[0] in OWN_KEYS]
    if own or any("=" not in o for o in args.overrides):
        p.error(f"overrides must be key=value and not set {', '.join(OWN_KEYS)} (the runs do): {args.overrides}")
    names = args.runs.split(",") if args.runs else list(DEFAULT_RUNS)
    unknown = sorted(set(names) - {r.name for r in RUNS})
    if unknown:
        p.error(f"--runs: unknown {unknown}; the runs are {[r.name for r in RUNS]}")
    runs = QUICK_RUNS if args.quick else tuple(r for r in RUNS if r.name in names)
    if args.quick:
        args.clips, args.seeds, args.name = 2, 1, args.name + "_quick"
    root = args.workdir or tempfile.mkdtemp(prefix="tiny_steps_")
    os.makedirs(root, exist_ok=True)
    try:
        results = train_all(runs, root, args.config, args.overrides, args.parallel)
        payload = {"config": args.config, "clips": args.clips, "seeds": args.seeds, "runs": results}
        for run in runs:
            entry = results[run.name]
            if entry["exit"]:
                entry["error"] = open(os.path.join(root, f"{run.name}.log")).read()[-1500:]
                continue
            png = os.path.join(harness.RESULTS_DIR, "samples", f"{args.name}_{run.name}.png")
            entry["checkpoints"] = []
            for step in run.score:
                try:
                    entry["checkpoints"].append(
                        score_checkpoint(
                            os.path.join(root, run.name),
                            step,
                            clips=args.clips,
                            seeds=args.seeds,
                            frames_png=png if step == run.score[-1] else None,
                        )
                    )
                except Exception as e:  # one unreadable checkpoint does not lose the study
                    entry["checkpoints"].append({"step": step, "error": harness.error_text(e)})
            harness.write_results(args.name, payload)  # after every run: an interrupted study keeps what it scored
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    rows = [
        {
            "run": name,
            "step": c["step"],
            "held_out": c["held_out"]["accuracy"],
            "shape": c["held_out"]["shape"],
            "motion": c["held_out"].get("motion", float("nan")),
            "prompts_shown": c["readme_prompts_shown"],
            "all_right_by_prompt": "/".join(str(v) for v in c["readme_all_right"].values()),
        }
        for name, r in results.items()
        for c in r.get("checkpoints", [])
        if "error" not in c
    ]
    harness.print_table(rows, ["run", "step", "held_out", "shape", "motion", "prompts_shown", "all_right_by_prompt"])
    path = harness.write_results(args.name, payload)
    print(f"wrote {path}")
    failed = [n for n, r in results.items() if r["exit"] or any("error" in c for c in r.get("checkpoints", []))]
    if failed:
        print(f"failed: {failed} (errors in the results file)")
        sys.exit(1)


if __name__ == "__main__":
    main()
