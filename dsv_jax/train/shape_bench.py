"""Shape benchmarking (`dsv-jax fit-cost`): time real train steps over a (B, S) grid, fit the cost
model, and derive the budgets of the dual-constraint batch rule.

    t(B, S) = a + b * B * S**p                 fitted to median step times (data/cost_model.py)
    M_mem   = (memory cap - state - c0) / c1   c0 + c1 * B * S = the step's temporary bytes, fitted
                                               to XLA's compiled memory analysis of the same programs
    M_comp  = (target step time - a) / b       target: --target-ms, or the one that makes the predicted
                                               step times of the buckets' mix most even while losing at
                                               most 3% predicted tokens/s to equal tokens
                                               (cost_model.balance_target)

The steps are the trainer's own compiled programs (same model, mesh, shardings, donation), run on
random inputs; the grid is every bucket shape x every batch size. Budgets are per global batch of
this mesh, which is what the batch rule uses.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from typing import Any, Sequence

import jax
import numpy as np

from dsv_jax.config import Config
from dsv_jax.data.bucketing import BatchRule, equal_token_batch_size
from dsv_jax.data.cost_model import CostModel, balance_target, fit_cost_model
from dsv_jax.data.feed import tokens_per_sample
from dsv_jax.parallel.mesh import data_parallel_size, make_mesh
from dsv_jax.train.step import abstract_model, create_state, state_layout
from dsv_jax.train.trainer import batch_spec, compile_train_step

log = logging.getLogger(__name__)


def is_oom(e: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


class StepBench:
    """Compiled train steps of `cfg` on its mesh, keyed by (global batch, shape), with a live state."""

    def __init__(self, cfg: Config, devices=None):
        self.cfg = cfg
        self.mesh = make_mesh(cfg.parallel, devices)
        self.dp = data_parallel_size(self.mesh)
        self.graphdef, _ = abstract_model(cfg)
        self.abstract_state, self.state_sharding = state_layout(cfg, self.mesh)
        self.reset_state()
        self._compiled: dict[tuple, Any] = {}
        self._rng = np.random.default_rng(cfg.data.seed)

    def reset_state(self) -> None:
        """A fresh train state (also after a step that failed with its donated state)."""
        self.state = create_state(self.cfg, self.state_sharding)

    def seq_len(self, shape) -> int:
        return tokens_per_sample(shape, self.cfg.model.patch)

    def compiled(self, b: int, shape):
        key = (int(b), tuple(shape))
        if key not in self._compiled:
            self._compiled[key] = compile_train_step(
                self.cfg,
                self.graphdef,
                self.cfg.attention,
                self.abstract_state,
                self.state_sharding,
                batch_spec(self.cfg, self.mesh, b, shape),
            )
        return self._compiled[key]

    def memory(self, b: int, shape) -> dict[str, int]:
        """Per-device bytes from XLA's memory analysis: state (arguments not aliased) and temporaries."""
        m = self.compiled(b, shape).memory_analysis()
        if m is None:
            return {}
        args, out, alias = (int(getattr(m, f"{k}_size_in_bytes", 0)) for k in ("argument", "output", "alias"))
        temp = int(m.temp_size_in_bytes)
        resident = args + max(out - alias, 0)
        return {"temp_bytes": temp, "resident_bytes": resident, "peak_bytes": resident + temp}

    def random_batch(self, b: int, shape) -> dict[str, jax.Array]:
        """Fresh random inputs of the step's batch spec (this host's rows), as global arrays."""
        spec = batch_spec(self.cfg, self.mesh, b, shape)
        local = {}
        rows = b // jax.process_count()
        for k, s in spec.items():
            dims = (rows, *s.shape[1:])
            if k == "latents" or k == "text_emb":
                local[k] = self._rng.standard_normal(dims, np.float32)
            elif k == "text_ids":
                local[k] = self._rng.integers(2, 40, dims).astype(np.int32)
            else:  # text_mask: a random-length prefix
                lens = self._rng.integers(1, dims[1] + 1, dims[0])
                local[k] = np.arange(dims[1])[None] < lens[:, None]
        return {k: jax.make_array_from_process_local_data(spec[k].sharding, v) for k, v in local.items()}

    def step(self, b: int, shape, batch) -> float:
        """Run one step (blocking) and return its wall time in seconds."""
        fn = self.compiled(b, shape)
        t0 = time.perf_counter()
        self.state, self.last_metrics = fn(self.state, batch, np.float32(0.0))
        jax.block_until_ready(self.last_metrics["loss"])
        return time.perf_counter() - t0

    def time_steps(self, b: int, shape, *, warmup: int = 2, iters: int = 5) -> list[float]:
        batch = self.random_batch(b, shape)
        for _ in range(warmup):
            self.step(b, shape, batch)
        return [self.step(b, shape, batch) for _ in range(iters)]


