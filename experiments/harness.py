"""How the experiments measure: timing, time budgets, random inputs, errors, results files and plots.
(experiments/training.py: the train steps and study setups they share.)

Run every script from the repository root as `python -m experiments.NAME` (`--quick`: tiny sizes on the CPU).

Method (see experiments/results/RESULTS.md): warm up, block on results, median of several runs,
correctness against the reference before timing, FLOPs (dsv_jax.model.flops, the library's one count)
and bytes against the measured ceilings.

Timing on the device. `time_fn` times kernels and other short programs by what the device spends, not by
the host's dispatch: a repetition queues n calls back to back and blocks once at its end, so the device runs
them one after the other without waiting on the host (call i + 1 is dispatched while call i runs) and
(end - start) / n is the device's time per call. n is sized from a blocked call so that a repetition lasts
about `min_ms`; a call longer than that runs alone (n = 1), where the ~0.1 ms of dispatch and
synchronisation is lost in the call. Where n > 1, `blocking_median_ms` is the median of single blocked calls
(host dispatch + device + sync, as earlier results were timed), for comparison. Why not CUDA events: jax
0.10 / 0.11 has no API for them; its profiler (jax.profiler.trace, ProfileData) records device times, but
per XLA op and stream in a trace file to parse, while back-to-back calls give the same time per call for
anything longer than the gap between two launches. The method needs calls to run in order, as they do on a
GPU stream; the CPU of --quick runs may overlap them, and its times only show that the code runs. Train
steps (seconds each) are timed one by one, each blocked on (training.run_steps).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import experiments

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# Ceilings measured on the H200 (experiments/results/RESULTS.md); benchmarks also measure their own copy bandwidth.
H200_BF16_TFLOPS = 659.0  # bf16 matmul 8192^3
# The highest bf16 matmul rate seen on these H200s (PyTorch, 8192^3, random data): the ceiling that kernels
# tuned past XLA's own matmul (the Mosaic GPU sparse attention's dQ runs ~670) are compared with.
H200_BF16_MAX_TFLOPS = 788.0
H200_COPY_TBPS = 2.8  # elementwise copy, read + write


# -- the machine and the results files -------------------------------------------------------------------


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def device_info() -> dict[str, Any]:
    d = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": d.device_kind,
        "device_count": jax.device_count(),
        "python": platform.python_version(),
    }


def write_results(name: str, payload: dict[str, Any], directory: str | None = None) -> str:
    """Write experiments/results/<name>.json (or <directory>/<name>.json), and a copy into $OUT if set."""
    directory = directory or RESULTS_DIR
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.json")
    out_dir = os.environ.get("OUT")  # the device tool brings $OUT back
    payload = {"name": name, "env": device_info(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    text = json.dumps(payload, indent=2, default=float)
    with open(path, "w") as f:
        f.write(text)
    if out_dir:
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            f.write(text)
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    widths = {c: max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).ljust(widths[c]) for c in columns))


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (with a note) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plots]'): no plots")
        return None
    return plt


PLOTS_DIR = os.path.join(RESULTS_DIR, "plots")  # the results' figures: the top of results/ keeps the JSONs


def save_figure(fig, path: str, dpi: int = 120) -> str:
    """Save and close `fig` at `path` (a figure aimed at the top of experiments/results/ goes to its plots/
    folder), and a copy into $OUT when set (the device tool brings it back). Returns where it went."""
    import matplotlib.pyplot as plt

    if os.path.abspath(os.path.dirname(path)) == os.path.abspath(RESULTS_DIR):
        os.makedirs(PLOTS_DIR, exist_ok=True)
        path = os.path.join(PLOTS_DIR, os.path.basename(path))
    fig.savefig(path, dpi=dpi)
    out = os.environ.get("OUT")
    if out and os.path.abspath(os.path.dirname(path)) != os.path.abspath(out):
        fig.savefig(os.path.join(out, os.path.basename(path)), dpi=dpi)
    plt.close(fig)
    return path


def error_text(e: BaseException, trace: bool = False) -> str:
    """An exception for a results file: its type and message (1500 characters at most), and with `trace`
    the last 1500 characters of where it was raised (the traceback's frames only: a long message, as jax's
    lowering errors have, would otherwise fill them again)."""
    text = f"{type(e).__name__}: {e}"[:1500]
    if not trace:
        return text
    return text + "\nTraceback (most recent call last):\n" + "".join(traceback.format_tb(e.__traceback__))[-1500:]


# -- measuring in a child process -------------------------------------------------------------------------

CHILD_TAG = "EXPERIMENT_RESULT "


def answer(result: dict[str, Any]) -> None:
    """A child process's answer to `in_child`: one tagged JSON line on stdout."""
    print(CHILD_TAG + json.dumps(result, default=float), flush=True)


