"""The one checkpoint module: orbax CheckpointManager over {state, data, config}.

    state   TrainState (params, optimizer, step, rng, skipped), sharded arrays
    data    the data iterator's state (JSON), so a resumed run reads the identical batch sequence
    config  the run's config (JSON), checked against the resuming config before any array is read
    dsv     the DSV controller's state (JSON: stage, per-shape sorted sparsity and decisions), in DSV runs

Saves are asynchronous; a NaN/Inf parameter is never written. A saved step is judged later by the
first loss computed from its parameters (the next train step's, or the final held-out loss): when
that loss was good and the step's metadata files read back, `<step>/validation.json` marks it good;
a bad loss marks it rejected. Rotation (`keep`) never deletes the newest good step, and restoring
skips rejected steps.

Restoring tries the newest step first; a step that cannot be read is reported in one line (the file
and the reason) and the next older one is tried. Nothing unreadable is deleted: a training run that
continues from an older step moves the newer ones aside (`checkpoints-set-aside/`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from dsv_jax.config import Config, architecture_diff
from dsv_jax.errors import DiskFull, is_disk_full, mib
from dsv_jax.train.orbax_quirks import late_reads_dropped, read_only_quiet

log = logging.getLogger("dsv_jax")

MARKER = "validation.json"
SET_ASIDE = "checkpoints-set-aside"  # beside the checkpoint folder: steps a training run went back past


class IncompatibleCheckpoint(ValueError):
    pass


class CheckpointError(RuntimeError):
    """No checkpoint could be read (or the one asked for); the message names the file and the reason."""


class MissingCheckpoint(ValueError):
    """The step asked for (`--checkpoint STEP`) is not saved there: a bad argument, not a broken run."""


def steps_on_disk(directory: str) -> list[int]:
    """The step folders (orbax names each by its number) in a checkpoints folder, read without opening a
    manager, so nothing is made; [] where there is no such folder."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def check_step_saved(directory: str, step: int, steps: list[int] | None = None) -> None:
    """Raise MissingCheckpoint unless `step` is among the checkpoint steps in `directory` (`steps`: as orbax
    lists them; default: `steps_on_disk`)."""
    if steps is None:
        steps = steps_on_disk(directory)
    if step in steps:
        return
    if not os.path.isdir(directory):
        raise MissingCheckpoint(f"no checkpoint at step {step}: no such directory {directory}")
    held = f"steps: {', '.join(map(str, steps))}" if steps else "it holds none"
    raise MissingCheckpoint(f"no checkpoint at step {step} in {directory} ({held})")


def _on_disk(state) -> dict[str, Any]:
    """The train state as a checkpoint holds it: a dict of its fields, without `ema` where the state keeps
    none (train.ema_decay = 0). That is the layout checkpoints had before the EMA existed, so they restore
    unchanged; a state with an EMA adds the key."""
    tree = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    if tree.get("ema", 0) is None:
        del tree["ema"]
    return tree


class NoEMA(ValueError):
    """The EMA of the weights was asked for where the run kept none."""