def device_memory_bytes() -> int:
    """Memory of one device: the allocator's limit on accelerators, RAM / local devices on the CPU."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(ram // max(1, jax.local_device_count()))


def memory_per_token(points: Sequence[dict]) -> tuple[float, float]:
    """(c0, c1): temp bytes = c0 + c1 * tokens, least squares over the grid (tokens = B * S, global)."""
    tokens = np.array([p["batch"] * p["seq_len"] for p in points], np.float64)
    temp = np.array([p["temp_bytes"] for p in points], np.float64)
    if len(np.unique(tokens)) < 2:
        return 0.0, float(np.max(temp / tokens))
    c1, c0 = np.polyfit(tokens, temp, 1)
    return max(float(c0), 0.0), max(float(c1), 1e-9)


def fit_cost(
    cfg: Config,
    *,
    shapes: Sequence[tuple[int, int, int]] | None = None,
    shares: Sequence[float] | None = None,
    batch_sizes: Sequence[int] = (1, 2, 4),
    target_s: float | None = None,
    memory_bytes: int | None = None,
    mem_fraction: float = 0.9,
    warmup: int = 2,
    iters: int = 5,
    devices=None,
    progress: bool = True,
) -> CostModel:
    """Benchmark, fit and derive budgets (see the module doc). batch_sizes are per data-parallel
    device (multiplied by the mesh's data-parallel size). shares: samples per shape (default: the
    config's bucket weights when the shapes are its buckets, else equal)."""
    from dsv_jax.progress import on_terminal, tqdm_class

    tqdm = tqdm_class()

    if shapes is None:
        shapes, shares = [tuple(s) for s in cfg.data.buckets], shares or cfg.data.bucket_weights
    shapes = [tuple(s) for s in shapes]
    shares = list(shares) if shares is not None else [1.0] * len(shapes)
    if len(shares) != len(shapes):
        raise ValueError(f"{len(shares)} shares for {len(shapes)} shapes")
    if not 0 < mem_fraction <= 1:
        raise ValueError(f"--mem-fraction={mem_fraction} must be in (0, 1]")
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch sizes {list(batch_sizes)} must be >= 1")
    for shape in shapes:
        if any(s % p for s, p in zip(shape, cfg.model.patch)):
            raise ValueError(f"shape {shape} is not divisible by model.patch {cfg.model.patch}")
    if len({tokens_per_sample(s, cfg.model.patch) for s in shapes}) < 2:
        raise ValueError(f"shapes {shapes} have one sequence length: p needs at least two")
    bench = StepBench(cfg, devices)
    capacity = int(memory_bytes or device_memory_bytes())
    grid = [(b * bench.dp, s) for s in shapes for b in sorted(set(batch_sizes))]
    points, skipped = [], []
    for b, shape in tqdm(grid, desc="fit-cost", disable=not (progress and on_terminal())):
        seq = bench.seq_len(shape)
        try:
            mem = bench.memory(b, shape)
            if mem and mem["peak_bytes"] > capacity:
                skipped.append({"batch": b, "shape": list(shape), "reason": "over the memory cap"})
                continue
            times = bench.time_steps(b, shape, warmup=warmup, iters=iters)
        except Exception as e:
            if not is_oom(e):
                raise
            bench.reset_state()  # the failed step may have consumed the donated state
            skipped.append({"batch": b, "shape": list(shape), "reason": "out of memory"})
            continue
        points.append(
            {
                "batch": b,
                "shape": list(shape),
                "seq_len": seq,
                "time_s": statistics.median(times),
                "times_s": times,
                **mem,
            }
        )
        log.info("B=%d shape=%s S=%d: %.2f ms", b, shape, seq, 1e3 * points[-1]["time_s"])
    if len(points) < 3:
        raise ValueError(f"only {len(points)} grid point(s) ran ({skipped}); use smaller shapes or batch sizes")
    model = fit_cost_model([p["batch"] for p in points], [p["seq_len"] for p in points], [p["time_s"] for p in points])
    if model.p < 1.0:
        log.warning(
            "fitted p = %.2f < 1: step time grows slower than the tokens, so these shapes do not fill "
            "the device (fixed costs dominate); benchmark larger shapes or batches",
            model.p,
        )
    info: dict[str, Any] = {
        "config": cfg.name,
        "mesh": dict(bench.mesh.shape),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "points": points,
        "skipped": skipped,
        "memory_cap_bytes": capacity,
        "mem_fraction": mem_fraction,
    }
    m_mem = None
    if all("temp_bytes" in p for p in points):
        c0, c1 = memory_per_token(points)
        resident = max(p["resident_bytes"] for p in points)
        m_mem = math.floor((capacity * mem_fraction - resident - c0) / c1)
        info.update(temp_bytes_fixed=c0, temp_bytes_per_token=c1, resident_bytes=resident)
        if m_mem < max(p["seq_len"] for p in points):
            log.warning("M_mem=%d tokens is less than one sample of the longest shape", m_mem)
        m_mem = max(m_mem, 1)
    if target_s is None:
        if m_mem is None:
            raise ValueError("no memory analysis on this backend: pass --target-ms")
        seq = [bench.seq_len(s) for s in shapes]
        equal = [equal_token_batch_size(x, m_mem, cfg.data.max_batch, bench.dp) for x in seq]

        def dual(target):
            rule = BatchRule(
                "dual",
                max_batch=cfg.data.max_batch,
                multiple=bench.dp,
                m_mem=m_mem,
                m_comp=model.compute_budget_for(target),
                p=model.p,
            )
            return [rule(x) for x in seq]

        target_s, sweep = balance_target(model, seq, shares, dual, equal)
        info.update(
            target_rule="most even predicted step times within 3% of equal-token tokens/s",
            shares=list(shares),
            target_sweep=sweep,
        )
    info["target_step_s"] = target_s
    m_comp = model.compute_budget_for(target_s)
    return CostModel(
        a=model.a,
        b=model.b,
        p=model.p,
        r2=model.r2,
        max_rel_error=model.max_rel_error,
        m_mem=float(m_mem) if m_mem is not None else None,
        m_comp=float(m_comp),
        info=info,
    )
