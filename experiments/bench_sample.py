"""Sampling speed on Wan 2.1's shapes: the DiT's time for a guided sampling run through dsv_jax.generate's
compiled loop (dsv_jax.sample._sample with the preset's solver, UniPC for Wan: one program for all steps, the
conditional and the unconditional branch batched), full attention (cuDNN) against DSV stage 2 at a set
sparsity, the predictor's selection included. Random weights: these are speed figures.

    python -m experiments.bench_sample --preset wan2.1-t2v-1.3b --length 480p --steps 50
    python -m experiments.bench_sample --preset wan2.1-t2v-14b --length 720p --steps 2   # x 25 for 50 steps
    python -m experiments.bench_sample --quick                                            # CPU, tiny model

Per variant: compile time (lowered and compiled before any timing; nothing compiles while timed), then
--repeats runs of the whole loop of --steps guided steps (2 x steps forward passes at batch 2), each blocked
on; median and spread; the time per step and the projection to 50 steps (x 50 / steps: the loop's steps all
run the same program, so its time is linear in them). Text: random embeddings of the preset's 512 tokens (what
umT5 gives after Wan's zero-filled tail), a fresh random tensor per variant. Weights: random in bf16, made on
the device (a 14B model in fp32 would not fit one card with its activations). Before timing, both variants run
one step from the same noise and their outputs are compared at keep 1.0 (DSV through the sparse kernel with
every KV block) against full attention: the same velocity within bf16 rounding.
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv_jax.config import get_config
from dsv_jax.dsv.plan import AttentionPlan
from dsv_jax.dsv.policy import make_policy
from dsv_jax.model.flops import forward_flops
from dsv_jax.model.t2v import TextToVideo
from dsv_jax.sample import _sample
from dsv_jax.solvers import make_schedule
from experiments import harness
from experiments.training import stage2_controller

LENGTHS = {"480p": (21, 60, 104), "720p": (21, 90, 160)}  # 81 frames: latent T x H x W (Wan's VAE: 4x8x8)
QUICK = [
    "model.hidden=64",
    "model.heads=2",
    "model.depth=2",
    "model.mlp_width=96",
    "model.text_dim=32",
    "text.max_len=16",
    "model.tile=[1,4,4]",
    "dsv.rank=8",
]
QUICK_LENGTH = (3, 16, 24)


def random_params(cfg, seed: int = 0):
    """(graphdef, bf16 parameters) of a random model made inside one jitted function, so that only the bf16
    copy is ever whole on the device; zero-initialised entries (gates, the final projection) get noise too, so
    that every block's attention reaches the output."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TextToVideo(cfg, rngs=nnx.Rngs(0))))

    @jax.jit
    def make(key):
        model = TextToVideo(cfg, rngs=nnx.Rngs(params=key))
        state = nnx.state(model, nnx.Param)
        leaves, tree = jax.tree.flatten(state)
        keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
        noisy = [(a + 0.02 * jax.random.normal(k, a.shape)).astype(jnp.bfloat16) for a, k in zip(leaves, keys)]
        return jax.tree.unflatten(tree, noisy)

    return graphdef, make(jax.random.key(seed))


def text_batch(cfg, seed: int) -> dict:
    """One prompt's random embeddings and an unconditional branch of zeros (as generate's batch holds them)."""
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((1, cfg.text.max_len, cfg.model.text_dim)).astype(np.float32)
    return {
        "text_emb": jnp.asarray(np.concatenate([emb, np.zeros_like(emb)])),
        "text_mask": jnp.ones((2, cfg.text.max_len), bool),
    }


def attention_for(cfg, shape, name: str):
    """(plans, runtime inputs) of a variant: full = the dense backend; dsvX = stage 2 at head sparsity X."""
    if name == "full":
        return "auto", None
    keep = 1.0 - float(name.removeprefix("dsv"))
    policy = make_policy(cfg, stage2_controller(cfg, shape, keep).state_dict())
    plans = policy.plans(shape, train=False)
    return (tuple(plans) if isinstance(plans, list) else plans), policy.inputs(shape, train=False)


def compile_loop(cfg, graphdef, params, batch, shape, steps, attention, inputs):
    schedule = make_schedule(cfg.train.sample_solver, steps, cfg.train.sample_shift)
    noise = jax.random.normal(jax.random.key(0), (1, *shape, cfg.model.in_channels))
    grid = [jnp.asarray(schedule.sigmas), jnp.asarray(schedule.timesteps)]
    grid.append(None if schedule.coefficients is None else jnp.asarray(schedule.coefficients))
    args = (graphdef, params, batch, noise, inputs, *grid, jnp.float32(cfg.train.guidance), jnp.int32(steps))
    kw = dict(attention=attention, solver=schedule.solver, guided=True)
    t0 = time.perf_counter()
    exe = _sample.lower(*args, **kw).compile()
    return exe, args[1:], time.perf_counter() - t0


