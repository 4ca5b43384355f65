"""Export a trained model (parameters only) and load it back for inference.

    dsv-jax export --workdir runs/tiny --out models/tiny [--dtype bf16|fp32] [--checkpoint STEP]

    loaded = dsv_jax.load_model("models/tiny")                 # or a training workdir: its newest checkpoint
    frames = dsv_jax.generate(loaded, ["a red circle moving left"])   # uint8 [N, T, H, W, 3]
    text, text_mask = loaded.encode_text(["a red circle moving left"])
    velocity = loaded(latents, 0.5, text, text_mask)           # with the run's trained attention plans
    loaded.model, loaded.config, loaded.dsv_state, loaded.attention_for((8, 32, 48))

An export directory holds

    params/       the model's parameters (orbax, a plain nested dict of arrays; no optimizer state)
    config.json   the run's resolved config (loadable by `--config`, too)
    dsv.json      the DSV controller state (stage, per-shape sparsity and sparse decisions), DSV runs only
    export.json   format, step, dtype, parameter count, source workdir, the weights ("ema": the EMA of
                  the weights, written where the run kept one; "raw": the trained weights), the dataset's
                  text encoder hook, and per bucket the attention each block runs (dense, or sparse with
                  its keep ceiling)

It is written into a temporary folder beside --out and renamed when complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any

log = logging.getLogger(__name__)

FORMAT = "dsv-jax-export/1"
EXPORT_JSON = "export.json"
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "bfloat16": "bfloat16", "float32": "float32"}


def is_export(path: str) -> bool:
    return os.path.isfile(os.path.join(path, EXPORT_JSON))


def _check_out(out: str, overwrite: bool, reads: tuple[str, ...] = ()) -> None:
    """--out can be written: not a file, empty unless `overwrite`, and (it is replaced whole) neither one of
    the folders `reads` that the command reads nor a folder holding one."""
    target = os.path.realpath(out)
    for source in reads:
        where = os.path.realpath(source)
        if where == target or where.startswith(target + os.sep):
            raise FileExistsError(
                f"--out {out!r} is or holds {source!r}, which this command reads; writing --out would replace it: "
                "choose another --out"
            )
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"--out {out!r} is a file")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise FileExistsError(f"--out {out!r} is not empty; pass --overwrite to replace it")


def text_encoder_hint(cfg) -> str | None:
    """The text encoder hook (pkg.module:make) a precomputed-embedding dataset was prepared with, or None."""
    if cfg.text.encoder != "precomputed" or not cfg.data.path:
        return None
    try:
        with open(os.path.join(cfg.data.path, "manifest.json")) as f:
            return json.load(f).get("text", {}).get("encoder")
    except (OSError, ValueError, AttributeError):  # the dataset may be gone: the hint is optional
        return None


def plan_summary(cfg, controller_state: dict | None) -> dict[str, list[str]]:
    """Per bucket shape, what each block's video attention runs at inference."""
    from dsv_jax.dsv.plan import AttentionPlan
    from dsv_jax.dsv.policy import make_policy

    out = {}
    for shape in cfg.data.buckets:
        plans = make_policy(cfg, controller_state).plans(tuple(shape), train=False)
        plans = list(plans) if isinstance(plans, (list, tuple)) else [plans] * cfg.model.depth
        out["x".join(map(str, shape))] = [p.describe() if isinstance(p, AttentionPlan) else "dense" for p in plans]
    return out


