"""The manifest of a prepared dataset (`manifest.json` beside its ArrayRecord shards).

Each shard holds samples of one bucket, so the bucket of every record is known without reading it:

    {"format": "dsv-jax-dataset/1", "codec": "pixel:1x2x2", "channels": 12,
     "text": {"kind": "caption"}  or  {"kind": "embedding", "max_len": L, "dim": D, "encoder": "..."},
     "buckets": [{"shape": [T, H, W], "pixel_shape": [F, PH, PW], "count": n, "eval_count": m}, ...],
     "shards":  [{"file": "b00-00000.array_record", "bucket": 0, "count": n}, ...],
     "records": N, "failed": [{"file": ..., "error": ...}], "skipped": [{"file": ..., "reason": ...}],
     "eval_shards": [{"file": "e00-00000.array_record", "bucket": 0, "count": m}, ...], "eval_records": M,
     "eval_fraction": F}

Shapes are latent (T, H, W); pixel_shape is what the codec read from the files. `shards`, `records`
and `count` are the training split; a dataset prepared with --eval-fraction also has a held-out split
(`eval_shards`, whole files kept apart from training), which readers of the first version of the
format, knowing only `shards`, never train on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from dsv_jax.config import Config

FORMAT = "dsv-jax-dataset/1"
MANIFEST = "manifest.json"


@dataclass
class Manifest:
    directory: str
    codec: str
    channels: int
    text: dict[str, Any]
    buckets: list[dict[str, Any]]
    shards: list[dict[str, Any]]
    failed: list[dict[str, str]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    eval_shards: list[dict[str, Any]] = field(default_factory=list)  # the held-out split (may be empty)

    @property
    def records(self) -> int:
        return sum(s["count"] for s in self.shards)

    @property
    def eval_records(self) -> int:
        return sum(s["count"] for s in self.eval_shards)

    @property
    def has_eval(self) -> bool:
        """Whether the dataset has a held-out split (prepare-data --eval-fraction)."""
        return self.eval_records > 0

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """Latent shapes of the buckets that hold at least one training sample."""
        return [tuple(b["shape"]) for b in self.buckets if b["count"] > 0]

    @property
    def eval_shapes(self) -> list[tuple[int, int, int]]:
        """Latent shapes of the training buckets that also hold held-out samples."""
        return [tuple(b["shape"]) for b in self.buckets if b["count"] > 0 and b.get("eval_count", 0) > 0]

    def _split(self, split: str) -> list[dict[str, Any]]:
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r} is not 'train' or 'eval'")
        return self.shards if split == "train" else self.eval_shards

    def shard_paths(self, split: str = "train") -> list[str]:
        return [os.path.join(self.directory, s["file"]) for s in self._split(split)]

    def record_buckets(self, split: str = "train") -> np.ndarray:
        """int32 [records]: the bucket index of each record of a split, in the order of shard_paths(split)."""
        shards = self._split(split)
        return (
            np.concatenate([np.full(s["count"], s["bucket"], np.int32) for s in shards])
            if shards
            else np.zeros(0, np.int32)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "codec": self.codec,
            "channels": self.channels,
            "text": self.text,
            "buckets": self.buckets,
            "shards": self.shards,
            "records": self.records,
            "failed": self.failed,
            "skipped": self.skipped,
            "eval_shards": self.eval_shards,
            "eval_records": self.eval_records,
            **self.extra,
        }

    def write(self) -> str:
        """Atomically (temp file + rename): a dataset is complete exactly when its manifest exists."""
        path = os.path.join(self.directory, MANIFEST)
        with open(path + ".tmp", "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(path + ".tmp", path)
        return path

    @classmethod
    def load(cls, directory: str) -> "Manifest":
        path = os.path.join(directory, MANIFEST)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"data.path {directory!r} is not a directory")
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{directory!r} has no {MANIFEST}: prepare it with `dsv-jax prepare-data "
                f"--input VIDEOS --output {directory}`"
            )
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if d.get("format") != FORMAT:
            raise ValueError(f"{path} has format {d.get('format')!r}, expected {FORMAT!r}")
        known = {
            "format",
            "codec",
            "channels",
            "text",
            "buckets",
            "shards",
            "records",
            "failed",
            "skipped",
            "eval_shards",
            "eval_records",
        }
        m = cls(
            directory=os.path.abspath(directory),
            codec=d["codec"],
            channels=int(d["channels"]),
            text=d["text"],
            buckets=d["buckets"],
            shards=d["shards"],
            failed=d.get("failed", []),
            skipped=d.get("skipped", []),
            extra={k: v for k, v in d.items() if k not in known},
            eval_shards=d.get("eval_shards", []),
        )
        missing = [p for p in m.shard_paths() + m.shard_paths("eval") if not os.path.exists(p)]
        if missing:
            raise FileNotFoundError(f"{path} lists {len(missing)} shard(s) that do not exist, e.g. {missing[0]!r}")
        if m.records == 0:
            raise ValueError(f"the dataset at {directory!r} holds no samples")
        return m


def check_dataset(cfg: Config, manifest: Manifest) -> None:
    """Everything about the dataset that must agree with the config, checked before any compile."""
    where = f"the dataset at {manifest.directory!r}"
    if manifest.channels != cfg.model.in_channels:
        raise ValueError(
            f"{where} has {manifest.channels} latent channels (codec {manifest.codec!r}) but "
            f"model.in_channels={cfg.model.in_channels}: add model.in_channels={manifest.channels}"
        )
    for shape in manifest.shapes:
        if any(s % p for s, p in zip(shape, cfg.model.patch)):
            raise ValueError(f"{where}: bucket {shape} is not divisible by model.patch {cfg.model.patch}")
    kind = manifest.text.get("kind")
    if kind == "caption" and cfg.text.encoder != "builtin":
        raise ValueError(
            f"{where} stores captions, not embeddings: use text.encoder=builtin, or prepare it with --text-encoder"
        )
    if kind == "embedding":
        if cfg.text.encoder != "precomputed":
            raise ValueError(
                f"{where} stores text embeddings ({manifest.text.get('encoder')}): use text.encoder=precomputed"
            )
        if (manifest.text["max_len"], manifest.text["dim"]) != (cfg.text.max_len, cfg.model.text_dim):
            raise ValueError(
                f"{where} stores text embeddings of {manifest.text['max_len']} x "
                f"{manifest.text['dim']}, the config expects text.max_len={cfg.text.max_len} x "
                f"model.text_dim={cfg.model.text_dim}"
            )
