"""The one checkpoint module: orbax CheckpointManager over {state, data, config}.

    state   TrainState (params, optimizer, step, rng, skipped), sharded arrays
    data    the data iterator's state (JSON), so a resumed run reads the identical batch sequence
    config  the run's config (JSON), checked against the resuming config before any array is read
    dsv     the DSV controller's state (JSON: stage, per-shape sparsity and decisions), in DSV runs

Saves are asynchronous; a NaN/Inf parameter is never written over a good checkpoint.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from dsv_jax.config import Config, architecture_diff

log = logging.getLogger(__name__)


class IncompatibleCheckpoint(ValueError):
    pass


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, data_state: dict, cfg: Config, controller_state: dict | None = None) -> bool:
        if not _all_finite(state.params):
            log.error("not saving step %d: parameters hold NaN/Inf; the last good checkpoint is kept", step)
            return False
        items = dict(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                     config=ocp.args.JsonSave(cfg.to_dict()))
        if controller_state is not None:
            items["dsv"] = ocp.args.JsonSave(controller_state)
        return self.manager.save(step, force=True, args=ocp.args.Composite(**items))

    def controller_state(self, step: int) -> dict | None:
        """The DSV controller state saved at `step`, or None (not a DSV run)."""
        if not os.path.isdir(os.path.join(self.directory, str(step), "dsv")):
            return None
        return self.manager.restore(step, args=ocp.args.Composite(dsv=ocp.args.JsonRestore()))["dsv"]

    def saved_config(self, step: int) -> dict[str, Any]:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def check_compatible(self, step: int, cfg: Config) -> None:
        saved = Config.from_dict(self.saved_config(step))
        diffs = architecture_diff(saved, cfg)
        if diffs:
            lines = "\n".join(f"  {k}: checkpoint {a!r} != requested {b!r}" for k, a, b in diffs)
            raise IncompatibleCheckpoint(
                f"the checkpoint at {self.directory} (step {step}) was trained with a different model:\n{lines}\n"
                "use another --workdir, or the checkpoint's settings")

    def restore(self, step: int, abstract_state) -> tuple[Any, dict]:
        """Restore into `abstract_state` (ShapeDtypeStructs with shardings): any device count works."""
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return out["state"], out["data"]

    def restore_params(self, step: int, abstract_params) -> Any:
        """Only the parameters of the train state saved at `step` (no optimizer moments), into
        `abstract_params` (the model's nnx.State of ShapeDtypeStructs, with shardings or without: then
        on the default device)."""
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        item = {"params": abstract_params}
        restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=getattr(a, "sharding", None) or device),
                                    item)
        with ocp.PyTreeCheckpointer() as reader:  # the state item alone, read partially
            out = reader.restore(os.path.join(self.directory, str(step), "state"),
                                 args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True))
        return out["params"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _all_finite(tree) -> bool:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return bool(jnp.all(jnp.stack(leaves))) if leaves else True


def load_trained(workdir: str, step: int | None = None):
    """(config, graphdef, params, DSV controller state or None, step) of a training workdir's latest (or
    `step`) checkpoint, restored on the default device: what sampling and analysis need."""
    from dsv_jax.train.step import abstract_model

    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {ckpt.directory}")
        cfg = Config.from_dict(ckpt.saved_config(step))
        graphdef, abstract_params = abstract_model(cfg)
        params = ckpt.restore_params(step, abstract_params)
        controller = ckpt.controller_state(step)
    finally:
        ckpt.close()
    return cfg, graphdef, params, controller, step
