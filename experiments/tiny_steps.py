"""How many training steps the `tiny-motion` preset needs before its samples show the prompted colour, shape
and motion (README's first run): trains runs through the CLI, several at once (one process each: a
tiny model leaves most of a GPU, and most of its host's cores, idle), then scores chosen checkpoints of each.

    python -m experiments.tiny_steps                         # the study, ~6 min on one H200
    python -m experiments.tiny_steps --runs steps2000 steps16000
    python -m experiments.tiny_steps --quick                 # CPU: 20 steps, 2 clips, 1 seed; proves the script works

A checkpoint's score has two parts:
  held out  `dsv_jax.evaluate.semantic_eval`: --clips videos from held-out captions, the share of colour,
            shape and motion questions answered right (what `dsv-jax eval --clips N` prints)
  README    the four README prompts (dsv_jax.sample.DEFAULT_PROMPTS), each sampled with --seeds seeds at the
            run's guidance: per prompt, in how many seeds the clip shows colour, shape and motion all right
Writes experiments/results/tiny_steps.json (--quick: tiny_steps_quick.json) and, per run, the README prompts'
frames (seed 0, frames 1, 3, 5, 8) at its last scored checkpoint: results/samples/tiny_steps_<run>.png.
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import os
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
)
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
            out[prompt].append({**{k: a.said for k, a in answers.items()},
                                "all": all(a.right for a in answers.values())})
    return out


def prompts_shown(answers: dict[str, list[dict]], min_share: float = 0.5) -> int:
    """How many prompts show colour, shape and motion all right in at least `min_share` of their seeds."""
    return sum(np.mean([a["all"] for a in seeds]) >= min_share for seeds in answers.values())


def score_checkpoint(workdir: str, step: int, *, clips: int, seeds: int, frames_png: str | None = None) -> dict:
    from dsv_jax.data.codec import decode_latents, encode_frames
    from dsv_jax.evaluate import semantic_eval
    from dsv_jax.export import load_for_sampling
    from dsv_jax.sample import DEFAULT_PROMPTS, default_shape, generate

    start = time.perf_counter()
    cfg, graphdef, params, controller, _ = load_for_sampling(workdir, step, "raw")
    held_out = semantic_eval(cfg, graphdef, params, controller, clips=clips)["score"]
    shape = tuple(default_shape(cfg))
    videos = [decode_latents(generate(cfg, graphdef, params, DEFAULT_PROMPTS, shape, steps=30,
                                      guidance=cfg.train.guidance, seed=seed), cfg.data.codec)
              for seed in range(seeds)]
    answers = readme_answers([encode_frames(v) for v in videos], DEFAULT_PROMPTS)
    if frames_png:
        save_frames(videos[0], frames_png)
    return {"step": step, "held_out": {"accuracy": held_out["accuracy"], "stderr": held_out["stderr"],
                                       **{k: q["accuracy"] for k, q in held_out["questions"].items()},
                                       "clips": clips},
            "readme_all_right": {p: sum(a["all"] for a in v) for p, v in answers.items()},
            "readme_prompts_shown": prompts_shown(answers), "readme": answers, "seeds": seeds,
            "score_s": time.perf_counter() - start}


def save_frames(videos: np.ndarray, path: str, scale: int = 3) -> str:
    """uint8 videos [N, T, H, W, 3] -> one PNG: a row per video, frames 1, 3, 5, 8 of 8 (spread over any T)."""
    from PIL import Image

    t = videos.shape[1]
    picks = sorted({0, t // 3, (2 * t) // 3, t - 1})
    rows = [np.concatenate([np.pad(v[i], ((1, 1), (1, 1), (0, 0)), constant_values=96) for i in picks], 1)
            for v in videos]
    img = np.concatenate(rows, 0)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(img).resize((img.shape[1] * scale, img.shape[0] * scale), Image.NEAREST).save(path)
    return path


# -- the runs -------------------------------------------------------------------------------------------------

def train_command(run: Run, workdir: str, config: str, extra: list[str]) -> list[str]:
    every = min(1000, *run.score)
    return [sys.executable, "-m", "dsv_jax", "train", "--config", config, "--workdir", workdir, "--no-progress",
            f"train.steps={run.steps}", f"train.ckpt_every={every}", f"train.keep_checkpoints={run.steps // every + 1}",
            "train.sample_at_end=false", *run.overrides, *extra]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="*", help=f"names among {[r.name for r in RUNS]} (default: all)")
    p.add_argument("--config", default="tiny-motion")
    p.add_argument("--clips", type=int, default=48)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--parallel", type=int, default=8, help="runs trained at once")
    p.add_argument("--workdir", help="where the runs go (default: a temporary folder, removed afterwards)")
    p.add_argument("--name", default="tiny_steps")
    p.add_argument("--quick", action="store_true")
    args, extra = p.parse_known_args()
    runs = QUICK_RUNS if args.quick else tuple(r for r in RUNS if not args.runs or r.name in args.runs)
    if args.quick:
        args.clips, args.seeds, args.name = 2, 1, args.name + "_quick"
    if not runs:
        p.error(f"--runs: none of {args.runs} is among {[r.name for r in RUNS]}")
    root = args.workdir or tempfile.mkdtemp(prefix="tiny_steps_")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.1"))
    results, pending = {}, list(runs)
    while pending:
        batch, pending = pending[: args.parallel], pending[args.parallel:]
        procs = []
        for run in batch:
            log = open(os.path.join(root, f"{run.name}.log"), "w")
            start = time.perf_counter()
            procs.append((run, start, log, subprocess.Popen(
                train_command(run, os.path.join(root, run.name), args.config, extra),
                stdout=log, stderr=subprocess.STDOUT, env=env)))
        for run, start, log, proc in procs:
            code = proc.wait()
            log.close()
            results[run.name] = {"steps": run.steps, "overrides": list(run.overrides) + extra,
                                 "train_wall_s": time.perf_counter() - start,
                                 "concurrent_runs": len(batch), "exit": code}
    for run in runs:
        entry = results[run.name]
        if entry["exit"]:
            entry["error"] = open(os.path.join(root, f"{run.name}.log")).read()[-1500:]
            continue
        png = os.path.join(harness.RESULTS_DIR, "samples", f"{args.name}_{run.name}.png")
        entry["checkpoints"] = [
            score_checkpoint(os.path.join(root, run.name), step, clips=args.clips, seeds=args.seeds,
                             frames_png=png if step == run.score[-1] else None)
            for step in run.score]
    rows = [{"run": name, "step": c["step"], "held_out": c["held_out"]["accuracy"], "shape": c["held_out"]["shape"],
             "motion": c["held_out"].get("motion", float("nan")), "prompts_shown": c["readme_prompts_shown"],
             "all_right_by_prompt": "/".join(str(v) for v in c["readme_all_right"].values())}
            for name, r in results.items() for c in r.get("checkpoints", [])]
    harness.print_table(rows, ["run", "step", "held_out", "shape", "motion", "prompts_shown", "all_right_by_prompt"])
    path = harness.write_results(args.name, {"config": args.config, "clips": args.clips, "seeds": args.seeds,
                                             "runs": results})
    print(f"wrote {path}")
    if any(r["exit"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