def check(cfg, graphdef, params, shape) -> dict:
    """One guided step of full attention and of DSV at keep 1.0 from the same noise: the same latents within
    bf16 rounding (the sparse kernel over every KV block is dense attention)."""
    batch = text_batch(cfg, 99)
    keep1 = AttentionPlan(mode="dsv", backend=cfg.dsv.dense_backend, sparse=True, keep=1.0, kv_block=cfg.dsv.kv_block)
    outs = {}
    for name, attention in (("full", "auto"), ("keep1", keep1)):
        exe, args, _ = compile_loop(cfg, graphdef, params, batch, shape, 1, attention, None)
        outs[name] = np.asarray(exe(params, *args[1:]), np.float32)
    err = float(np.abs(outs["full"] - outs["keep1"]).max() / max(np.abs(outs["full"]).max(), 1e-6))
    return {"max_rel_error": err, "ok": err < 5e-2}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model on the CPU: every code path")
    p.add_argument("--preset", default="wan2.1-t2v-1.3b")
    p.add_argument("--length", default="480p", choices=sorted(LENGTHS))
    p.add_argument("--steps", type=int, default=50, help="guided steps in the timed loop")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of the whole loop per variant")
    p.add_argument("--attention", default="full,dsv0.9", help="variants: full, dsvS (S: head sparsity)")
    p.add_argument("--no-check", action="store_true", help="skip the keep-1.0 check")
    p.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    p.add_argument("--name", default="", help="results file (default bench_sample_<preset>_<length>)")
    args = p.parse_args()
    overrides = ["attention=dsv", *(QUICK if args.quick else []), *args.set]
    cfg = get_config(args.preset, overrides)
    shape = QUICK_LENGTH if args.quick else LENGTHS[args.length]
    steps = 2 if args.quick else args.steps
    name = args.name or f"bench_sample_{args.preset}_{args.length}" + ("_quick" if args.quick else "")
    t0 = time.perf_counter()
    graphdef, params = random_params(cfg)
    jax.block_until_ready(params)
    print(f"{cfg.name}: random bf16 weights in {time.perf_counter() - t0:.1f} s; latents {shape}, {steps} steps")
    checked = None if args.no_check else check(cfg, graphdef, params, shape)
    if checked is not None:
        print(f"check (one step, full vs DSV keep 1.0): max error {checked['max_rel_error']:.2e} of max")
    rows = {}
    for i, variant in enumerate(args.attention.split(",")):
        attention, inputs = attention_for(cfg, shape, variant)
        batch = text_batch(cfg, i)
        exe, run_args, compile_s = compile_loop(cfg, graphdef, params, batch, shape, steps, attention, inputs)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(exe(params, *run_args[1:]))
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        kept = 1.0 if variant == "full" else 1.0 - float(variant.removeprefix("dsv"))
        flops = forward_flops(cfg, shape, 2, kept=kept)
        rows[variant] = {
            "attention": attention if isinstance(attention, str) else attention[0].describe(),
            "compile_s": compile_s,
            "loop_s": times,
            "loop_median_s": median,
            "per_step_s": median / steps,
            "projected_50_steps_s": 50 * median / steps,
            "forward_flops_batch2": flops,
        }
        print(
            f"{variant:8s} compile {compile_s:6.1f} s  {steps} steps {median:7.2f} s "
            f"({min(times):.2f}-{max(times):.2f})  per step {median / steps:.3f} s  "
            f"-> 50 steps {50 * median / steps:.1f} s"
        )
    if "full" in rows:
        for variant, row in rows.items():
            row["speedup_vs_full"] = rows["full"]["loop_median_s"] / row["loop_median_s"]
            lo = min(rows["full"]["loop_s"]) / max(row["loop_s"])
            hi = max(rows["full"]["loop_s"]) / min(row["loop_s"])
            row["speedup_range"] = [lo, hi]
            print(f"{variant:8s} {row['speedup_vs_full']:.2f}x full ({lo:.2f}-{hi:.2f})")
    harness.write_results(
        name,
        {
            "preset": cfg.name,
            "latent_shape": list(shape),
            "tokens": int(np.prod([s // p for s, p in zip(shape, cfg.model.patch)])),
            "text_tokens": cfg.text.max_len,
            "steps": steps,
            "guidance": cfg.train.guidance,
            "batch": "1 sample; conditional + unconditional branches batched (2 per forward)",
            "dtype": "bfloat16 weights and compute",
            "check": checked,
            "variants": rows,
            "includes": "the DiT's denoising loop only: no text encoding, no VAE decode",
        },
    )


if __name__ == "__main__":
    main()
