"""The train steps the experiments time, and the training setups the studies share.

    bench = TrainStepBench(cfg)                 # the state's layout on one device (or a given mesh)
    batch = bench.batch(shape)
    exe = bench.lower(batch, attention, inputs).compile()
    state, steps = run_steps(exe, bench.new_state(), (batch, lr), n)   # each timed, compiles counted
    time_train_step(cfg, shape, n)              # all of the above, after a warm-up step

Train steps take seconds: each is blocked on and timed alone, and the compilations during them are
counted (dsv_jax.train.compiles.CompileCounter: a warmed-up step compiles nothing).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dsv_jax.data.feed import tokens_per_sample
from dsv_jax.data.text import vocab_size
from dsv_jax.dsv.controller import DSVController, shape_key
from dsv_jax.parallel.mesh import make_mesh
from dsv_jax.train.compiles import CompileCounter
from dsv_jax.train.step import abstract_model, create_state, state_layout
from dsv_jax.train.trainer import batch_spec, lower_train_step


@dataclasses.dataclass
class Steps:
    """Train steps run by `run_steps`."""

    times_s: list[float]
    losses: list[float]
    finite: bool  # every step's loss and gradient
    compiles: int  # programs built while they ran (0 after a warm-up)
    metrics: Any  # the last step's

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def run_steps(step: Callable, state, args: tuple, n: int, *, on_step: Callable | None = None) -> tuple[Any, Steps]:
    """n train steps `state, metrics = step(state, *args)` (the state donated from one to the next), each
    blocked on and timed, compilations counted; on_step(i, seconds) after each. -> (state, Steps)."""
    times, losses, finite, metrics = [], [], True, None
    with CompileCounter() as compiles:
        for i in range(n):
            t0 = time.perf_counter()
            state, metrics = step(state, *args)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - t0)
            losses.append(float(metrics["loss"]))
            finite = finite and bool(metrics.get("finite", True))
            if on_step is not None:
                on_step(i, times[-1])
    return state, Steps(times, losses, finite, compiles.count, metrics)


class TrainStepBench:
    """The train step of `cfg` on `mesh` (default: one device) for benchmarks: the state's layout, random
    batches, the step lowered for an attention variant, fresh states."""

    def __init__(self, cfg, mesh=None):
        self.cfg = cfg
        self.mesh = make_mesh(cfg.parallel, jax.devices()[:1]) if mesh is None else mesh
        self.graphdef = abstract_model(cfg)[0]
        self.abstract_state, self.state_sharding = state_layout(cfg, self.mesh)

    def batch(self, shape, b: int = 1, seed: int = 0) -> dict[str, jax.Array]:
        """b random samples of latent `shape` (T, H, W) laid out as the step takes them: normal latents (or
        text embeddings), random caption ids, full masks; the same global batch on every process."""
        rng = np.random.default_rng(seed)
        spec = batch_spec(self.cfg, self.mesh, b, shape)
        out = {}
        for k, s in spec.items():
            if s.dtype == jnp.bool_:
                host = np.ones(s.shape, bool)
            elif s.dtype == jnp.int32:
                host = rng.integers(1, vocab_size(self.cfg.text.hash_buckets), s.shape).astype(np.int32)
            else:
                host = rng.standard_normal(s.shape, np.float32)
            out[k] = jax.make_array_from_callback(s.shape, s.sharding, lambda i, x=host: x[i])
        return out

    def lower(self, batch, attention="auto", inputs=None, cfg=None):
        """The step lowered for `batch` (abstract or concrete) under `attention` (a backend name or per-block
        plans) with DSV's runtime `inputs`; `cfg`: a variant of the config with the same state (e.g. another
        AdaLN impl). `.compile()` it, possibly on another thread."""
        graphdef = self.graphdef if cfg is None else abstract_model(cfg)[0]
        return lower_train_step(
            cfg or self.cfg, graphdef, attention, self.abstract_state, self.state_sharding, batch, inputs
        )

    def new_state(self):
        return create_state(self.cfg, self.state_sharding)


def time_train_step(
    cfg,
    shape,
    steps: int,
    *,
    attention="auto",
    inputs=None,
    mesh=None,
    warmup: int = 1,
    lr: float = 1e-4,
    on_event: Callable[[str, float], None] | None = None,
) -> dict[str, Any]:
    """cfg's train step on one random sample of latent `shape`: compiled, then `warmup` and `steps` timed
    steps on a fresh state. on_event(what, seconds) after the compile, the warm-up and each step. Returns
    compile_s, warmup_s, step_times_s, step_s (median), tokens, tokens_per_s, loss, finite, compiles_timed
    (0: nothing compiled after the warm-up), temp_bytes (compiled) and the last step's metrics (on device)."""
    say = on_event or (lambda what, seconds: None)
    bench = TrainStepBench(cfg, mesh)
    batch = bench.batch(shape)
    args = (batch, jnp.float32(lr)) + ((inputs,) if inputs is not None else ())
    t0 = time.perf_counter()
    exe = bench.lower(batch, attention, inputs).compile()
    out = {"compile_s": time.perf_counter() - t0, "tokens": tokens_per_sample(shape, cfg.model.patch)}
    say("compiled", out["compile_s"])
    state, warm = run_steps(exe, bench.new_state(), args, warmup)
    say("warm-up", sum(warm.times_s))
    state, timed = run_steps(exe, state, args, steps, on_step=lambda i, s: say(f"step {i + 1}/{steps}", s))
    mem = exe.memory_analysis()
    out.update(
        warmup_s=sum(warm.times_s),
        step_times_s=timed.times_s,
        step_s=timed.median_s,
        tokens_per_s=out["tokens"] / timed.median_s,
        loss=timed.losses[-1],
        finite=warm.finite and timed.finite,
        compiles_timed=timed.compiles,
        temp_bytes=int(mem.temp_size_in_bytes) if mem is not None else None,
        metrics=timed.metrics,
    )
    return out


