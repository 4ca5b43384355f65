"""`train.init_from` (`dsv-jax train --init-from DIR`): a new run's model weights from an export folder
(`dsv-jax export`, `dsv-jax import-weights`).

    check_init_from(cfg, path)                 # before anything is written: one line naming what differs
    state = load_init_weights(state, path, sharding)   # a fresh train state with the export's weights

The export's model must be the run's: equal model and text sections, but for the fields that change how the
model runs and not its weights (config.RUNTIME_FIELDS, and model.tile: the token layout of attention's
tiles, which only a run's DSV controller state depends on, and a new run starts a fresh one). DSV's
predictors are outside that check: a run with attention=dsv takes them from the export where it has them at
the run's rank (a DSV run's export: they were trained on these weights), else starts them fresh (an import,
a dense run's export). The rest of the run starts afresh: optimizer moments, step, rng, the DSV controller,
and the EMA of the weights (a copy of the loaded weights). A workdir holding a checkpoint resumes it instead
(the Trainer decides, `has_checkpoints`).
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict

from dsv_jax.config import Config, ConfigError, architecture_diff
from dsv_jax.export import export_config
from dsv_jax.train.checkpoint import steps_on_disk
from dsv_jax.train.orbax_quirks import late_reads_dropped
from dsv_jax.train.step import abstract_model

log = logging.getLogger("dsv_jax")

# what a new run may set apart from the export it starts from (beyond config.RUNTIME_FIELDS)
FREE_FIELDS = frozenset({"model.tile"})


def has_checkpoints(directory: str) -> bool:
    """Whether a run's checkpoints/ folder holds a saved step (`steps_on_disk`); nothing is made."""
    return bool(steps_on_disk(directory))


def init_config(path: str) -> Config:
    """The config of the export at `path`; a folder that is none stops in one line naming --init-from."""
    try:
        return export_config(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--init-from {path}: {e}") from None


def check_init_from(cfg: Config, path: str) -> Config:
    """The export's config, or a one-line ConfigError naming the first model or text field in which it differs
    from the run's, with both values."""
    saved = init_config(path)
    for key, ours, theirs in architecture_diff(cfg, saved):
        # precomputed text embeddings: their length is the data's, no weight depends on it
        free = key == "text.max_len" and cfg.text.encoder == saved.text.encoder == "precomputed"
        if key.startswith(("model.", "text.")) and key not in FREE_FIELDS and not free:
            raise ConfigError(
                f"--init-from {path}: the run has {key}={ours!r}, the export {key}={theirs!r} ({path}/config.json); "
                f"a run starts from weights of its own model: without --config it takes the export's"
            )
    return saved


def load_init_weights(state, path: str, sharding):
    """`state` (a fresh train state) with the parameters of the export at `path`, read straight into the run's
    shardings and dtype (float32 master weights from a bf16 export too), and its EMA a copy of them."""
    import orbax.checkpoint as ocp

    run = flatten_dict(nnx.to_pure_dict(state.params))
    saved = flatten_dict(nnx.to_pure_dict(abstract_model(export_config(path))[1]))
    # every saved array is read (orbax restores whole trees); one the run has no place for (a predictor of
    # another rank, or of a DSV export into a dense run) is read onto one device and dropped
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = {
        k: jax.ShapeDtypeStruct(run[k].shape, run[k].dtype, sharding=run[k].sharding)
        if k in run and run[k].shape == a.shape
        else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device)
        for k, a in saved.items()
    }
    with ocp.StandardCheckpointer() as ckpt, late_reads_dropped():  # a failing array leaves reads in flight
        restored = flatten_dict(ckpt.restore(os.path.join(os.path.abspath(path), "params"), unflatten_dict(target)))
    taken = {k for k in run if k in restored and restored[k].shape == run[k].shape}
    params = jax.tree.map(lambda x: x, state.params)  # a new State: the fresh one's arrays where nothing is taken
    nnx.replace_by_pure_dict(params, unflatten_dict({k: restored[k] if k in taken else v for k, v in run.items()}))
    missing = [k for k in run if k not in taken]
    if any(not _is_predictor(k) for k in missing):  # check_init_from compared the configs: never expected
        raise ValueError(f"--init-from {path}: the export has no parameters for {', '.join(map(str, missing))}")
    if any(_is_predictor(k) for k in run):
        log.info("DSV predictors: %s", "fresh (the export has none at this rank)" if missing else "the export's")
    log.info("initialised the model from %s (%d parameter arrays)", path, len(taken))
    ema = None
    if state.ema is not None:  # a copy, not the same buffers: the step donates both
        ema = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=sharding.params)(params)
    return state.replace(params=params, ema=ema)


def _is_predictor(key: tuple) -> bool:
    return "predictor" in key
