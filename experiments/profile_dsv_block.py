"""Where a DSV block's train-step time goes at kv_block 16 against 64: the 2.7B block shapes at 64k tokens.

    python -m experiments.profile_dsv_block                     # one H100 / H200, ~3 min: kv64, kv16, kv16-q128
    python -m experiments.profile_dsv_block --variants kv64,kv16 --predictor
    python -m experiments.profile_dsv_block --lower             # CPU: what the GPU programs run (no timing)

The `2.7b` preset with one block (`model.depth=1`; the scan's body is the block of the 32-block model), DSV stage
2 at uniform head sparsity 0.9 with the plans and runtime inputs the trainer's controller makes, B = 1, latents
64 x 64 x 64 (65,536 tokens), one train step (forward, the remat's recomputed forward, backward, AdamW) on the
GPU's paths: the Mosaic GPU sparse kernels and the Triton selection. Variants (VARIANTS): the KV block, and the
query tile that the token layout's 3D tile sets (the preset's 4x4x4 tile makes 64-row query tiles, with which
16-token blocks run dQ and the fine dK/dV kernel; 4x4x8 tiles make 128-row tiles, where the fused backward is
the default: `pallas_kernels.tuning.mgpu_defaults`). Steps skip the predictor loss (stage 2's steps between
predictor steps; the loss samples token-level logits, whatever the KV block) unless --predictor.

GPU: each variant in a child process (harness.in_child): compile, one warm-up step, --steps timed steps
(median), then one step under jax's profiler (harness.device_profile, CUDA graphs off) whose device time is
summed by category (`category`: sparse kernels by pass, their index work, the selection, the predictor, text
cross attention, the rest) and by op; a table of each category per variant and its difference from the first.

--lower (CPU): the same steps lowered for CUDA (the GPU paths forced, nothing compiled or run): per variant the
kernels' custom calls and the element counts of sorts, gathers and scatters, with the source lines that make
the largest (what a GPU step runs besides the kernels). Writes experiments/results/profile_dsv_block.json
(--lower: profile_dsv_block_lowered.json; and $OUT/ when set).
"""

from __future__ import annotations

import os
import sys

if "--lower" not in sys.argv[1:]:  # the profiler needs XLA's kernels as themselves, not as CUDA graphs
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
else:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

# isort: split

import argparse
import collections
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv_jax.config import get_config
from experiments import harness
from experiments.harness import error_text
from experiments.training import TrainStepBench, run_steps, stage2_controller

SHAPE = (64, 64, 64)  # latent frames, height, width: 64 x 32 x 32 tokens at patch 1x2x2
SPARSITY = 0.9
VARIANTS = {  # name -> config overrides
    "kv64": ["dsv.kv_block=64"],  # the preset's 4x4x4 tile: 64-row query tiles (bench_e2e's 2.7B runs)
    "kv16": ["dsv.kv_block=16"],  # 64-row query tiles: dQ + the fine 16-row dK/dV (no fused backward)
    "kv16-q128": ["dsv.kv_block=16", "model.tile=[4,4,8]"],  # 128-row tiles: the fused backward (default there)
    "kv64-q128": ["dsv.kv_block=64", "model.tile=[4,4,8]"],
    "kv16-q128-split": ["dsv.kv_block=16", "model.tile=[4,4,8]"],  # with the fused backward off (KERNEL_TUNING)
}
# variant -> Mosaic GPU tuning forced on every sparse call (pallas_kernels.tuning.MGPU_TUNABLE)
KERNEL_TUNING = {"kv16-q128-split": {"fused_backward": False}}
BASE = ["attention=dsv", "model.depth=1"]
PRESET = "2.7b"


def config(name: str, extra=()):
    return get_config(PRESET, BASE + VARIANTS[name] + list(extra))


def step_setup(cfg, predictor: bool):
    """(plans, inputs) of a stage-2 step at SPARSITY: step 0 trains the predictor, step 1 does not."""
    ctl = stage2_controller(cfg, SHAPE, 1.0 - SPARSITY)
    step = 0 if predictor else 1
    return ctl.plans(SHAPE, step=step), ctl.inputs(SHAPE, step=step)