# -- DSV in stage 2 -------------------------------------------------------------------------------------


def stage2_controller(cfg, shape, keep_heads) -> DSVController:
    """A DSV controller in stage 2 whose blocks all keep `keep_heads` (one ratio, or one per head) on latent
    `shape`, at the ladder rung that holds the largest: its plans and runtime inputs are what training runs."""
    depth, heads = cfg.model.depth, cfg.model.heads
    keep = np.broadcast_to(np.asarray(keep_heads, np.float64), (heads,))
    ctl = DSVController(cfg)
    ctl.load_state_dict(
        {
            "stage": 2,
            "switch_step": 0,
            "loss_ema": 0.0,
            "shapes": {
                shape_key(shape): {
                    "sparsity": np.tile(1.0 - keep, (depth, 1)).tolist(),
                    "rungs": [ctl.rung_for(float(keep.max()))] * depth,
                    "profiles": 1,
                }
            },
        }
    )
    return ctl


# -- the training setup of the quality and sparsity studies (one place for both) -------------------------
# quality_parity.py (issue 4: moving shapes; issue 17: photos) and sparsity_emergence.py train on one
# bucket of the embedded data at a given number of tokens per sample, patch 1x2x2, from the tiny preset.

# latent (T, H, W) of the bucket with this many tokens per sample at patch 1x2x2 (the first two: --quick)
STUDY_SHAPES = {256: (4, 16, 16), 512: (4, 16, 32), 16384: (16, 64, 64), 32768: (16, 64, 128), 65536: (16, 128, 128)}
STUDY_MODELS = {
    # issue 4's quality-parity model: 4 blocks of 4 heads x 64 (hidden 256)
    "shapes": ["model.hidden=256", "model.heads=4", "model.depth=4", "model.text_dim=64"],
    # issue 17's model on photos: 8 blocks of 12 heads x 64 (hidden 768), 109M parameters
    "photos": ["model.hidden=768", "model.heads=12", "model.depth=8", "model.text_dim=256", "text.max_len=20"],
}
# the tiny model of --quick runs (scripts add their shapes and sizes)
QUICK_MODEL = [
    "model.hidden=32",
    "model.heads=2",
    "model.depth=2",
    "model.text_dim=16",
    "text.hash_buckets=8",
    "model.remat=false",
]


def study_overrides(setup: str, tokens: int, *, quick: bool, tokens_per_batch: int | None = None) -> list[str]:
    """Model and data overrides of a study `setup` ("shapes" | "photos") at one bucket of `tokens` tokens per
    sample, with tokens_per_batch (default 2 x tokens: two samples a step) under equal-token batching."""
    if setup not in STUDY_MODELS:
        raise ValueError(f"unknown setup {setup!r}: choose from {sorted(STUDY_MODELS)}")
    if tokens not in STUDY_SHAPES:
        raise ValueError(f"no study shape for {tokens} tokens per sample: choose from {sorted(STUDY_SHAPES)}")
    t, h, w = STUDY_SHAPES[tokens]
    if quick:
        model = QUICK_MODEL + ["model.tile=[2,4,4]", f"text.max_len={20 if setup == 'photos' else 8}"]
    else:
        model = STUDY_MODELS[setup] + ["model.tile=[4,4,4]"]  # 64-token 3D tiles: the kernels' KV block
    source = "photos" if setup == "photos" else "synthetic"
    return model + [
        "model.patch=[1,2,2]",
        f"data.source={source}",
        f"data.buckets=[[{t},{h},{w}]]",
        "data.bucket_weights=[1]",
        f"data.tokens_per_batch={tokens_per_batch or 2 * tokens}",
    ]
