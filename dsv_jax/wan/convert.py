"""Wan weights in and out: `dsv-jax import-weights` and the diffusers export.

    dsv-jax import-weights --from Wan2.1-T2V-1.3B-Diffusers/transformer --out models/wan-1.3b
    dsv-jax export --workdir runs/wan-dsv --out wan-diffusers --format diffusers

Import reads a Wan checkpoint folder (dsv_jax.wan.files: diffusers' or the original layout, checked whole
before a tensor is read) shard by shard, each tensor straight into its place in our preallocated parameters
(dsv_jax.wan.layout), and writes an export folder (dsv_jax.export.write_export) that `dsv_jax.load_model`
loads and `dsv-jax train --init-from` starts from. Host memory: the output parameters plus one tensor of the
input and the shard being read (mapped, not copied) (experiments/results/RESULTS.md, "Wan 2.1").

Export writes diffusers' layout, loadable by `WanTransformer3DModel.from_pretrained`: config.json and the
weights in shards of at most `max_shard_bytes` with their index. DSV's predictors have no place in Wan's
model and are left out.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np

from dsv_jax.config import Config
from dsv_jax.export import DTYPES, _check_out, plan_summary, staged_folder, write_export
from dsv_jax.wan.files import WanCheckpointError, open_checkpoint
from dsv_jax.wan.layout import expected_shapes, tensor_places, to_wan
from dsv_jax.wan.layout import place_tensor as _place

log = logging.getLogger(__name__)

WEIGHTS_NAME = "diffusion_pytorch_model"
WAN_OPTIONS = {"arch": "dit", "adaln": "single", "final_modulation": "timestep", "cross_norm": "affine"}


def _numpy_dtype(dtype: str):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if DTYPES[dtype] == "bfloat16" else np.dtype(np.float32)


def _abstract_params(cfg: Config) -> dict:
    """Shapes of the parameters of the model `cfg` builds, as a nested dict of ShapeDtypeStruct."""
    from flax import nnx

    from dsv_jax.train.step import abstract_model

    _, abstract = abstract_model(cfg)
    return nnx.to_pure_dict(abstract)


def import_weights(src: str, out: str, *, dtype: str = "bf16", overwrite: bool = False) -> str:
    """Import the Wan 2.1 transformer in folder `src` into an export folder `out` (parameters in `dtype`)."""
    import jax
    from safetensors import safe_open

    from dsv_jax.model.size import parameter_count

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of bf16, fp32")
    ckpt = open_checkpoint(src)
    _check_out(out, overwrite, reads=(src, ckpt.folder))
    cfg = ckpt.config
    target = _numpy_dtype(dtype)
    params = jax.tree.map(lambda a: np.empty(a.shape, target), _abstract_params(cfg))
    where = tensor_places(cfg.model)
    from_file = {stored: name for name, stored in ckpt.names.items()}
    filled = 0
    for shard in ckpt.shards:
        with safe_open(shard.path, framework="np") as f:
            for stored in f.keys():
                _place(params["dit"], from_file[stored], f.get_tensor(stored), where)
                filled += 1
        log.info("read %s", shard.path)
    assert filled == len(where), (filled, len(where))
    # On the host CPU device the arrays alias the numpy buffers (no copy), and orbax then writes from them
    # without a second numpy copy of its own: 1.3B in bf16, peak RSS 5.0 GiB this way, 7.5 GiB from numpy
    # leaves (experiments/results/wan_import_memory.json)
    cpu = jax.devices("cpu")[0]
    params = jax.tree.map(lambda a: jax.device_put(a, cpu), params)
    meta = {
        "step": 0,
        "dtype": DTYPES[dtype],
        "parameters": parameter_count(cfg),
        "source": os.path.abspath(ckpt.folder),
        "imported": {"from": "wan", "layout": ckpt.layout, "bytes": ckpt.total_bytes},
        "text_encoder": None,
        "weights": "raw",
        "attention": plan_summary(cfg, None),
    }
    write_export(out, cfg, params, meta)
    log.info("imported %s (%s layout, %d parameters) to %s", ckpt.folder, ckpt.layout, meta["parameters"], out)
    return out


def check_wan(cfg: Config, where: str) -> None:
    """A one-line error unless `cfg` builds Wan's architecture (the options the wan2.1-* presets set)."""
    m = cfg.model
    wrong = [f"model.{k}={getattr(m, k)}" for k, v in WAN_OPTIONS.items() if getattr(m, k) != v]
    if m.qk_norm_scope != "all_heads" or not m.qk_norm:
        wrong.append(f"model.qk_norm_scope={m.qk_norm_scope}")
    if cfg.text.encoder != "precomputed":
        wrong.append(f"text.encoder={cfg.text.encoder}")
    if wrong:
        raise ValueError(f"{where} is not a Wan-architecture model ({', '.join(wrong)}): nothing to export as Wan")


def diffusers_config(cfg: Config) -> dict:
    """config.json of diffusers' WanTransformer3DModel for our Wan-configured model."""
    m = cfg.model
    return {
        "_class_name": "WanTransformer3DModel",
        "patch_size": list(m.patch),
        "num_attention_heads": m.heads,
        "attention_head_dim": m.head_dim,
        "in_channels": m.in_channels,
        "out_channels": m.in_channels,
        "text_dim": m.text_dim,
        "freq_dim": 256,
        "ffn_dim": m.mlp_hidden,
        "num_layers": m.depth,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "image_dim": None,
        "added_kv_proj_dim": None,
        "rope_max_seq_len": 1024,
        "pos_embed_seq_len": None,
    }


def shard_plan(cfg: Config, itemsize: int, max_shard_bytes: int) -> list[list[str]]:
    """Diffusers' tensor names grouped into shards of at most `max_shard_bytes` (a larger tensor alone)."""
    shards, size = [[]], 0
    for name, shape in expected_shapes(cfg.model).items():
        nbytes = int(np.prod(shape)) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def export_diffusers(
    path: str, out: str, *, dtype: str = "bf16", overwrite: bool = False, max_shard_bytes: int = 5 * 2**30, **load
) -> str:
    """Write the model at `path` (an export, or a training workdir with `load`: step, weights) in diffusers'
    Wan layout to `out`."""
    import jax
    from flax import nnx
    from safetensors.numpy import save_file

    from dsv_jax.export import load_model

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of bf16, fp32")
    _check_out(out, overwrite, reads=(path,))
    loaded = load_model(path, **load)
    cfg = loaded.config
    check_wan(cfg, path)
    target = _numpy_dtype(dtype)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(loaded.model.dit, nnx.Param)))
    if cfg.predictor_rank:
        log.info("leaving out the DSV predictors (Wan's model has no place for them)")
    tensors = dict(to_wan(params, cfg.model))
    shards = shard_plan(cfg, target.itemsize, max_shard_bytes)
    with staged_folder(out) as staging:
        weight_map, total = {}, 0
        for k, names in enumerate(shards):
            fname = (
                f"{WEIGHTS_NAME}.safetensors"
                if len(shards) == 1
                else f"{WEIGHTS_NAME}-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            )
            part = {n: tensors.pop(n).astype(target) for n in names}
            total += sum(t.nbytes for t in part.values())
            save_file(part, os.path.join(staging, fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, fname))
        if len(shards) > 1:
            with open(os.path.join(staging, f"{WEIGHTS_NAME}.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(diffusers_config(cfg), f, indent=1)
    log.info("wrote %s in diffusers' Wan layout (%d shards) to %s", path, len(shards), out)
    return out


__all__ = ["WanCheckpointError", "export_diffusers", "import_weights"]