def in_child(module: str, args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `python -m module *args` with a time limit and return what it `answer`ed, or {"error": ...}: a
    crash or a deadlock there (e.g. of an experimental kernel) costs at most timeout_s, never the caller."""
    answers, error = in_child_answers(module, args, timeout_s, env)
    if answers and not error.startswith(NO_ANSWER):
        return answers[-1]
    return {"error": error}


NO_ANSWER = "no answer within"  # how in_child_answers' error begins when the child ran out of time


def in_child_answers(
    module: str, args: list[str], timeout_s: float, env: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], str]:
    """Run `python -m module *args` with a time limit: (everything it `answer`ed, in order, also what it
    answered before it crashed or ran out of time; why it ended: "" after a clean exit, else
    "no answer within ..." or "child exited N: " and the tail of its output (crash_text)). A child that answers
    as it goes (one line per finished measurement) loses only the one it was in."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    text = lambda x: x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, timeout=timeout_s
        )
        out, err = proc.stdout, proc.stderr
        error = "" if proc.returncode == 0 else f"child exited {proc.returncode}: {crash_text(err or out)}"
    except subprocess.TimeoutExpired as e:  # what it wrote so far comes with the exception (bytes)
        out, err = text(e.stdout), text(e.stderr)
        error = f"{NO_ANSWER} {timeout_s:.0f} s (deadlock, hang or slow compile)"
    answers = []
    for line in out.splitlines():
        if line.startswith(CHILD_TAG):
            try:
                answers.append(json.loads(line[len(CHILD_TAG) :]))
            except json.JSONDecodeError:  # a line cut short where the child was killed
                pass
    if not answers and not error:
        error = f"child exited 0: {crash_text(err or out)}"
    return answers, error


# The line that says why a process died: a glog FATAL (XLA's checks), LLVM's or Python's fatal error, C++'s
# terminate. A C++ stack trace printed after it can push it out of the output's tail.
FATAL_LINE = re.compile(r"^(?:F\d{4} |.*(?:Check failed|LLVM ERROR|Fatal Python error|terminate called)).*$", re.M)


def crash_text(output: str, tail: int = 2500) -> str:
    """A dead process's output for a results file: its last `tail` characters, led by the first line that
    says why it died (FATAL_LINE) where that line lies before them."""
    fatal = FATAL_LINE.search(output)
    if fatal and fatal.end() <= len(output) - tail:
        return f"{fatal.group(0)[:500]}\n...\n{output[-tail:]}"
    return output[-tail:]


# -- time budgets -----------------------------------------------------------------------------------------