def force_tuning(tuning: dict) -> None:
    """Every Mosaic GPU sparse call of this process takes `tuning` (the model passes none)."""
    from pallas_kernels import sparse_attention_mgpu as mgpu

    attend = mgpu.attention  # the dispatcher's entry (as it stands: --lower has made it non-interpreted)
    mgpu.attention = lambda *a, **k: attend(*a, **{**k, "tuning": {**(k.get("tuning") or {}), **tuning}})


# -- categories of a profile -------------------------------------------------------------------------------

SELECTION_FILES = ("lowrank_topk_triton.py", "lowrank_topk.py", "lowrank_topk_reference.py", "selection.py")
SPARSE_GLUE_FILES = ("sparse_attention_mgpu.py", "sparse_index.py", "sparse_attention_reference.py", "mgpu_common.py")


def category(op: dict) -> str:
    """A profiled op's category: "sparse kernel (fwd | remat | bwd)" for the Mosaic GPU kernels, "sparse index
    and delta (pass)" for the XLA work around them (sanitized index, dK/dV work list, delta), "selection",
    "predictor", "text cross attention", else "rest"."""
    scope = op.get("scope") or ""
    where = scope.split(":", 1)[0] if ":" in scope else "?"
    source = re.search(r"\(([^():]+):\d+\)$", scope)
    file = source.group(1) if source else ""
    if "mosaic" in (op.get("kernel") or "").lower():
        return f"sparse kernel ({where})"
    if file in SELECTION_FILES:
        return f"selection ({where})"
    if file == "predictor.py":
        return f"predictor ({where})"
    if file in SPARSE_GLUE_FILES:
        return f"sparse index and delta ({where})"
    if file == "dense.py":
        return "text cross attention"
    return "rest"


def summarise_profile(prof: dict) -> dict:
    """Device ms by category, and the sparse kernels one by one (ms, pass)."""
    by = collections.Counter()
    kernels = []
    for op in prof.get("ops", []):
        cat = category(op)
        by[cat] += op["ms"]
        if cat.startswith("sparse kernel"):
            kernels.append({"op": op["op"], "ms": op["ms"], "calls": op["calls"], "pass": cat[15:-1]})
    return {"categories": dict(by.most_common()), "kernels": sorted(kernels, key=lambda k: -k["ms"])}


# -- a child: one variant on the GPU ----------------------------------------------------------------------


def measure(job: dict) -> dict:
    name, predictor, steps = job["variant"], job["predictor"], job["steps"]
    out = {"variant": name, "device": jax.devices()[0].device_kind, "overrides": VARIANTS[name]}
    try:
        if name in KERNEL_TUNING:
            force_tuning(KERNEL_TUNING[name])
        cfg = config(name)
        plans, inputs = step_setup(cfg, predictor)
        plan = plans[0]
        layout_tile = cfg.model.tile[0] * cfg.model.tile[1] * cfg.model.tile[2]
        out.update(q_tile=layout_tile, kv_block=plan.kv_block or layout_tile, keep=plan.keep, predictor=plan.predictor)
        train = TrainStepBench(cfg)
        batch = train.batch(SHAPE)
        inputs = jax.device_put({k: jnp.asarray(v) for k, v in inputs.items()})
        t0 = time.perf_counter()
        exe = train.lower(batch, plans, inputs).compile()
        out["compile_s"] = time.perf_counter() - t0
        args = (batch, jnp.float32(cfg.train.lr), inputs)
        state = train.new_state()
        state, warm = run_steps(exe, state, args, 1)
        state, timed = run_steps(exe, state, args, steps)
        out.update(warmup_s=warm.times_s[0], step_s=statistics.median(timed.times_s), steps_s=timed.times_s)
        out["compiles_timed"] = timed.compiles
        holder = {"state": state}

        def one_step():
            holder["state"], _ = run_steps(exe, holder["state"], args, 1)

        prof = harness.device_profile(one_step, exe.as_text(), top=100_000)
        out["device_ms"], out["wall_ms"] = prof.get("device_ms"), prof.get("wall_ms")
        out.update(summarise_profile(prof))
        out["top_ops"] = prof.get("ops", [])[:25]
    except Exception as e:
        out["error"] = error_text(e, trace=True)
    return out