def export(
    workdir: str,
    out: str,
    *,
    dtype: str = "bf16",
    step: int | None = None,
    overwrite: bool = False,
    weights: str = "auto",
) -> str:
    """Write the parameters (cast to `dtype`), config and DSV state of a training workdir's latest (or
    `step`) checkpoint to `out`. Returns `out`. `weights`: see `load_trained` (default: the EMA of the
    weights where the run kept one); export.json names the weights written."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv_jax.model.flops import parameter_count
    from dsv_jax.train.checkpoint import WEIGHTS, load_trained, weights_used

    if weights not in WEIGHTS:
        raise ValueError(f"--weights {weights!r} is not one of {', '.join(WEIGHTS)}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of bf16, fp32")
    _check_out(out, overwrite, reads=(workdir,))
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise FileNotFoundError(f"--workdir {workdir!r} has no checkpoints/ (is it a training workdir?)")
    cfg, _, params, controller, step = load_trained(workdir, step, weights)
    target = jnp.dtype(DTYPES[dtype])
    pure = jax.tree.map(
        lambda a: a.astype(target) if jnp.issubdtype(a.dtype, jnp.floating) else a, nnx.to_pure_dict(params)
    )
    meta = {
        "step": int(step),
        "dtype": DTYPES[dtype],
        "parameters": parameter_count(cfg),
        "source": os.path.abspath(workdir),
        "text_encoder": text_encoder_hint(cfg),
        "weights": weights_used(cfg, weights),
        "attention": plan_summary(cfg, controller),
    }
    write_export(out, cfg, pure, meta, controller)
    log.info("exported step %d of %s (%d parameters, %s) to %s", step, workdir, meta["parameters"], DTYPES[dtype], out)
    return out


@contextlib.contextmanager
def staged_folder(out: str):
    """A temporary folder beside `out` to write into, which replaces `out` when the block completes; a failure
    removes it and leaves `out` as it was (every writer of an output folder: exports, diffusers' layout)."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.partial-", dir=parent)
    try:
        yield staging
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_export(out: str, cfg, params: dict, meta: dict, controller: dict | None = None) -> None:
    """Write an export folder: `params` (a nested dict of arrays), the config, the DSV controller state and
    export.json (`meta`), into a temporary folder beside `out` renamed when complete (a failure leaves `out`
    as it was). The one writer of the format: `export` and `dsv-jax import-weights` call it."""
    import orbax.checkpoint as ocp

    with staged_folder(out) as staging:
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(os.path.join(staging, "params"), params)
            ckpt.wait_until_finished()
        with open(os.path.join(staging, "config.json"), "w") as f:
            f.write(cfg.to_json())
        if controller is not None:
            with open(os.path.join(staging, "dsv.json"), "w") as f:
                json.dump(controller, f)
        with open(os.path.join(staging, EXPORT_JSON), "w") as f:
            json.dump({"format": FORMAT, **meta}, f, indent=1)


@dataclasses.dataclass
class LoadedModel:
    """A trained model for inference: `model` is the Flax NNX TextToVideo (VideoDiT + the built-in text
    encoder when the run had one). Calling the LoadedModel runs it with the run's trained attention
    plans for the latents' shape (DSV stage-2 sparsity, window plans, or the dense backend)."""

    model: Any
    config: Any
    step: int
    dsv_state: dict | None = None
    info: dict = dataclasses.field(default_factory=dict)  # export.json

    def attention_for(self, shape) -> tuple[Any, Any]:
        """(attention, attention_inputs) of inference on latent `shape` (T, H, W)."""
        from dsv_jax.dsv.policy import make_policy

        policy = make_policy(self.config, self.dsv_state)
        return policy.plans(tuple(shape), train=False), policy.inputs(tuple(shape), train=False)

    def __call__(self, latents, timesteps, text, text_mask, *, time_scale: float = 1000.0):
        """The velocity of latents [B, T, H, W, C] at timesteps in [0, 1] (`time_scale` 1: in [0, 1000])."""
        attention, inputs = self.attention_for(latents.shape[1:4])
        return self.model(
            latents, timesteps, text, text_mask, attention=attention, attention_inputs=inputs, time_scale=time_scale
        )

    def encode_text(self, batch) -> tuple[Any, Any]:
        """(embeddings [B, L, D], mask [B, L]) of captions (a list of strings, tokenized with the run's text
        config: text.max_len, text.hash_buckets; or, for a model of precomputed embeddings whose data was
        prepared with umt5:DIR, encoded by that umT5) or of a batch: {"text_ids", "text_mask"} for the
        built-in encoder (dsv_jax.data.text.tokenize_batch), {"text_emb", "text_mask"} for precomputed ones."""
        if isinstance(batch, (str, list, tuple)):
            from dsv_jax.data.codec import get_text_encoder, is_builtin_text_encoder
            from dsv_jax.data.text import tokenize_batch

            hint = (self.info or {}).get("text_encoder")
            if self.config.text.encoder != "builtin" and is_builtin_text_encoder(hint):
                emb, mask = get_text_encoder(hint)([batch] if isinstance(batch, str) else list(batch))
                return self.model.encode_text({"text_emb": emb, "text_mask": mask})
            if self.config.text.encoder != "builtin":
                raise ValueError(
                    "this model takes precomputed text embeddings (text.encoder=precomputed): encode the "
                    "captions with the hook its data was prepared with and pass {'text_emb', 'text_mask'}"
                )
            captions = [batch] if isinstance(batch, str) else list(batch)
            ids, mask = tokenize_batch(captions, self.config.text.max_len, self.config.text.hash_buckets)
            batch = {"text_ids": ids, "text_mask": mask}
        return self.model.encode_text(batch)


def _read_export(path: str) -> dict:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is not a directory")
    if not is_export(path):
        raise FileNotFoundError(
            f"{path!r} holds no {EXPORT_JSON}: export a training workdir with "
            f"`dsv-jax export --workdir RUN --out {path}`"
        )
    with open(os.path.join(path, EXPORT_JSON)) as f:
        info = json.load(f)
    if info.get("format") != FORMAT:
        raise ValueError(f"{os.path.join(path, EXPORT_JSON)} has format {info.get('format')!r}, expected {FORMAT!r}")
    return info


def export_config(path: str):
    """The config an export folder's model was built with (its config.json), after checking the folder is one."""
    from dsv_jax.config import Config

    _read_export(path)
    with open(os.path.join(path, "config.json")) as f:
        return Config.from_dict(json.load(f))


def load_params(path: str, dtype: str | None = None):
    """(config, graphdef, params nnx.State, DSV controller state or None, export.json) of an export,
    the parameters on the default device in `dtype` (default: as exported)."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from flax import nnx

    from dsv_jax.config import Config
    from dsv_jax.train.step import abstract_model

    info = _read_export(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = Config.from_dict(json.load(f))
    controller = None
    if os.path.exists(os.path.join(path, "dsv.json")):
        with open(os.path.join(path, "dsv.json")) as f:
            controller = json.load(f)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of bf16, fp32")
    target = jnp.dtype(DTYPES[dtype or info["dtype"]])
    graphdef, abstract = abstract_model(cfg)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pure = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            a.shape, target if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype, sharding=device
        ),
        nnx.to_pure_dict(abstract),
    )
    from dsv_jax.train.orbax_quirks import late_reads_dropped

    # an array that fails to read leaves the others' reads in flight (see late_reads_dropped)
    with ocp.StandardCheckpointer() as ckpt, late_reads_dropped():
        restored = ckpt.restore(os.path.join(os.path.abspath(path), "params"), pure)
    nnx.replace_by_pure_dict(abstract, restored)
    return cfg, graphdef, abstract, controller, info


def load_model(path: str, dtype: str | None = None, *, step: int | None = None, weights: str = "auto") -> LoadedModel:
    """A trained model, ready to call: an export (`dsv-jax export`) or a training workdir (its newest
    readable checkpoint, or `step`; `weights`: see `load_trained`, default the EMA of the weights where the
    run kept one). `dtype` ("bf16" | "fp32") casts the parameters (default: as saved). See `LoadedModel`;
    `dsv_jax.generate(model, prompts)` samples videos from it. Reads only: nothing is written to `path`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of bf16, fp32")
    if is_export(path):
        _check_export_arguments(path, step, weights)
        cfg, graphdef, params, controller, info = load_params(path, dtype)
    else:
        from dsv_jax.train.checkpoint import weights_used

        cfg, graphdef, params, controller, step = _load_trained(path, step, weights)
        if dtype is not None:
            target = jnp.dtype(DTYPES[dtype])
            params = jax.tree.map(lambda a: a.astype(target) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
        info = {
            "step": int(step),
            "source": os.path.abspath(path),
            "text_encoder": text_encoder_hint(cfg),
            "weights": weights_used(cfg, weights),
        }
    return LoadedModel(
        model=nnx.merge(graphdef, params), config=cfg, step=int(info["step"]), dsv_state=controller, info=info
    )


def _check_export_arguments(path: str, step: int | None, weights: str) -> None:
    """An export holds one step's one set of weights: --checkpoint and --weights pick those of a workdir."""
    if step is not None:
        raise ValueError(
            f"--checkpoint {step}: {path!r} is an export (of one step); --checkpoint picks a "
            "checkpoint of a training workdir"
        )
    if weights != "auto":
        raise ValueError(
            f"--weights {weights}: {path!r} is an export (of one set of weights); --weights "
            "picks the weights of a training workdir's checkpoint"
        )


def _load_trained(path: str, step: int | None, weights: str):
    from dsv_jax.train.checkpoint import load_trained

    if not os.path.isdir(os.path.join(path, "checkpoints")):  # checked first: orbax would create the folder
        raise FileNotFoundError(
            f"{path!r} is neither an exported model (no {EXPORT_JSON}) nor a training workdir (no checkpoints/)"
        )
    return load_trained(path, step, weights)


def load_for_sampling(path: str, step: int | None = None, weights: str = "auto"):
    """(config, graphdef, params, DSV controller state, text encoder hint) of an export or a training
    workdir (its latest or `step` checkpoint; `weights` as `load_trained`'s): what the sampler needs."""
    if is_export(path):
        _check_export_arguments(path, step, weights)
        cfg, graphdef, params, controller, info = load_params(path)
        return cfg, graphdef, params, controller, info.get("text_encoder")
    cfg, graphdef, params, controller, _ = _load_trained(path, step, weights)
    return cfg, graphdef, params, controller, text_encoder_hint(cfg)