class Budget:
    """A wall-clock budget of `seconds` (None: unlimited) counted from `start` (time.time(); default: the
    process start, experiments.STARTED), of which `reserve` seconds are kept for writing the results.
    Work is planned against `left()`; what does not fit is skipped with `skip_reason`'s reason recorded."""

    def __init__(self, seconds: float | None, *, reserve: float = 0.0, start: float | None = None):
        self.seconds, self.reserve = seconds, reserve
        self.start = experiments.STARTED if start is None else start
        self.expired = False  # set by whoever stops the work early (e.g. a timer)

    def elapsed(self) -> float:
        return time.time() - self.start

    def left(self) -> float:
        """Seconds left before the reserve (infinite without a budget, 0 once expired)."""
        if self.expired:
            return 0.0
        return math.inf if self.seconds is None else self.seconds - self.reserve - self.elapsed()

    def allows(self, seconds: float) -> bool:
        """Whether work of about `seconds` fits (never once expired)."""
        return not self.expired and self.left() >= seconds

    def skip_reason(self, estimate: float, fits: bool | None = None) -> str | None:
        """None when work of about `estimate` seconds fits, else the reason to skip it. `fits` overrides the
        decision (e.g. process 0's, which every process of a multi-process run must follow)."""
        if self.allows(estimate) if fits is None else fits:
            return None
        return f"budget: needs ~{estimate:.0f} s, {max(self.left(), 0):.0f} s left"


# -- timing -----------------------------------------------------------------------------------------------


def time_fn(
    fn: Callable,
    *args,
    warmup: int = 2,
    iters: int = 10,
    min_ms: float = 20.0,
    max_calls: int = 200,
    agree: Callable[[int], int] = int,
    calls: int | None = None,
) -> dict:
    """Device time per call of fn(*args) in ms (see the module docstring): median / min / max / spread over
    `iters` repetitions of n back-to-back calls, n sized so that a repetition lasts about min_ms (by one
    blocked call after at least one warm-up call); `agree` makes n the same on every process of a
    multi-process run (their collectives must match). With n > 1 also blocking_median_ms.

    calls: a fixed n instead (no sizing call, no blocking_median_ms): `warmup` calls each blocked on, then
    `iters` repetitions of exactly `calls` back-to-back calls blocked once. Programs whose times are compared
    (a kernel against cuDNN) are timed so with the same warmup, iters and calls, whatever their lengths: the
    sized n gave a 200 ms cuDNN call one call a repetition and a 25 ms kernel eight, whose back-to-back calls
    hide launch and synchronisation gaps the single call pays (and may find their inputs in L2)."""
    if calls is not None:
        if calls < 1:
            raise ValueError(f"time_fn: calls={calls} must be >= 1")
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
        n = calls
    else:
        for _ in range(max(warmup, 1)):
            jax.block_until_ready(fn(*args))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        one = (time.perf_counter() - t0) * 1e3
        n = agree(max(1, min(max_calls, int(min_ms / max(one, 1e-3)))))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3 / n)
    med = statistics.median(times)
    result = {
        "median_ms": med,
        "min_ms": min(times),
        "max_ms": max(times),
        "spread_pct": 100.0 * (max(times) - min(times)) / med,
        "runs": iters,
        "calls_per_run": n,
        "warmup": warmup,
    }
    if n > 1 and calls is None:
        single = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            single.append((time.perf_counter() - t0) * 1e3)
        result["blocking_median_ms"] = statistics.median(single)
    return result


def compile_timed(fn: Callable, *args) -> tuple[Any, float]:
    """jit(fn) lowered for `args` and compiled: (executable, seconds)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def _hlo_table(hlo_text: str, title: str, pattern: str) -> dict[int, tuple]:
    """One of the source tables at the top of an HLO module's text (FileNames, StackFrames, ...): id -> fields."""
    block = re.search(rf"^{title}\n(.*?)(?:\n\n|\Z)", hlo_text, re.M | re.S)
    rows = {}
    for line in block.group(1).splitlines() if block else []:
        m = re.match(rf"\s*(\d+) {pattern}", line)
        if m:
            rows[int(m.group(1))] = m.groups()[1:]
    return rows