def run_gpu(args) -> dict:
    budget = harness.Budget(args.budget_s)
    results = []
    for name in args.variants.split(","):
        if not budget.allows(40):
            results.append({"variant": name, "skipped": "time budget"})
            continue
        job = {"variant": name, "predictor": args.predictor, "steps": args.steps}
        t0 = time.perf_counter()
        r = harness.in_child("experiments.profile_dsv_block", ["--job", json.dumps(job)], min(budget.left(), 400))
        r.setdefault("variant", name)
        r["wall_s"] = time.perf_counter() - t0
        results.append(r)
        print(f"[{budget.elapsed():5.0f} s] {name}: {r.get('error', '').splitlines()[0] if 'error' in r else 'ok'}")
    ok = [r for r in results if "categories" in r]
    if ok:
        names = list(dict.fromkeys(c for r in ok for c in r["categories"]))
        base = ok[0]
        rows = []
        for cat in ["step (wall, s)", "device total"] + names:
            row = {"ms": cat}
            for r in ok:
                value = (
                    1e3 * r["step_s"]
                    if cat == "step (wall, s)"
                    else r["device_ms"]
                    if cat == "device total"
                    else r["categories"].get(cat, 0.0)
                )
                row[r["variant"]] = value
                if r is not base:
                    ref = (
                        1e3 * base["step_s"]
                        if cat == "step (wall, s)"
                        else base["device_ms"]
                        if cat == "device total"
                        else base["categories"].get(cat, 0.0)
                    )
                    row[f"{r['variant']} - {base['variant']}"] = value - ref
            rows.append(row)
        print("\nms per step of the one-block model (a 32-block step: ~32x the block's share)")
        harness.print_table(rows, list(rows[0]))
        for r in ok:
            shown = ", ".join(f"{k['pass']} {k['ms']:.2f}" for k in r["kernels"])
            print(f"{r['variant']}: q_tile {r['q_tile']}, kv_block {r['kv_block']}: sparse kernels (ms) {shown}")
    return {"results": results}


# -- the CPU lowering ------------------------------------------------------------------------------------------


def force_gpu_paths() -> None:
    """Make this CPU process lower the GPU's paths: sparse attention on the Mosaic GPU kernels, the selection
    on the Triton kernel (Hopper tuning), neither interpreted (the program is lowered for CUDA, never run)."""
    from dsv_jax.dsv import selection
    from pallas_kernels import sparse_attention as dispatch
    from pallas_kernels import sparse_attention_mgpu as mgpu
    from pallas_kernels.lowrank_topk_triton import lowrank_topk_pallas
    from pallas_kernels.tuning import _HOPPER

    dispatch.kernel_path = lambda *a, **k: ("mgpu", [])
    attend = mgpu.sparse_attention_mgpu
    mgpu.attention = lambda *a, **k: attend(*a, **{**k, "interpret": False})

    def topk(q_lr, k_lr, top_k, *, q_tile, kv_block, block_reduce="mean", kv_valid=None, impl="auto"):
        return lowrank_topk_pallas(
            q_lr,
            k_lr,
            top_k,
            q_tile=q_tile,
            kv_block=kv_block,
            block_reduce=block_reduce,
            tuning=_HOPPER[1],
            interpret=False,
            kv_valid=kv_valid,
        )

    selection.lowrank_topk = topk


WATCHED = ("sort", "gather", "scatter", "scatter-add", "cumsum", "argsort", "pallas_call", "dot_general")


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def _source(eqn, source_info_util) -> str:
    """The innermost frame of this repository that made an equation (file:line function), else its name stack."""
    frames = source_info_util.user_frames(eqn.source_info.traceback) if eqn.source_info.traceback else []
    for frame in frames:
        if "/dsv_jax/" in frame.file_name or "/pallas_kernels/" in frame.file_name:
            return f"{os.path.basename(frame.file_name)}:{frame.start_line} {frame.function_name}"
    stack = str(eqn.source_info.name_stack)
    return stack[-80:] if stack else "?"