class KeepLatestAndGood:
    """orbax preservation policy: the newest `n` steps and the newest step marked good."""

    def __init__(self, n: int, is_good):
        self.n, self.is_good = n, is_good

    def should_preserve(self, checkpoints, *, context=None) -> list[bool]:
        steps = [c.step for c in checkpoints]
        keep = set(sorted(steps)[-self.n :])
        good = [s for s in steps if self.is_good(s)]
        if good:
            keep.add(max(good))
        return [s in keep for s in steps]


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True, read_only: bool = False):
        self.directory = os.path.abspath(directory)
        if read_only and not os.path.isdir(self.directory):
            raise FileNotFoundError(f"no checkpoint in {self.directory} (no such directory)")
        with read_only_quiet() if read_only else contextlib.nullcontext():
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=async_save,
                create=not read_only,
                read_only=read_only,
                preservation_policy=KeepLatestAndGood(keep, self.is_good),
            )
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._pending: dict[int, tuple[bool, str] | None] = {}  # saved steps -> verdict, until marked
        self._state_bytes = 0
        self._last_saved: int | None = None

    # -- steps and their marks ----------------------------------------------------------------
    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def validation(self, step: int) -> dict | None:
        """The step's mark ({"status": "good" | "rejected", "reason", ...}) or None (not judged)."""
        try:
            with open(os.path.join(self.step_dir(step), MARKER), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def is_good(self, step: int) -> bool:
        return (self.validation(step) or {}).get("status") == "good"

    def newest_good(self) -> int | None:
        good = [s for s in self.all_steps() if self.is_good(s)]
        return max(good) if good else None

    def verify(self, step: int) -> str | None:
        """Cheap metadata check of a step (no array is read): the problem as 'FILE: reason', or None."""
        return verify_step_dir(self.step_dir(step))

    # -- saving --------------------------------------------------------------------------------
    def save(self, step: int, state, data_state: dict, cfg: Config, controller_state: dict | None = None) -> bool:
        if not _all_finite(state.params):
            log.error("not saving step %d: parameters hold NaN/Inf; the last good checkpoint is kept", step)
            return False
        self._state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
        self.wait()  # the previous save is committed and marked before rotation looks for the newest good step
        self._check_space(step)
        items = dict(
            state=ocp.args.StandardSave(_on_disk(state)),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(cfg.to_dict()),
        )
        if controller_state is not None:
            items["dsv"] = ocp.args.JsonSave(controller_state)
        self._last_saved = step
        with self._disk_errors(step):
            saved = self.manager.save(step, force=True, args=ocp.args.Composite(**items))
        if saved:
            self._pending[step] = None
        return saved

    def _needed_bytes(self) -> tuple[int, bool]:
        """(bytes a save needs, measured): the newest checkpoint's size on disk plus 10%, or else the raw
        state size, which is only a rough guide (orbax compresses, but small sharded arrays cost more)."""
        steps = self.all_steps()
        if steps:
            size = _dir_bytes(self.step_dir(steps[-1]))
            if size:
                return int(size * 1.1), True
        return self._state_bytes, False

    def _check_space(self, step: int) -> None:
        """Fail before writing when the last checkpoint's size does not fit (not before the first save:
        without a measured size a false alarm could stop a run that would have fitted)."""
        needed, measured = self._needed_bytes()
        free = shutil.disk_usage(self.directory).free
        if measured and free < needed:
            raise DiskFull(
                f"disk full: checkpoint step {step} needs about {mib(needed)} in {self.directory}, {mib(free)} free"
            )

    @contextlib.contextmanager
    def _disk_errors(self, step: int | None):
        """orbax reports a full disk as a tensorstore error (from its writer threads): say it plainly."""
        try:
            yield
        except Exception as e:
            if isinstance(e, DiskFull) or not is_disk_full(e):
                raise
            step = step if step is not None else self._last_saved
            what = f"checkpoint step {step}" if step is not None else "a checkpoint"
            needed, measured = self._needed_bytes()
            size = f"needs about {mib(needed)}" if measured else f"holds {mib(needed)} of arrays (uncompressed)"
            raise DiskFull(
                f"disk full while writing {what} to {self.directory}: it {size}, "
                f"{mib(shutil.disk_usage(self.directory).free)} free"
            ) from e

    def await_verdict(self, step: int | None) -> None:
        """Let `judge` mark `step` (a restored step nobody judged yet)."""
        if step is not None and self.validation(step) is None:
            self._pending.setdefault(step, None)

    def judge(self, step: int, ok: bool, reason: str = "") -> None:
        """The verdict on the saved `step` from the first loss of its parameters; marked once committed."""
        if step in self._pending and self._pending[step] is None:
            self._pending[step] = (ok, reason)
        self._mark(block=False)

    def _mark(self, block: bool) -> None:
        if not self._pending or (not block and self.manager.is_saving_in_progress()):
            return
        for step, verdict in sorted(self._pending.items()):
            if verdict is None:
                continue
            del self._pending[step]
            ok, reason = verdict
            if not os.path.isdir(self.step_dir(step)):  # moved or deleted meanwhile
                continue
            problem = self.verify(step)
            status = "good" if ok and problem is None else "rejected"
            if status == "rejected":
                log.warning("checkpoint step %d rejected: %s", step, problem or reason)
            if jax.process_index() == 0:
                with open(os.path.join(self.step_dir(step), MARKER), "w", encoding="utf-8") as f:
                    json.dump({"status": status, "reason": problem or reason, "time": time.time()}, f)

    def wait(self) -> None:
        with self._disk_errors(None):
            self.manager.wait_until_finished()
        self._mark(block=True)

    def close(self) -> None:
        """Finish pending saves; an error here was already raised by `wait` (or is raised by the run
        being unwound), so it is logged, not raised again."""
        try:
            self.wait()
            self.manager.close()
        except Exception as e:
            log.debug("closing the checkpointer: %s", e)

    # -- reading -------------------------------------------------------------------------------
    def controller_state(self, step: int) -> dict | None:
        """The DSV controller state saved at `step`, or None (not a DSV run)."""
        if not os.path.isdir(os.path.join(self.step_dir(step), "dsv")):
            return None
        return self.manager.restore(step, args=ocp.args.Composite(dsv=ocp.args.JsonRestore()))["dsv"]

    def saved_config(self, step: int) -> dict[str, Any]:
        try:
            return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        except ValueError:  # an empty or torn JSON file: name it
            problem = verify_step_dir(self.step_dir(step))
            if problem is None:
                raise
            raise CheckpointError(problem) from None

    def check_compatible(self, step: int, cfg: Config, saved: Config | None = None) -> None:
        saved = saved or Config.from_dict(self.saved_config(step))
        diffs = architecture_diff(saved, cfg)
        if diffs:
            fields = "; ".join(f"{k}: checkpoint {a!r} != requested {b!r}" for k, a, b in diffs)
            raise IncompatibleCheckpoint(
                f"the checkpoint at {self.directory} (step {step}) has another model ({fields}); "
                "use another --workdir, or the checkpoint's settings"
            )

    def restore(self, step: int, abstract_state) -> tuple[Any, dict]:
        """Restore into `abstract_state` (ShapeDtypeStructs with shardings): any device count works."""
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_on_disk(abstract_state)), data=ocp.args.JsonRestore()
            ),
        )
        return abstract_state.replace(**out["state"]), out["data"]

    def restore_params(self, step: int, abstract_params, item: str = "params") -> Any:
        """Only the parameters of the train state saved at `step` (no optimizer moments), into
        `abstract_params` (the model's nnx.State of ShapeDtypeStructs, with shardings or without: then
        on the default device). item "ema": the EMA of the parameters instead (a run with train.ema_decay > 0)."""
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        tree = {item: abstract_params}
        restore_args = jax.tree.map(
            lambda a: ocp.ArrayRestoreArgs(sharding=getattr(a, "sharding", None) or device), tree
        )
        with ocp.PyTreeCheckpointer() as reader:  # the state item alone, read partially
            out = reader.restore(
                os.path.join(self.directory, str(step), "state"),
                args=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args, partial_restore=True),
            )
        return out[item]

    def restore_readable(
        self,
        abstract_state,
        cfg: Config | None = None,
        *,
        step: int | None = None,
        params_only: bool = False,
        item=None,
    ):
        """(step, saved config, state, data state) of `step`, or else of the newest readable step that
        is not rejected; (None, None, None, None) when there is no checkpoint. `abstract_state`: the
        ShapeDtypeStructs to restore into, or a function of the saved config giving them. `cfg`: the
        requested config, checked first (IncompatibleCheckpoint is raised, never skipped). params_only:
        `abstract_state` describes the parameters alone, and only they are read (state is the params,
        data state None): what inference needs, without the optimizer moments; `item` (a function of the
        saved config) then names the state's field to read, "params" (default) or "ema"."""
        steps = self.all_steps()
        if step is not None:
            check_step_saved(self.directory, step, steps)
        rejected = {s for s in steps if (self.validation(s) or {}).get("status") == "rejected"}
        if step in rejected:
            log.warning(
                "checkpoint step %d was rejected (%s); restoring it as asked", step, self.validation(step).get("reason")
            )
        elif step is None and rejected:
            log.info("skipping rejected checkpoint step(s) %s", ", ".join(map(str, sorted(rejected))))
        candidates = [step] if step is not None else [s for s in reversed(steps) if s not in rejected]
        if steps and not candidates:
            raise CheckpointError(
                f"every checkpoint in {self.directory} was rejected (a bad loss after it); "
                f"--checkpoint STEP restores one anyway (steps: {', '.join(map(str, steps))})"
            )
        failed = []
        for s in candidates:
            try:
                with late_reads_dropped():  # an array that fails leaves the others' reads in flight
                    restored = self._restore_step(s, abstract_state, cfg, params_only, item)
            except (IncompatibleCheckpoint, NoEMA):  # the request, not the step, is wrong: no older step helps
                raise
            except Exception as e:  # orbax / tensorstore raise many types; each becomes one line here
                reason = describe_failure(self.step_dir(s), e)
                if step is not None:
                    raise CheckpointError(f"checkpoint step {s} cannot be read: {reason}") from e
                log.error("checkpoint step %d cannot be read: %s", s, reason)
                failed.append(s)
                continue
            if failed:
                log.warning("restored checkpoint step %d, the newest readable one", s)
            return restored
        if failed:
            raise CheckpointError(
                f"no readable checkpoint in {self.directory} (steps {', '.join(map(str, failed))} "
                "failed, see above); move the folder away to start afresh"
            )
        return None, None, None, None

    def _restore_step(self, s: int, abstract_state, cfg: Config | None, params_only: bool, item):
        """(s, saved config, state, data state) of step `s`, as `restore_readable` asks (it raises)."""
        problem = self.verify(s)
        if problem:
            raise CheckpointError(problem)
        saved = Config.from_dict(self.saved_config(s))
        if cfg is not None:
            self.check_compatible(s, cfg, saved)
        abstract = abstract_state(saved) if callable(abstract_state) else abstract_state
        if params_only:
            return s, saved, self.restore_params(s, abstract, item(saved) if item else "params"), None
        return (s, saved, *self.restore(s, abstract))

    def set_aside_after(self, step: int | None) -> None:
        """Move every step newer than `step` to checkpoints-set-aside/ (a run continuing from an older
        step would otherwise meet them again); nothing is deleted."""
        newer = [s for s in self.all_steps() if step is None or s > step]
        if not newer:
            return
        if jax.process_index() == 0:
            aside = os.path.join(os.path.dirname(self.directory), SET_ASIDE)
            os.makedirs(aside, exist_ok=True)
            for s in newer:
                target = os.path.join(aside, str(s))
                n = 1
                while os.path.exists(target):
                    target, n = os.path.join(aside, f"{s}-{n}"), n + 1
                os.replace(self.step_dir(s), target)
                log.warning("moved checkpoint step %d aside to %s", s, target)
        if jax.process_count() > 1:  # every host lists the same steps before the next save
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("dsv_jax: checkpoints set aside")
        self.manager.reload()