def _op_scopes(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> "pass: function (file:line)": the innermost user frame that made it (the
    metadata's stack frame) and which pass of the step ran it (fwd; remat: the recomputed forward of a
    rematerialised block; bwd: the transposed computation)."""
    files = {i: os.path.basename(f[0]) for i, f in _hlo_table(hlo_text, "FileNames", r'"([^"]*)"').items()}
    funcs = {i: f[0] for i, f in _hlo_table(hlo_text, "FunctionNames", r'"([^"]*)"').items()}
    locs = _hlo_table(hlo_text, "FileLocations", r"\{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)")
    frames = _hlo_table(hlo_text, "StackFrames", r"\{file_location_id=(\d+)")
    scopes = {}
    instruction = r'^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?metadata=\{op_name="([^"]*)"(?:[^}\n]*?stack_frame_id=(\d+))?'
    for m in re.finditer(instruction, hlo_text, re.M):
        name, op_name, frame = m.groups()
        where = "rematted_computation" in op_name and "remat" or "transpose(" in op_name and "bwd" or "fwd"
        loc = locs.get(int(frames.get(int(frame), ("0",))[0])) if frame else None
        if loc:
            file_id, func_id, line = (int(x) for x in loc)
            scopes.setdefault(name, f"{where}: {funcs.get(func_id, '?')} ({files.get(file_id, '?')}:{line})")
        else:
            scopes.setdefault(name, f"{where}: {op_name.rsplit('/', 1)[-1]}")
    return scopes


def device_profile(run: Callable[[], Any], hlo_text: str | None = None, top: int = 40) -> dict[str, Any]:
    """Device time per XLA op of one call of run() (which must block on its results), from jax's profiler.

    Events of the device's kernel streams (a CPU run: the host's XLA thunks) are summed by their hlo_op
    stat; hlo_text (the compiled module, `exe.as_text()`) maps each op to its jax source scope (metadata
    stack frame: the function and line that made it, and the pass that ran it), and time is also summed
    per scope: how a step's time is attributed to the model's parts. On a GPU, XLA's command buffers (CUDA
    graphs) show as a few ops named command_buffer_N: profile with XLA_FLAGS=--xla_gpu_enable_command_buffer=
    (bench_e2e --profile sets it).
    -> {"device_ms": kernel time summed, "wall_ms", "events", "ops": the top ops [{op, ms, calls, kernel,
        scope}], "scopes": the top scopes [{scope, ms, calls}]}."""
    import glob
    import tempfile

    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d):
            run()
        wall = time.perf_counter() - t0
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return {"error": "the profiler wrote no trace"}
        data = ProfileData.from_file(paths[0])
        events = []
        for plane in data.planes:
            lines = list(plane.lines)
            if plane.name.startswith("/device:"):
                streams = [ln for ln in lines if ln.name.startswith("Stream")]
                lines = streams or lines
            elif plane.name != "/host:CPU" or jax.default_backend() != "cpu":
                continue
            for line in lines:
                for ev in line.events:
                    stats = dict(ev.stats)
                    if "hlo_op" in stats and ev.duration_ns:
                        events.append((str(stats["hlo_op"]), ev.name, ev.duration_ns / 1e6))
    scopes = _op_scopes(hlo_text) if hlo_text else {}
    by_op: dict[str, dict[str, Any]] = {}
    for op, kernel, ms in events:
        row = by_op.setdefault(
            op, {"op": op, "ms": 0.0, "calls": 0, "kernel": kernel[:120], "scope": scopes.get(op, "")}
        )
        row["ms"] += ms
        row["calls"] += 1
    by_scope: dict[str, dict[str, Any]] = {}
    for row in by_op.values():
        scope = row["scope"] or "(no scope)"
        agg = by_scope.setdefault(scope, {"scope": scope, "ms": 0.0, "calls": 0})
        agg["ms"] += row["ms"]
        agg["calls"] += row["calls"]
    rank = lambda rows: sorted(rows, key=lambda r: -r["ms"])[:top]
    return {
        "device_ms": sum(ms for *_, ms in events),
        "wall_ms": 1e3 * wall,
        "events": len(events),
        "ops": rank(by_op.values()),
        "scopes": rank(by_scope.values()),
    }


def fwd_bwd(fn: Callable, n_diff: int | None = None) -> Callable:
    """fn's forward and backward in one call: run(*args, cotangent) -> (out, gradients of the first n_diff
    args (default: all)); the cotangent takes the output's dtypes."""

    def run(*a):
        n = len(a) - 1 if n_diff is None else n_diff
        out, vjp = jax.vjp(lambda *d: fn(*d, *a[n:-1]), *a[:n])
        return out, vjp(jax.tree.map(lambda c, o: c.astype(o.dtype), a[-1], out))

    return run


