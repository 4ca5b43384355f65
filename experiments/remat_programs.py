"""What a rematerialised train step runs per block, by remat policy: the kernels' custom calls counted in
the program jax lowers (StableHLO) and in the one XLA compiles (HLO after optimisation).

`model.remat_keep_attention` should leave one sparse attention forward per block (kept across the remat)
where the default policy has two (the forward and its recompute in the backward). The CPU test
(tests/test_model_attention.py) checks that on jax's side; this script looks at the GPU's programs, where
jax and XLA are the ones a run uses. It looks for the Hopper path's kernels (Mosaic GPU) and cuDNN's; on
another GPU the sparse kernels are Triton calls, which it does not tell apart. Usage (an H200):

    python -m experiments.remat_programs [--preset 2.7b] [--set model.depth=2] [--shape 16 64 64]

Custom calls are reported as (target, number of results, first result's shape) with their count; a scanned
model's loop body holds one block, so the counts are per block (plus what runs outside the blocks). Each
variant's `sparse_forwards` counts the compiled sparse forward kernels: with the option 1, without 2.
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import collections
import re
import time

import jax
import numpy as np

from dsv_jax.config import get_config
from experiments import harness
from experiments.training import TrainStepBench, stage2_controller

# StableHLO: %r:2 = stablehlo.custom_call @target(...) ... -> (tensor<...>, ...)
LOWERED_CALL = re.compile(r"(?:%\S+?(?::(\d+))? = )?stablehlo\.custom_call @([\w$.-]+)\(.*?->\s*(\(?tensor<[^>]*>)")
# HLO: %name = (bf16[...], f32[...]) custom-call(...), custom_call_target="target"
COMPILED_CALL = re.compile(r"=\s*(\(?[a-z0-9]+\[[0-9,]*\][^=]*?)\s+custom-call\(.*?custom_call_target=\"([^\"]+)\"")


def lowered_calls(text: str) -> dict[str, int]:
    out = collections.Counter()
    for m in LOWERED_CALL.finditer(text):
        results, target, first = m.group(1) or "1", m.group(2), m.group(3).lstrip("(")
        out[f"{target} x{results} {first}"] += 1
    return dict(out)


def compiled_calls(text: str) -> dict[str, int]:
    out = collections.Counter()
    for m in COMPILED_CALL.finditer(text):
        shapes, target = m.group(1), m.group(2)
        first = re.match(r"\(?\s*([a-z0-9]+\[[0-9,]*\])", shapes)
        n = shapes.count("[") if shapes.startswith("(") else 1
        out[f"{target} x{n} {first.group(1) if first else shapes[:40]}"] += 1
    return dict(out)


def attention_calls(text: str) -> list[dict]:
    """The compiled program's attention kernels (Mosaic GPU, cuDNN): result types, the computation that
    holds each call and jax's op_name for it (whose transpose(...) / jvp(...) parts say backward / forward)."""
    out, computation = [], None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            computation = head.group(1)
        m = COMPILED_CALL.search(line)
        if m and ("mosaic" in m.group(2) or "cudnn" in m.group(2)):
            op = re.search(r'op_name="([^"]*)"', line)
            out.append(
                {
                    "target": m.group(2),
                    "results": re.sub(r"\{[^}]*\}", "", m.group(1)),
                    "computation": computation,
                    "op_name": op.group(1) if op else None,
                }
            )
    return out


def sparse_forwards(calls: list[dict]) -> int:
    """Sparse attention forwards among attention_calls: the Mosaic GPU kernels that return the float32 lse
    beside o (dQ returns dq alone, dK/dV two bf16 arrays)."""
    return sum(1 for c in calls if "mosaic" in c["target"] and "f32" in c["results"])


def dsv_setup(cfg, shape, sparsity: float):
    ctl = stage2_controller(cfg, shape, 1.0 - sparsity)
    plans, inputs = ctl.plans(shape, step=1), ctl.inputs(shape, step=1)  # step 1: no predictor loss (every > 1)
    return plans, jax.device_put({k: np.asarray(v) for k, v in inputs.items()})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model on the CPU")
    p.add_argument("--preset", default=None, help="default: 2.7b on a GPU, tiny with --quick")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides, after the defaults (model.depth=2 on a GPU)",
    )
    p.add_argument("--shape", type=int, nargs=3, default=None, help="latent T H W (default 16 64 64 on a GPU)")
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument(
        "--variants",
        default="full,full/keep,dsv,dsv/keep,dsv/keep/no_dsf",
        help="comma-separated ATTENTION[/keep][/no_dsf]: full or dsv; keep: model.remat_keep_attention; "
        "no_dsf: compiled with XLA's dynamic-slice fusion off",
    )
    p.add_argument("--name", default="remat_programs")
    args = p.parse_args()
    preset = args.preset or ("tiny" if args.quick else "2.7b")
    shape = tuple(args.shape or ((4, 16, 16) if args.quick else (16, 64, 64)))
    sets = (["model.remat=true"] if args.quick else ["model.depth=2"]) + args.set  # later overrides win
    variants = {}
    for name in args.variants.split(","):
        attention, *options = name.split("/")
        keep = "keep" in options
        cfg = get_config(
            preset,
            sets
            + [
                "attention=dsv" if attention == "dsv" else "attention=auto",
                f"model.remat_keep_attention={str(keep).lower()}",
            ],
        )
        bench = TrainStepBench(cfg)
        batch = bench.batch(shape)
        plans, inputs = dsv_setup(cfg, shape, args.sparsity) if attention == "dsv" else ("auto", None)
        # no_dsf: XLA's dynamic-slice fusion off (it lets a custom call write straight into a slice of a buffer)
        compiler_options = {"xla_gpu_enable_dynamic_slice_fusion": False} if "no_dsf" in options else None
        t0 = time.perf_counter()
        lowered = bench.lower(batch, plans, inputs)
        exe = lowered.compile(compiler_options)
        text = exe.as_text()
        calls = attention_calls(text)
        variants[name] = {
            "lowered": lowered_calls(lowered.as_text()),
            "compiled": compiled_calls(text),
            "attention_calls": calls,
            "sparse_forwards": sparse_forwards(calls),
            "compile_s": round(time.perf_counter() - t0, 1),
        }
        print(f"== {name}: {variants[name]['sparse_forwards']} sparse forwards ({variants[name]['compile_s']} s)")
        for where in ("lowered", "compiled"):
            for k, n in sorted(variants[name][where].items()):
                if "cublas" not in k and "triton" not in k:
                    print(f"   {where:9s} {n:3d}  {k}")
        for call in variants[name]["attention_calls"]:
            print(f"   {call['target']} {call['results']} in {call['computation']}: {call['op_name']}")
    payload = {
        "device": harness.device_info(),
        "preset": preset,
        "overrides": sets,
        "latent_shape": list(shape),
        "sparsity": args.sparsity,
        "jax_flags": {
            k: v
            for k, v in jax.config.values.items()
            if any(s in k for s in ("remat", "lineariz", "custom_vjp", "scan3"))
        },
        "variants": variants,
    }
    harness.write_results(args.name, payload)


if __name__ == "__main__":
    main()