def _dir_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:  # removed meanwhile
                pass
    return total


_PATH = re.compile(r'file "([^"]+)"')  # tensorstore: ... local file "PATH": reason
_ARRAY = re.compile(r'Error reading "([^"/]+)/')  # tensorstore: Error reading "params.x.kernel.value/0.1" ...


def verify_step_dir(root: str) -> str | None:
    """The first metadata file of a checkpoint step folder that does not read back, as 'FILE: reason',
    or None. Every JSON file orbax writes beside the array chunks must parse; chunks are not read."""
    if not os.path.isdir(root):
        return f"{root}: no such directory"
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "d")  # array chunks (binary)
        for name in sorted(files):
            if not (
                name in ("_CHECKPOINT_METADATA", "metadata", "_METADATA", "_sharding")
                or os.path.basename(folder) == "array_metadatas"
            ):
                continue
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as f:
                    raw = f.read()
                if not raw.strip():
                    return f"{path}: empty file"
                json.loads(raw)
            except ValueError as e:
                return f"{path}: not valid JSON ({e})"
            except OSError as e:
                return f"{path}: {e.strerror or e}"
    return None


def describe_failure(step_dir: str, e: BaseException) -> str:
    """One line for a checkpoint step that failed to load: the file, the array where tensorstore names
    one, and the innermost reason (not orbax's tracebacks and tensorstore specs)."""
    found = verify_step_dir(step_dir)
    if found or isinstance(e, CheckpointError):
        return found or str(e)
    chain, x = [], e
    while x is not None and len(chain) < 8:
        chain.append(x)
        x = x.__cause__ or x.__context__
    texts = [str(x) for x in chain]
    for text in texts[::-1]:  # the innermost message names the file most precisely
        text = text.split(" [tensorstore_spec=", 1)[0]
        paths = _PATH.findall(text)
        if paths:
            array = _ARRAY.search(text)
            reason = text[text.rfind(f'"{paths[-1]}"') + len(paths[-1]) + 2 :].lstrip(": ").strip()
            where = f"{paths[-1]} (array {array.group(1).removesuffix('.value')})" if array else paths[-1]
            return f"{where}: {(reason.splitlines() or ['unreadable'])[0][:300]}"
    first = next((t.strip().splitlines()[0] for t in texts[::-1] if t.strip()), "")
    return f"{step_dir}: {type(chain[-1]).__name__}: {first[:200]}"