def copy_bandwidth_tbps(n_bytes: int = 2 << 30) -> float:
    """Achieved read+write bandwidth of an elementwise copy-like op (x + 1) over n_bytes of bf16."""
    x = jax.random.normal(jax.random.key(0), (n_bytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    t = time_fn(f, x, warmup=2, iters=10)["median_ms"]
    return 2 * n_bytes / (t * 1e-3) / 1e12


def compiled_memory(fn: Callable, *args) -> dict[str, int]:
    """Compiled memory analysis of jit(fn)(*args): temp (activations), argument and output bytes."""
    m = jax.jit(fn).lower(*args).compile().memory_analysis()
    if m is None:
        return {}
    return {
        "temp_bytes": int(m.temp_size_in_bytes),
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
    }


def peak_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def rel_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


# -- random inputs ----------------------------------------------------------------------------------------


def random_qkv(key, seq: int, heads: int, head_dim: int, dtype=jnp.bfloat16, n: int = 4, batch: int = 1):
    """n standard-normal arrays [batch, seq, heads, head_dim]: q, k, v and an output cotangent."""
    return tuple(jax.random.normal(k, (batch, seq, heads, head_dim), dtype) for k in jax.random.split(key, n))


def random_selection(key, *, seq: int, heads: int, q_tile: int, kv_block: int, keep, local_share: float = 0.5):
    """A KV-block selection as DSV's kernels take it. Per head h and query tile: round(keep_h x blocks)
    blocks (at least one), `local_share` of them the blocks nearest the tile and the rest random far ones
    (video attention's mix of neighbourhood and global keys; local_share 0: uniformly random). keep: one
    ratio, or one per head. Returns (index int32 [1, H, tiles, K], ascending in each list's first count
    entries, K the largest count; count int32 [1, H, tiles])."""
    tiles, blocks = seq // q_tile, seq // kv_block
    keep = jnp.broadcast_to(jnp.asarray(keep, jnp.float32), (heads,))
    count = jnp.clip(jnp.round(keep * blocks), 1, blocks).astype(jnp.int32)  # [H]
    near = jnp.round(count * local_share).astype(jnp.int32)[:, None, None]  # [H, 1, 1]
    centre = ((jnp.arange(tiles) * q_tile + q_tile // 2) // kv_block)[None, :, None]  # [1, T, 1]
    first = jnp.clip(centre - near // 2, 0, blocks - near)
    ids = jnp.arange(blocks)
    cap = int(jnp.max(count))

    def one_head(args):  # one head at a time: [T, blocks] scores (all heads at once is 40 GiB at token level, 64k)
        head_key, first_h, near_h = args
        local = (ids >= first_h) & (ids < first_h + near_h)  # [T, blocks]
        score = jnp.where(local, 2.0, jax.random.uniform(head_key, local.shape))  # the local blocks rank first
        return jax.lax.top_k(score, cap)[1].astype(jnp.int32)

    first = jnp.broadcast_to(first, (heads, tiles, 1))
    top = jax.lax.map(one_head, (jax.random.split(key, heads), first, near))  # [H, T, cap]
    index = jnp.sort(jnp.where(jnp.arange(cap) < count[:, None, None], top, blocks), axis=-1)
    index = jnp.where(index == blocks, 0, index)  # past the count: any valid id
    return index[None], jnp.broadcast_to(count[:, None], (heads, tiles))[None]
