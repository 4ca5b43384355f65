"""The training loop: mesh, state, checkpoints, one compiled step per bucket, metrics, samples.

    trainer = Trainer(cfg, workdir)      # restores the latest checkpoint in workdir if there is one
    trainer.run()                        # until cfg.train.steps, SIGTERM/Ctrl-C, or `stop_at`

Every bucket shape's step is compiled before the first step (ahead of time, cached on disk by jax's
persistent compilation cache), so the loop never compiles. Each compile is announced by bucket; without a
progress bar on a terminal the run logs its status (step, loss, tokens/s, ETA, or the phase it is in) at
least every `status_every` seconds (dsv_jax/progress.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import signal
import tempfile
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv_jax.config import Config
from dsv_jax.data.feed import make_feed, resolve_data_config, tokens_per_sample
from dsv_jax.dsv.controller import DSVController
from dsv_jax.dsv.policy import make_policy
from dsv_jax.parallel.mesh import batch_sharding, data_parallel_size, make_mesh
from dsv_jax.parallel.policy import ContextPolicy, check_context
from dsv_jax.progress import Heartbeat, duration, on_terminal, tqdm_class
from dsv_jax.train.checkpoint import Checkpointer, check_step_saved, has_ema
from dsv_jax.train.distributed import any_process, check_same_config, host_copy
from dsv_jax.train.evaluation import held_out_loss
from dsv_jax.train.guard import DivergenceGuard, Verdict, non_finite_part
from dsv_jax.train.init_from import check_init_from, has_checkpoints, load_init_weights
from dsv_jax.train.metrics import MetricsWriter
from dsv_jax.train.mfu import StepFlops
from dsv_jax.train.optimizer import lr_at
from dsv_jax.train.step import abstract_model, create_state, ema_layout, make_train_step, state_layout
from dsv_jax.train.step_costs import StepCosts, step_kind

log = logging.getLogger("dsv_jax")


def enable_compilation_cache(path: str | None = None) -> None:
    path = path or os.environ.get("DSV_JAX_CACHE", os.path.expanduser("~/.cache/dsv-jax/xla"))
    try:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        # The fused AdaLN kernels use custom_partitioning, whose callback address would otherwise make
        # every cache key unique.
        jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", True)
    except (OSError, AttributeError) as e:  # a read-only home (or an older jax) must not stop training
        log.warning("no persistent compilation cache (%s)", e)


def check_writable(workdir: str) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
        # a private probe file: every host of a multi-host run checks the same workdir at once
        with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write_test"):
            pass
    except OSError as e:
        raise PermissionError(f"workdir {workdir!r} is not writable: {e.strerror or e}") from None


class TrainingStopped(Exception):
    """`train` stopped early on a signal (SIGTERM: preemption, a scheduler's time limit; SIGINT: Ctrl-C)
    after saving a checkpoint: rerunning the same training resumes it. `exit_status` is the shell's
    convention for a process ended by that signal, 128 + its number (143 for SIGTERM, 130 for SIGINT),
    which `dsv-jax train` exits with so that a job script can requeue."""

    def __init__(self, signum: int, step: int, records: list | None = None):
        self.signum, self.step, self.records = int(signum), int(step), records or []
        self.exit_status = 128 + self.signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name} at step {step} (checkpoint saved): run the same "
            f"command to resume (exit status {self.exit_status})"
        )


class StopRequest:
    """SIGTERM / SIGINT set a flag; the loop saves a checkpoint and exits at the next step boundary.
    A second Ctrl-C interrupts at once. `signum`: the first signal received (None: none here)."""

    def __init__(self):
        self.requested = False
        self.signum: int | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signum = self.signum or signum
        log.warning("received %s: saving a checkpoint and stopping", signal.Signals(signum).name)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Prefetcher:
    """Produces batches on a background thread; `state` is the feed state after the last batch taken."""

    def __init__(self, feed, depth: int = 2):
        self.feed, self.state = feed, feed.get_state()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, daemon=True)
        self._thread.start()

    def _work(self):
        try:
            for batch in self.feed:
                item = (batch, self.feed.get_state())
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        pass
                if self._stop.is_set():
                    return
        except Exception as e:  # surfaced on the consumer side
            self._queue.put(e)

    def next(self):
        item = self._queue.get()
        if isinstance(item, Exception):
            raise item
        batch, self.state = item
        return batch

    def close(self):
        self._stop.set()
        self._thread.join(timeout=30)  # after this the feed is no longer advanced behind our back


def batch_spec(cfg: Config, mesh, b: int, shape) -> dict[str, jax.ShapeDtypeStruct]:
    """Abstract global batch of b samples of latent `shape` (T, H, W), sharded over the batch axes."""
    t, h, w = shape
    spec = {
        "latents": ((b, t, h, w, cfg.model.in_channels), jnp.float32),
        "text_mask": ((b, cfg.text.max_len), jnp.bool_),
    }
    if cfg.text.encoder == "builtin":
        spec["text_ids"] = ((b, cfg.text.max_len), jnp.int32)
    else:
        spec["text_emb"] = ((b, cfg.text.max_len, cfg.model.text_dim), jnp.float32)
    return {k: jax.ShapeDtypeStruct(s, d, sharding=batch_sharding(mesh, len(s))) for k, (s, d) in spec.items()}


def lower_train_step(cfg: Config, graphdef, attention, abstract_state, state_sharding, batch, attention_inputs=None):
    """The lowered train step for one abstract batch (state donated); `attention_inputs` (abstract) are
    the DSV controller's runtime arrays when attention is DSV. `.compile()` it (possibly on another thread)."""
    step = make_train_step(cfg, graphdef, attention)
    jitted = jax.jit(step, donate_argnums=(0,), out_shardings=(state_sharding, None))
    args = [abstract_state, batch, jax.ShapeDtypeStruct((), jnp.float32)]
    if attention_inputs is not None:
        args.append(attention_inputs)
    return jitted.lower(*args)


def compile_train_step(cfg: Config, graphdef, attention, abstract_state, state_sharding, batch, attention_inputs=None):
    """The ahead-of-time compiled train step (see `lower_train_step`)."""
    return lower_train_step(cfg, graphdef, attention, abstract_state, state_sharding, batch, attention_inputs).compile()


class Trainer:
    def __init__(
        self,
        cfg: Config,
        workdir: str,
        *,
        devices=None,
        resume: bool = True,
        progress: bool = True,
        checkpoint: int | None = None,
        status_every: float = 30.0,
    ):
        """`checkpoint`: the step to resume from (default: the newest readable one). `progress`: a progress
        bar where stderr is a terminal; without one the run logs its status at least every `status_every`
        seconds."""
        if not status_every > 0:
            raise ValueError(f"status_every={status_every} must be > 0 seconds")
        cfg = resolve_data_config(cfg)  # a prepared dataset's buckets and codec go into the saved config
        check_same_config(cfg)  # the processes of a multi-host run must agree
        self.cfg, self.workdir, self.progress = cfg, os.path.abspath(workdir), progress
        self.mesh = make_mesh(cfg.parallel, devices)  # before any folder is made: sizes that do not fit fail here
        if self.mesh.shape["context"] > 1:
            check_context(cfg, self.mesh, cfg.data.buckets)
        if resume and checkpoint is not None:  # a step that is not there is a bad argument: nothing made yet
            check_step_saved(os.path.join(self.workdir, "checkpoints"), checkpoint)
        self.init_from = None  # the export this new run's weights come from (train.init_from)
        if cfg.train.init_from:  # a checkpoint wins: a run started from an export resumes as any other
            if resume and has_checkpoints(os.path.join(self.workdir, "checkpoints")):
                log.info(
                    "resuming from the checkpoints in %s: train.init_from=%s is ignored",
                    self.workdir,
                    cfg.train.init_from,
                )
            else:
                check_init_from(cfg, cfg.train.init_from)  # before anything is written
                self.init_from = cfg.train.init_from
        check_writable(self.workdir)
        enable_compilation_cache()
        self.is_main = jax.process_index() == 0
        self.show_bar = progress and self.is_main and on_terminal()
        self.status_every = status_every
        self.stop_signal: int | None = None  # the signal that stopped the last run() early, if one did
        self._heartbeat: Heartbeat | None = None
        self._phase: tuple[str, float] | None = None  # what the run is doing besides steps, since when
        self._status = {}  # the training loop's position, for the status line
        dp = data_parallel_size(self.mesh)
        self.feed = make_feed(
            cfg, batch_multiple=dp, process_index=jax.process_index(), process_count=jax.process_count()
        )
        self.checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"), keep=cfg.train.keep_checkpoints)
        self.graphdef, abstract_params = abstract_model(cfg)
        self.abstract_state, self.state_sharding = state_layout(cfg, self.mesh)
        # What every block's attention runs at each step: a static policy or the DSV controller, on the
        # context axis when the sequence of a sample spans several devices
        self.policy = make_policy(cfg)
        if self.mesh.shape["context"] > 1:
            self.policy = ContextPolicy(self.policy, cfg, self.mesh, self.feed.batch_size)
        self.step_flops = StepFlops(cfg, self.mesh)

        latest = None
        if resume:  # the newest readable step (one line per unreadable one), or the one asked for
            # read as saved (with an EMA of the weights or without), then made to what cfg asks
            layout = lambda saved: ema_layout(self.abstract_state, has_ema(saved))
            latest, _, state, data_state = self.checkpointer.restore_readable(layout, cfg, step=checkpoint)
            self.checkpointer.set_aside_after(latest)  # newer steps (unreadable, rejected, or left by --checkpoint)
            self.checkpointer.await_verdict(latest)  # a step saved last (SIGTERM) is judged by our first loss
        self.resumed_step = latest
        self._logged_step = latest  # metrics.jsonl holds the records up to here (a later run() continues)
        self.guard: DivergenceGuard | None = None
        if latest is not None:
            self.state = self._match_ema(state, latest)
            self.feed.set_state(data_state)
            saved = self.checkpointer.controller_state(latest)
            if saved is not None:
                self.policy.load_state_dict(saved)
            log.info("resumed from step %d in %s", latest, self.checkpointer.directory)
        else:
            self.state = create_state(cfg, self.state_sharding)
            if self.init_from:
                self.state = load_init_weights(self.state, self.init_from, self.state_sharding)
        self.start_step = int(self.state.step)
        if self.is_main:
            with open(os.path.join(self.workdir, "config.json"), "w") as f:
                f.write(cfg.to_json())
        self._compiled: dict[Any, Any] = {}
        self._eval_fns: dict[Any, Any] = {}
        self._warm = False  # set once every bucket of the feed is compiled
        self._data_state = None  # where the last run() stopped reading (its prefetcher ran ahead of it)
        self.step_costs = StepCosts()  # each step's wall time by kind, for the policy's end-of-run summary

    @property
    def inference_params(self):
        """The weights that sampling and evaluation of this run use: the EMA of the weights where the run
        keeps one (train.ema_decay > 0), else the trained weights."""
        return self.state.params if self.state.ema is None else self.state.ema

    def _match_ema(self, state, step: int):
        """A restored state with the EMA the config asks for: one that a checkpoint without it (trained with
        train.ema_decay=0, or older) lacks starts from its parameters; one the config turned off is dropped."""
        want = self.cfg.train.ema_decay > 0
        if want and state.ema is None:
            log.warning(
                "checkpoint step %d has no EMA of the weights (trained with train.ema_decay=0): the "
                "EMA starts from its parameters",
                step,
            )
            copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.state_sharding.params)
            return state.replace(ema=copy(state.params))
        if not want and state.ema is not None:
            log.warning(
                "checkpoint step %d has an EMA of the weights; train.ema_decay=0 drops it (sampling "
                "will use the trained weights)",
                step,
            )
            return state.replace(ema=None)
        return state

    # -- compilation ------------------------------------------------------------------------
    def batch_spec(self, shape) -> dict[str, jax.ShapeDtypeStruct]:
        return batch_spec(self.cfg, self.mesh, self.feed.batch_size(shape), shape)

    def attention_for(self, shape, *, train: bool = True, profile: bool = False, step: int | None = None):
        """(plans, runtime inputs or None) of a step on `shape` (training step `step`), from the attention policy."""
        return (
            self.policy.plans(shape, train=train, profile=profile, step=step),
            self.policy.inputs(shape, train=train, step=step),
        )

    def compiled_step(self, shape, plans=None):
        """The compiled train step of a bucket shape and attention plan (cached by (shape, plans))."""
        if plans is None:
            plans = self.attention_for(shape)[0]
        key = (tuple(shape), plans)
        if key not in self._compiled:
            if self._warm and all(tuple(shape) != k[0] for k in self._compiled):
                log.warning("compiling bucket %s after warm-up: it is not among the feed's shapes", shape)
            replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            inputs = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=replicated),
                self.policy.inputs(shape),
            )
            t0 = time.perf_counter()
            self._compiled[key] = compile_train_step(
                self.cfg, self.graphdef, plans, self.abstract_state, self.state_sharding, self.batch_spec(shape), inputs
            )
            if self._warm:  # a new DSV decision (precompiled variants are not logged)
                log.info(
                    "compiled a new attention variant for %s in %.1fs",
                    "x".join(map(str, shape)),
                    time.perf_counter() - t0,
                )
        return self._compiled[key]

    def precompile(self) -> float:
        t0 = time.perf_counter()
        shapes, compiled = self.feed.shapes, 0
        for i, shape in enumerate(shapes):
            # steps 0 and 1: with and without the predictor's update, where the policy alternates them
            variants = {self.attention_for(shape, step=step)[0] for step in (0, 1)}
            variants.add(self.attention_for(shape, profile=True)[0])  # the profiling variant, where it profiles
            new = [plans for plans in variants if (tuple(shape), plans) not in self._compiled]
            if not new:
                continue
            more = f", {len(new)} attention variants" if len(new) > 1 else ""
            with self.phase(
                f"compiling the train step for bucket {'x'.join(map(str, shape))} ({i + 1} of {len(shapes)}{more})"
            ):
                for plans in new:
                    self.compiled_step(shape, plans)
            compiled += 1
        self._warm = True
        if compiled:
            self.say("compiled %d bucket(s) in %s", compiled, duration(time.perf_counter() - t0))
        return time.perf_counter() - t0

    # -- what the run says while it works ----------------------------------------------------
    def say(self, message: str, *args) -> None:
        """A log line of the main process (it resets the status line's clock)."""
        if not self.is_main:
            return
        if self._heartbeat is not None:
            self._heartbeat.say(message, *args)
        else:
            log.info(message, *args)

    @contextlib.contextmanager
    def phase(self, what: str):
        """Announce `what` (compiling, evaluating) and report it as the status while it runs."""
        previous = self._phase
        self._phase = (what, time.monotonic())
        self.say("%s ...", what)
        try:
            yield
        finally:
            self._phase = previous

    def status_line(self) -> str | None:
        """The run's status: the phase it is in, or its step, loss, tokens/s and time to the end."""
        if self._phase is not None:
            what, since = self._phase
            return f"{what}: {duration(time.monotonic() - since)} so far"
        st = self._status
        if not st:
            return None
        now, step = time.monotonic(), st["step"]
        if step == st["first"]:
            return f"step {step}/{st['end']}: the first step is running ({duration(now - st['t0'])} so far)"
        rate = (st["tokens"] - st["beat_tokens"]) / max(now - st["beat_t"], 1e-9)
        st["beat_tokens"], st["beat_t"] = st["tokens"], now
        eta = (now - st["t0"]) / (step - st["first"]) * (st["end"] - step)
        return f"step {step}/{st['end']}: loss {st['loss']:.4f}, {rate:,.0f} tokens/s, ETA {duration(eta)}"

    def to_global(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {
            k: jax.make_array_from_process_local_data(batch_sharding(self.mesh, v.ndim), v) for k, v in batch.items()
        }

    # -- loop -------------------------------------------------------------------------------
    @property
    def controller(self):
        """The DSV controller (stage, decisions, per-bucket rungs) when attention=dsv, else None; under
        context parallelism it is the policy that ContextPolicy wraps."""
        policy = getattr(self.policy, "inner", self.policy)
        return policy if isinstance(policy, DSVController) else None

    def run(self, stop_at: int | None = None) -> list[dict[str, Any]]:
        """Train until cfg.train.steps (or `stop_at`, or a signal). Returns the logged records."""
        cfg = self.cfg
        total = cfg.train.steps
        end = min(total, stop_at) if stop_at is not None else total
        writer = self._writer = MetricsWriter(self.workdir, enabled=self.is_main, resume_step=self._logged_step)
        self.guard = guard = DivergenceGuard(
            cfg.train,
            history=[
                r["loss"] for r in writer.history if "loss" in r and not r.get("skipped") and not r.get("diverged")
            ],
        )
        records: list[dict[str, Any]] = []
        step = int(self.state.step)  # not start_step: run() may be called again (stop_at in rounds)
        self.stop_signal = None
        if step >= end:
            log.info("nothing to train: at step %d of %d", step, end)
        else:
            # the status line where no bar shows progress (a batch job's log, --no-progress)
            with Heartbeat(self.status_every, self.status_line, enabled=self.is_main and not self.show_bar) as beat:
                self._heartbeat = beat
                try:
                    self._train_loop(writer, guard, records, step, end, total)
                finally:
                    self._heartbeat = None
        self.checkpointer.wait()
        writer.close()
        self._logged_step = int(self.state.step)
        if not guard.healthy:  # stopped on bad steps, or ended on one: nothing was saved or will be sampled
            raise guard.error(self.checkpointer.newest_good())
        return records

    def _train_loop(self, writer, guard, records, step, end, total) -> None:
        """Compile, then train from `step` to `end` (see run); `records` collects the logged records."""
        cfg = self.cfg
        compile_s = self.precompile()
        writer.write(
            step,
            {
                "compile_seconds": compile_s,
                "buckets": len(self.feed.shapes),
                **self.policy.summary(self.feed.shapes),
            },
        )
        if self._data_state is not None:  # a second run() continues with the next batch, not past it
            self.feed.set_state(self._data_state)
        prefetch = Prefetcher(self.feed)
        bar = tqdm_class()(total=end, initial=step, desc="train", disable=not self.show_bar, dynamic_ncols=True)
        now = time.monotonic()  # the status line's rates and ETA count from here
        self._status = dict(
            step=step, first=step, end=end, loss=float("nan"), tokens=0, t0=now, beat_t=now, beat_tokens=0
        )
        pending, window_t0, window_tokens, window_flops = [], time.perf_counter(), 0, 0.0
        costs = self.step_costs
        # Host time spent beside the steps in the current log window (compiling a new attention variant,
        # saving, evaluating): left out of step_time / tokens_per_s / MFU, which measure training steps.
        aside = 0.0

        def timed(fn, *args):
            nonlocal aside
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                aside += time.perf_counter() - t0

        try:
            with StopRequest() as stop:
                signalled = False
                while step < end and not guard.should_stop:
                    if any_process(stop.requested):  # a signal on any process stops all of them here
                        signalled = True
                        break
                    step_t0, aside_t0 = time.perf_counter(), aside
                    batch = prefetch.next()
                    shape = batch["latents"].shape[1:4]
                    b_global = batch["latents"].shape[0] * jax.process_count()
                    lr = np.float32(lr_at(cfg.train, step))
                    self._policy_events(writer, step, self.policy.before_step(step))
                    profile = self.policy.profile_due(step, shape)
                    plans, inputs = self.attention_for(shape, profile=profile, step=step)
                    args = (self.state, self.to_global(batch), lr) + ((inputs,) if inputs is not None else ())
                    self.state, metrics = timed(self.compiled_step, shape, plans)(*args)
                    extra = self.policy.record(shape, step=step, profile=profile)
                    step += 1
                    if profile:  # the policy decides on this step's statistics (a host sync)
                        host = jax.device_get({k: v for k, v in metrics.items() if k.startswith("dsv/")})
                        self._policy_events(writer, step, self.policy.observe(step - 1, shape, host))
                    verdict = self._check_step(step, metrics)
                    if verdict.bad == "diverged":
                        extra = {**extra, "diverged": 1}
                    costs.add(shape, step_kind(extra), time.perf_counter() - step_t0 - (aside - aside_t0))
                    tokens = b_global * tokens_per_sample(shape, cfg.model.patch)
                    window_tokens += tokens
                    self._status.update(step=step, loss=verdict.loss, tokens=self._status["tokens"] + tokens)
                    window_flops = window_flops + self.step_flops(shape, b_global, plans, inputs)
                    pending.append((step, shape, b_global, metrics, extra))
                    save_due = step % cfg.train.ckpt_every == 0 and step < end
                    if step % cfg.train.log_every == 0 or step == end or save_due:  # no checkpoint ahead of the log
                        jax.block_until_ready(metrics)
                        elapsed = time.perf_counter() - window_t0 - aside
                        for rec in self._records(pending, elapsed, window_tokens, window_flops):
                            writer.write(rec["step"], rec)
                            records.append(rec)
                        bar.set_postfix(loss=f"{records[-1]['loss']:.4f}", refresh=False)
                        pending, window_t0, window_tokens, window_flops = [], time.perf_counter(), 0, 0.0
                        aside = 0.0
                    bar.update(1)
                    if save_due:
                        timed(self.save, prefetch.state)
                    if cfg.train.eval_every and cfg.train.eval_batches and step % cfg.train.eval_every == 0:
                        writer.write(step, timed(self.evaluate))
                elapsed = time.perf_counter() - window_t0 - aside
                for rec in self._records(pending, elapsed, window_tokens, window_flops):
                    writer.write(rec["step"], rec)
                    records.append(rec)
                self.save(prefetch.state)
                stopped = step < end
                self._run_summary(writer, step, costs)
                if signalled:  # a process without a signal of its own was stopped by another's: as SIGTERM
                    self.stop_signal = stop.signum or signal.SIGTERM
        finally:
            prefetch.close()
            self._data_state = prefetch.state
            bar.close()
            self._status = {}
        if not stopped and step == total and guard.healthy and cfg.train.eval_batches:  # 0: no held-out loss
            held_out = self.evaluate()
            writer.write(step, held_out)
            loss = held_out.get("eval_loss", held_out.get("train_records_loss"))
            if loss is not None:  # the last save's first loss
                self.checkpointer.judge(step, math.isfinite(loss), f"held-out loss {loss:.4g}")

    def _check_step(self, step: int, metrics) -> Verdict:
        """The guard's verdict on a step, which is also the verdict on a checkpoint saved one step
        earlier. Reading the loss waits for the step: the host never runs ahead of the device, so a
        signal stops the loop at the next step boundary (not after all the steps dispatched ahead)."""
        loss, finite, grad_norm = jax.device_get(
            jax.block_until_ready((metrics["loss"], metrics["finite"], metrics["grad_norm"]))  # every shard
        )
        verdict = self.guard.observe(step, loss, bool(finite), float(grad_norm))
        self.checkpointer.judge(step - 1, verdict.bad is None, verdict.reason or f"next loss {verdict.loss:.4g}")
        return verdict

    def _run_summary(self, writer, step, costs: StepCosts):
        """The policy's end-of-run summary (DSV: steps that trained the predictor and profiled, back-off,
        measured cost), logged and written to the metrics."""
        summary = self.policy.run_summary(costs.estimate())
        if summary:
            for line in (v for v in summary.values() if isinstance(v, str)):
                log.info(line)
            writer.write(step, summary)

    def _policy_events(self, writer, step, lines):
        for line in lines:
            log.info(line)
            writer.write(step, {"dsv/event": line})

    def _records(self, pending, elapsed, tokens, flops=0.0):
        if not pending:
            return []
        host = jax.device_get([p[3] for p in pending])
        per_step = elapsed / len(pending)
        mfu = self.step_flops.metrics(flops, elapsed) if np.ndim(flops) else {}  # over the window, as tokens/s
        out = []
        for (step, shape, b, _, extra), m in zip(pending, host):
            rec = {}
            for k, v in m.items():
                if k != "finite":
                    rec.update(flatten_metric(k, v))
            rec.update(extra)
            rec.update(
                step=step,
                bucket="x".join(map(str, shape)),
                batch=b,
                step_time=per_step,
                tokens_per_s=tokens / max(elapsed, 1e-9),
                skipped=int(not bool(m["finite"])),
                **mfu,
            )
            if not m["finite"]:
                log.warning(
                    "step %d: %s, update skipped", step, non_finite_part(float(m["loss"]), float(m["grad_norm"]))
                )
            if m.get("cp/fallback") is not None and np.any(m["cp/fallback"]):
                log.warning(
                    "step %d: selective context attention overflowed its capacity in %d block(s) (%d KV "
                    "blocks over); those took the exact all-gather path",
                    step,
                    int(np.sum(m["cp/fallback"] > 0)),
                    int(np.sum(m["cp/overflow_blocks"])),
                )
            out.append(rec)
        return out

    def save(self, data_state: dict) -> None:
        step = int(self.state.step)
        if step in self.checkpointer.all_steps():
            return
        if self.guard is not None and not self.guard.healthy:
            since = self.guard.last.step - self.guard.streak + 1
            if getattr(self, "_unsaved_since", None) != since:  # once per bad streak
                self._unsaved_since = since
                log.warning("not saving step %d: steps are bad since step %d", step, since)
            return
        self.checkpointer.save(step, self.state, data_state, self.cfg, self.policy.state_dict())

    def evaluate(self) -> dict[str, float]:
        """Held-out loss at fixed timesteps (EVAL_T) with fixed noise, per bucket and overall: `eval_loss`,
        or `train_records_loss` where the data has no held-out split (a prepared dataset without
        --eval-fraction: the loss is then measured on training records). Both of the trained weights;
        with an EMA of the weights the same of the EMA too, as `eval_loss_ema` (what `dsv-jax eval` reports)."""
        with self.phase("evaluating the held-out loss"):
            return self._evaluate()

    def _evaluate(self) -> dict[str, float]:
        cfg = self.cfg
        eval_feed = make_feed(
            cfg,
            batch_multiple=data_parallel_size(self.mesh),
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            split="eval",
        )
        name = "eval_loss" if eval_feed.heldout else "train_records_loss"
        weights = [(self.state.params, name)]
        if self.state.ema is not None:
            weights.append((self.state.ema, f"{name}_ema"))
        out = {}
        for params, key in weights:
            out.update(
                held_out_loss(
                    cfg,
                    self.graphdef,
                    params,
                    lambda s: self.attention_for(s, train=False),
                    eval_feed,
                    cfg.train.eval_batches,
                    put=self.to_global,
                    cache=self._eval_fns,
                    name=key,
                )
            )
        return out

    def close(self) -> None:
        if getattr(self, "_writer", None) is not None:  # a run that raised left it open
            self._writer.close()
        self.checkpointer.close()
        self.feed.close()  # a Grain feed's prefetch processes


def flatten_metric(name: str, value) -> dict[str, float]:
    """A step metric as scalars: per-block arrays [depth] / [depth, H] (DSV) become name/block{i}[/head{h}]
    plus their means (name, name/block{i}); NaN entries (nothing measured) are left out. Arrays of more
    dimensions (DSV's recall curves [depth, H, fractions]) are for the controller, which keeps their EMA
    in its state, and are not logged."""
    v = np.asarray(value, np.float64)
    if v.ndim == 0:
        return {name: float(v)}
    if v.ndim > 2:
        return {}
    out = {}
    if np.isfinite(v).any():
        out[name] = float(np.nanmean(v))
    for i, row in enumerate(v):
        if v.ndim == 1:
            if np.isfinite(row):
                out[f"{name}/block{i}"] = float(row)
            continue
        if np.isfinite(row).any():
            out[f"{name}/block{i}"] = float(np.nanmean(row))
        out.update({f"{name}/block{i}/head{h}": float(x) for h, x in enumerate(np.ravel(row)) if np.isfinite(x)})
    return out


def train(
    cfg: Config,
    workdir: str,
    *,
    stop_at: int | None = None,
    devices=None,
    progress: bool = True,
    sample: bool | None = None,
    checkpoint: int | None = None,
    status_every: float = 30.0,
) -> list[dict[str, Any]]:
    """Train (resuming from workdir, or from its `checkpoint` step), then write a sample GIF of the
    trained model if configured. Raises TrainingDiverged (no sample) when the guard stops the run, and
    TrainingStopped (a checkpoint saved, no sample) when a signal (SIGTERM, Ctrl-C) stopped it early.
    `status_every`: see Trainer."""
    trainer = Trainer(
        cfg, workdir, devices=devices, progress=progress, checkpoint=checkpoint, status_every=status_every
    )
    cfg = trainer.cfg  # as resolved (a prepared dataset's buckets and codec)
    try:
        records = trainer.run(stop_at=stop_at)
        done = int(trainer.state.step) >= cfg.train.steps
        if (cfg.train.sample_at_end if sample is None else sample) and done:
            sample_at_end(trainer)
    finally:
        trainer.close()
    if trainer.stop_signal is not None:
        raise TrainingStopped(trainer.stop_signal, int(trainer.state.step), records)
    return records


def sample_path(workdir: str, step: int) -> str:
    """Where a run's end-of-run sample of `step` goes (written by `sample_at_end`)."""
    return os.path.join(workdir, "samples", f"step_{step:06d}.gif")


def sample_at_end(trainer: Trainer) -> str | None:
    """The end-of-run sample GIF of a finished run, or None: a run that trained successfully never
    fails here; a model that cannot sample (text.encoder=precomputed: no encoder for the prompts)
    or a failing sampler is one warning. Every process calls it (the parameters are gathered from all of
    them); the main process samples on its own device and writes the file."""
    cfg = trainer.cfg
    if cfg.text.encoder != "builtin":
        log.warning(
            "no end-of-run sample: the model takes precomputed text embeddings; sample it with "
            "`dsv-jax sample --model %s --text-encoder pkg.module:make`",
            trainer.workdir,
        )
        return None
    from dsv_jax.sample import sample_from_state

    ema = trainer.state.ema is not None  # the weights `dsv-jax sample` would take
    params = host_copy(trainer.inference_params)  # a collective: every process takes part
    if not trainer.is_main:
        return None
    path = sample_path(trainer.workdir, int(trainer.state.step))
    try:
        sample_from_state(
            cfg,
            trainer.graphdef,
            params,
            path,
            steps=cfg.train.sample_steps,
            guidance=cfg.train.guidance,
            controller_state=trainer.policy.state_dict(),
            labels=True,  # for a person: each prompt under its video
        )
    except Exception as e:  # the checkpoint is saved: sampling again later is always possible
        log.warning(
            "no end-of-run sample (%s: %s); the checkpoint is saved, sample it with `dsv-jax sample`",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        log.debug("end-of-run sampling failed", exc_info=True)
        return None
    log.info("wrote %s (%s)", path, "the EMA of the weights" if ema else "the trained weights")
    return path
