"""Wan checkpoint folders on disk: which layout, which config, which shards, checked before any tensor is read.

A folder holds `config.json` and the weights as one `*.safetensors` file or several with an index JSON
(`*.safetensors.index.json`: tensor name -> shard file), in diffusers' layout (`WanTransformer3DModel`)
or the original release's (`WanModel`). A diffusers pipeline folder is accepted for its `transformer/`.
Everything that can be wrong with a folder (not Wan, not text-to-video, a missing or truncated shard, a
tensor missing, unexpected or of the wrong shape) is found here from the safetensors headers alone, and
reported in one line (`WanCheckpointError`) before the import reads a tensor or writes a file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Any

from dsv_jax.config import Config, get_config
from dsv_jax.wan.layout import expected_shapes, original_name

DIFFUSERS, ORIGINAL = "diffusers", "original"
PRESETS = ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b")
DTYPES = ("F32", "F16", "BF16")


class WanCheckpointError(ValueError):
    """A Wan checkpoint folder that cannot be imported; the message names the file, tensor or field."""


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise WanCheckpointError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(value, dict):
        raise WanCheckpointError(f"{path}: expected a JSON object")
    return value


def resolve_folder(path: str) -> str:
    """The folder holding the transformer's config.json: `path`, or its `transformer/` (a pipeline)."""
    if not os.path.isdir(path):
        raise WanCheckpointError(f"--from {path!r} is not a directory")
    for folder in (path, os.path.join(path, "transformer")):
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    raise WanCheckpointError(f"{path} has no config.json (nor transformer/config.json): not a Wan checkpoint folder")


def layout_of(fields: dict, where: str) -> str:
    """ "diffusers" or "original", from a config.json's fields; an error if it describes no Wan transformer."""
    name = fields.get("_class_name")
    if name == "WanTransformer3DModel":
        return DIFFUSERS
    if name == "WanModel" or (name is None and {"dim", "num_heads", "num_layers"} <= fields.keys()):
        return ORIGINAL
    raise WanCheckpointError(
        f"{where}: _class_name={name!r} is not a Wan transformer (WanTransformer3DModel from diffusers or "
        "WanModel from the Wan release)"
    )


def _architecture(fields: dict, layout: str, where: str) -> dict[str, Any]:
    """The Wan architecture fields of a config.json under common names; errors for what we do not run."""
    if layout == DIFFUSERS:
        heads, head_dim = fields.get("num_attention_heads", 40), fields.get("attention_head_dim", 128)
        arch = {
            "hidden": heads * head_dim,
            "heads": heads,
            "depth": fields.get("num_layers", 40),
            "mlp_width": fields.get("ffn_dim", 13824),
            "in_channels": fields.get("in_channels", 16),
            "out_channels": fields.get("out_channels", 16) or fields.get("in_channels", 16),
            "text_dim": fields.get("text_dim", 4096),
            "freq_dim": fields.get("freq_dim", 256),
            "patch": tuple(fields.get("patch_size", (1, 2, 2))),
            "eps": fields.get("eps", 1e-6),
            "qk_norm": fields.get("qk_norm", "rms_norm_across_heads"),
            "cross_attn_norm": fields.get("cross_attn_norm", True),
        }
        image = [k for k in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len") if fields.get(k) is not None]
        if image:
            raise WanCheckpointError(
                f"{where}: {image[0]}={fields[image[0]]} belongs to an image-to-video Wan; only text-to-video "
                "transformers import"
            )
    else:
        model_type = fields.get("model_type", "t2v")
        if model_type != "t2v":
            raise WanCheckpointError(
                f"{where}: model_type={model_type!r}; only text-to-video Wan transformers (t2v) import"
            )
        qk_norm = fields.get("qk_norm", True)
        arch = {
            "hidden": fields.get("dim", 2048),
            "heads": fields.get("num_heads", 16),
            "depth": fields.get("num_layers", 32),
            "mlp_width": fields.get("ffn_dim", 8192),
            "in_channels": fields.get("in_dim", 16),
            "out_channels": fields.get("out_dim", 16),
            "text_dim": fields.get("text_dim", 4096),
            "freq_dim": fields.get("freq_dim", 256),
            "patch": tuple(fields.get("patch_size", (1, 2, 2))),
            "eps": fields.get("eps", 1e-6),
            "qk_norm": "rms_norm_across_heads" if qk_norm else None,
            "cross_attn_norm": fields.get("cross_attn_norm", True),
        }
        if tuple(fields.get("window_size", (-1, -1))) != (-1, -1):
            raise WanCheckpointError(f"{where}: window_size={fields['window_size']}: only global attention imports")
    checks = {  # what the Wan options of our model express; anything else would import as a different model
        "out_channels": arch["in_channels"],
        "freq_dim": 256,
        "eps": 1e-6,
        "qk_norm": "rms_norm_across_heads",
        "cross_attn_norm": True,
    }
    for key, wanted in checks.items():
        if arch[key] != wanted:
            raise WanCheckpointError(f"{where}: {key}={arch[key]!r} is not supported (dsv-jax runs {wanted!r})")
    if arch["hidden"] % arch["heads"]:
        raise WanCheckpointError(f"{where}: width {arch['hidden']} is not divisible by {arch['heads']} heads")
    return arch


def config_of(fields: dict, layout: str, where: str) -> Config:
    """Our config of the Wan transformer a config.json describes: its preset where the sizes match one,
    else the 1.3B preset with the sizes overridden."""
    arch = _architecture(fields, layout, where)
    model = {k: arch[k] for k in ("hidden", "heads", "depth", "mlp_width", "in_channels", "text_dim", "patch")}
    for name in PRESETS:
        cfg = get_config(name)
        if all(getattr(cfg.model, k) == v for k, v in model.items()):
            return cfg
    cfg = get_config(PRESETS[0])
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))