def _all_finite(tree) -> bool:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return bool(_leaves_finite(leaves)) if leaves else True


@jax.jit
def _leaves_finite(leaves):
    """One program for all leaves: op by op, each leaf's shape and sharding compiled its own isfinite
    and reduction (about 50 compiles, 1-3 s on the CPU, at a process's first save)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


WEIGHTS = ("auto", "ema", "raw")


def has_ema(cfg: Config) -> bool:
    """Whether a run's checkpoints hold an EMA of the weights (saved since train.ema_decay exists; an
    older checkpoint's config reads ema_decay 0, and it has none)."""
    return cfg.train.ema_decay > 0


def weights_used(cfg: Config, weights: str) -> str:
    """ "ema" or "raw": the weights that a request `weights` (auto | ema | raw) reads from the checkpoints of a
    run with config `cfg`. "ema" where the run kept none is an error (NoEMA)."""
    if weights == "ema" and not has_ema(cfg):
        raise NoEMA(
            "has no EMA of the weights (the run trained with train.ema_decay=0); use the trained weights "
            "(--weights raw)"
        )
    return "ema" if has_ema(cfg) and weights != "raw" else "raw"


def load_trained(workdir: str, step: int | None = None, weights: str = "auto"):
    """(config, graphdef, params, DSV controller state or None, step) of a training workdir's newest
    readable (or `step`) checkpoint, restored on the default device: what sampling and analysis need.
    `weights`: "auto" the EMA of the weights where the run kept one (train.ema_decay > 0), else the
    trained parameters; "ema" the EMA (an error where there is none); "raw" the trained parameters.
    Reads only: nothing is created in `workdir`."""
    from dsv_jax.train.step import abstract_model

    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r} is not one of {', '.join(WEIGHTS)}")
    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"no checkpoint in {workdir}: no such directory")
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False, read_only=True)

    def item(saved: Config) -> str:  # the state's field to read
        try:
            return "ema" if weights_used(saved, weights) == "ema" else "params"
        except NoEMA as e:
            raise NoEMA(f"checkpoint {ckpt.directory} {e}") from None

    try:
        step, cfg, params, _ = ckpt.restore_readable(
            lambda saved: abstract_model(saved)[1], step=step, params_only=True, item=item
        )
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {ckpt.directory}")
        controller = ckpt.controller_state(step)
    finally:
        ckpt.manager.close()
    which = weights_used(cfg, weights)
    if not _all_finite(params):
        raise CheckpointError(f"checkpoint step {step} in {ckpt.directory} holds NaN/Inf parameters")
    what = (
        f"the EMA of the weights (train.ema_decay={cfg.train.ema_decay:g})" if which == "ema" else "the trained weights"
    )
    log.info("using %s of checkpoint step %d", what, step)
    graphdef, _ = abstract_model(cfg)
    return cfg, graphdef, params, controller, step