def jaxpr_ops(jaxpr) -> dict:
    """What a step's jaxpr (forward, the remat's recomputation and the backward, traced) runs, each equation
    once (a scan's body once: one block): per primitive of WATCHED the equations and the elements of their
    first output, the source lines that make the most, and the Pallas kernels by name."""
    from jax._src import source_info_util

    counts, sizes = collections.Counter(), collections.Counter()
    where = collections.defaultdict(collections.Counter)
    kernels = collections.Counter()

    def walk(jx):
        for eqn in jx.eqns:
            name = eqn.primitive.name
            if name in WATCHED:
                shape = getattr(eqn.outvars[0].aval, "shape", ())
                n = int(np.prod(shape)) if shape else 1
                counts[name] += 1
                sizes[name] += n
                src = _source(eqn, source_info_util)
                if src == "?":  # no frame kept (e.g. under a transpose): the shape tells it
                    src = f"? {eqn.primitive.name}{list(shape)}"
                where[name][src] += n
                if name == "pallas_call":
                    info = eqn.params.get("name_and_src_info") or eqn.params.get("name")
                    kernels[str(getattr(info, "name", info))] += 1
            for sub in _subjaxprs(eqn):
                walk(sub)

    walk(jaxpr)
    return {
        "counts": dict(counts),
        "elements": dict(sizes),
        "kernels": dict(kernels),
        "largest_by_source": {k: dict(v.most_common(8)) for k, v in where.items()},
    }


def run_lower(args) -> dict:
    force_gpu_paths()
    results = []
    for name in args.variants.split(","):
        out = {"variant": name, "overrides": VARIANTS[name]}
        from pallas_kernels import sparse_attention_mgpu as mgpu

        entry = mgpu.attention
        try:
            if name in KERNEL_TUNING:
                force_tuning(KERNEL_TUNING[name])
            cfg = config(name, ["model.adaln_impl=xla", "model.dtype=bfloat16"])  # the GPU's dtype; AdaLN: alike in all
            plans, inputs = step_setup(cfg, args.predictor)
            train = TrainStepBench(cfg)
            plain = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
            from dsv_jax.train.step import make_train_step
            from dsv_jax.train.trainer import batch_spec

            step = make_train_step(cfg, train.graphdef, plans)
            abstract = [
                plain(train.abstract_state),
                plain(batch_spec(cfg, train.mesh, 1, SHAPE)),
                jax.ShapeDtypeStruct((), jnp.float32),
                plain({k: jnp.asarray(v) for k, v in inputs.items()}),
            ]
            t0 = time.perf_counter()
            traced = jax.jit(step).trace(*abstract)
            out.update(jaxpr_ops(traced.jaxpr.jaxpr))
            text = traced.lower(lowering_platforms=("cuda",)).as_text()  # lowers for the GPU: the kernels fit
            out["custom_calls"] = dict(collections.Counter(re.findall(r"custom_call @([\w$.-]+)", text)))
            out["lower_s"] = time.perf_counter() - t0
        except Exception as e:
            out["error"] = error_text(e, trace=True)
        finally:
            mgpu.attention = entry  # the next variant without this one's tuning
        results.append(out)
        print(json.dumps({k: v for k, v in out.items() if k != "largest_by_source"}, default=str)[:1500], flush=True)
    rows = []
    for field in ("counts", "elements", "kernels", "custom_calls"):
        for k in sorted({k for r in results for k in r.get(field, {})}):
            scale = 1e-6 if field == "elements" else 1
            label = f"{k} elements (M)" if field == "elements" else f"{field[:-1]} {k}"
            rows.append({"op": label, **{r["variant"]: r.get(field, {}).get(k, 0) * scale for r in results}})
    print()
    harness.print_table(rows, ["op"] + [r["variant"] for r in results])
    for r in results:
        for kind, places in r.get("largest_by_source", {}).items():
            if kind != "dot_general":
                print(r["variant"], kind, {p: f"{n / 1e6:.2f}M" for p, n in places.items()})
    return {"results": results}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="kv64,kv16,kv16-q128", help=f"comma-separated, of {sorted(VARIANTS)}")
    parser.add_argument("--predictor", action="store_true", help="steps that train the predictor (step 0)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant after one warm-up")
    parser.add_argument("--budget-s", type=float, default=190.0, help="start no variant after this")
    parser.add_argument("--lower", action="store_true", help="CPU: lower the GPU programs and count what they run")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        harness.answer(measure(json.loads(args.job)))
        return
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; known: {sorted(VARIANTS)}")
    if not args.lower and not harness.on_gpu():
        sys.exit("profile_dsv_block times a GPU; on a CPU run it with --lower")
    payload = run_lower(args) if args.lower else run_gpu(args)
    config_info = {"preset": PRESET, "overrides": BASE, "shape": SHAPE, "sparsity": SPARSITY, "variants": VARIANTS}
    path = harness.write_results(
        "profile_dsv_block" + ("_lowered" if args.lower else ""),
        {"config": {**config_info, "predictor": args.predictor, "argv": sys.argv[1:]}, **payload},
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