@dataclasses.dataclass(frozen=True)
class Shard:
    path: str
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name in the file -> (dtype, shape)


def read_header(path: str) -> Shard:
    """A safetensors file's tensor table, checked against the file's size (a truncated copy fails here)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise WanCheckpointError(f"{path} is truncated: {size} bytes, its header alone needs {n + 8}")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
        if isinstance(e, WanCheckpointError):
            raise
        raise WanCheckpointError(f"{path} is not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end > size:
        raise WanCheckpointError(f"{path} is truncated: {size} bytes, its tensors need {8 + n + end}")
    return Shard(path, {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()})


def shard_files(folder: str) -> list[str]:
    """The weight files of a folder: those its index names, else its single *.safetensors file."""
    indexes = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors.index.json"))
    if len(indexes) > 1:
        raise WanCheckpointError(f"{folder} holds several weight indexes ({', '.join(indexes)}); keep one")
    if indexes:
        where = os.path.join(folder, indexes[0])
        weight_map = _read_json(where).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise WanCheckpointError(f"{where}: no weight_map")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                raise WanCheckpointError(f"{where} names shard {name}, which is missing from {folder}")
        return [os.path.join(folder, name) for name in files]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if len(files) != 1:
        found = ", ".join(files) if files else "none"
        raise WanCheckpointError(f"{folder}: expected one *.safetensors file or an index JSON, found {found}")
    return [os.path.join(folder, files[0])]


@dataclasses.dataclass(frozen=True)
class WanCheckpoint:
    folder: str
    layout: str  # diffusers | original
    config: Config
    shards: list[Shard]
    names: dict[str, str]  # diffusers' name -> the name in the files

    @property
    def largest_shard_bytes(self) -> int:
        return max(os.path.getsize(s.path) for s in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(os.path.getsize(s.path) for s in self.shards)


def open_checkpoint(path: str) -> WanCheckpoint:
    """Read and check a Wan checkpoint folder (config and safetensors headers; no tensor data)."""
    folder = resolve_folder(path)
    where = os.path.join(folder, "config.json")
    fields = _read_json(where)
    layout = layout_of(fields, where)
    cfg = config_of(fields, layout, where)
    shards = [read_header(p) for p in shard_files(folder)]
    stored = {}
    for shard in shards:
        for name in shard.tensors:
            if name in stored:
                raise WanCheckpointError(f"tensor {name} is in both {stored[name]} and {shard.path}")
            stored[name] = shard.path
    expected = expected_shapes(cfg.model)
    file_name = (lambda n: n) if layout == DIFFUSERS else original_name
    names = {n: file_name(n) for n in expected}
    by_file = {v: k for k, v in names.items()}
    unexpected = sorted(set(stored) - set(by_file))
    if unexpected:
        raise WanCheckpointError(
            f"{stored[unexpected[0]]}: tensor {unexpected[0]} is not part of a Wan 2.1 text-to-video transformer "
            f"({len(unexpected)} such tensors)"
        )
    tables = {name: shard for shard in shards for name in shard.tensors}
    for ours, stored_name in names.items():
        if stored_name not in tables:
            missing = sum(n not in tables for n in names.values())
            raise WanCheckpointError(f"{folder}: tensor {stored_name} is missing ({missing} missing in all)")
        dtype, shape = tables[stored_name].tensors[stored_name]
        if shape != expected[ours]:
            raise WanCheckpointError(
                f"{tables[stored_name].path}: tensor {stored_name} has shape {list(shape)}, the config "
                f"({where}) gives {list(expected[ours])}"
            )
        if dtype not in DTYPES:
            raise WanCheckpointError(f"{tables[stored_name].path}: tensor {stored_name} has dtype {dtype}")
    return WanCheckpoint(folder, layout, cfg, shards, names)
