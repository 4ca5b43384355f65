"""Median train-step time of one preset and attention variant, through the library's stable API only.

    python -m experiments.step_time --preset 2.7b-mmdit --latents 64,64,64 --attention dsv0.9
    PYTHONPATH=OLD_CHECKOUT python experiments/step_time.py ...     # the same step on an older library

It uses only what every version of the library since the DSV controller has (get_config, init_state,
the trainer's batch_spec / lower_train_step, DSVController), and nothing of experiments/ (which an older
checkout may lack: run by its path, the script takes the library from PYTHONPATH), so one command times a
change before and after (experiments/results/RESULTS.md, "MMDiT"). Random latents and caption
ids, B = 1, one warm-up step, then the median of --steps; the state is donated from step to step. Prints one
JSON line and appends it to --out when given, with the compiled program's cost analysis (FLOPs and bytes that
XLA counts; a scanned block counted once).

    GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647 \
    python -m experiments.step_time --preset tiny-motion --latents 1,32,32 --batch 24 --attention full \
        --dtype float32 attention=auto model.hidden=64 model.heads=2       # a CPU step as the CLI runs it

(on a CPU the CLI keeps freed memory mapped, dsv_jax/host_memory.py; a script that imports jax first gets the
same only from GLIBC_TUNABLES at its start, as above.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv_jax.config import get_config
from dsv_jax.dsv.controller import DSVController
from dsv_jax.parallel.mesh import make_mesh, state_shardings
from dsv_jax.train.step import abstract_model, init_state
from dsv_jax.train.trainer import batch_spec, lower_train_step


def stage2(cfg, shape, sparsity: float):
    """Plans and runtime inputs of a DSV stage-2 step with every head at `sparsity` (the controller's own)."""
    depth, heads = cfg.model.depth, cfg.model.heads
    ctl = DSVController(cfg)
    key = "x".join(map(str, shape))
    ctl.load_state_dict(
        {
            "stage": 2,
            "switch_step": 0,
            "loss_ema": 0.0,
            "shapes": {
                key: {
                    "sparsity": np.full((depth, heads), sparsity).tolist(),
                    "rungs": [ctl.rung_for(1 - sparsity)] * depth,
                    "profiles": 1,
                }
            },
        }
    )
    return ctl.plans(shape), ctl.inputs(shape)


def cost(compiled) -> dict:
    """XLA's own count of the program's FLOPs and bytes accessed (empty where the backend gives none)."""
    analysis = compiled.cost_analysis()
    analysis = (analysis[0] if analysis else {}) if isinstance(analysis, list) else (analysis or {})
    return {k.replace(" ", "_"): analysis[k] for k in ("flops", "bytes accessed") if k in analysis}


def main(argv=None) -> None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # read when jax's backend starts, below
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="2.7b-mmdit")
    p.add_argument("--latents", default="64,64,64", help="latent T,H,W")
    p.add_argument("--attention", default="dsv0.9", help="full, or dsvS (DSV stage 2 at head sparsity S)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--label", default="", help="recorded with the result (e.g. the commit)")
    p.add_argument("--out", help="JSON lines file to append the result to")
    p.add_argument("--batch", type=int, default=1, help="samples a step")
    p.add_argument("--dtype", default="bfloat16", help="model.dtype")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides after attention=dsv and the dtype (attention=auto for --attention full)",
    )
    args = p.parse_intermixed_args(argv)
    shape = tuple(int(v) for v in args.latents.split(","))
    cfg = get_config(args.preset, ["attention=dsv", f"model.dtype={args.dtype}", *args.overrides])
    if args.attention != "full" and cfg.attention != "dsv":
        p.error(f"--attention {args.attention} needs attention=dsv, not {cfg.attention}")
    mesh = make_mesh(cfg.parallel, jax.devices()[:1])
    abstract = jax.eval_shape(lambda: init_state(cfg))
    shardings = state_shardings(abstract, mesh)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    spec = batch_spec(cfg, mesh, args.batch, shape)
    k1, k2 = jax.random.split(jax.random.key(0))
    batch = {
        "latents": jax.random.normal(k1, spec["latents"].shape, jnp.float32),
        "text_ids": jax.random.randint(k2, spec["text_ids"].shape, 1, 200),
        "text_mask": jnp.ones(spec["text_mask"].shape, bool),
    }
    batch = {k: jax.device_put(v, spec[k].sharding) for k, v in batch.items()}
    if args.attention == "full":
        plans, inputs = "auto", None
    else:
        plans, inputs = stage2(cfg, shape, float(args.attention.removeprefix("dsv")))
        inputs = jax.device_put({k: jnp.asarray(v) for k, v in inputs.items()})
    graphdef = abstract_model(cfg)[0]
    t0 = time.perf_counter()
    step = lower_train_step(cfg, graphdef, plans, abstract, shardings, batch, inputs).compile()
    compile_s = time.perf_counter() - t0
    state = jax.jit(lambda: init_state(cfg), out_shardings=shardings)()
    lr = jnp.float32(cfg.train.lr)
    extra = (inputs,) if inputs is not None else ()
    times = []
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        state, metrics = step(state, batch, lr, *extra)
        loss = float(jax.block_until_ready(metrics["loss"]))
        if i:
            times.append(time.perf_counter() - t0)
    tokens = args.batch * int(np.prod([s // p for s, p in zip(shape, cfg.model.patch)]))
    result = {
        "preset": args.preset,
        "latents": list(shape),
        "batch": args.batch,
        "tokens": tokens,
        "attention": args.attention,
        "dtype": args.dtype,
        "overrides": args.overrides,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "cost": cost(step),
        "label": args.label,
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "compile_s": compile_s,
        "step_s": statistics.median(times),
        "step_times_s": times,
        "tokens_per_s": tokens / statistics.median(times),
        "loss": loss,
        "finite": bool(np.isfinite(loss)),
    }
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
