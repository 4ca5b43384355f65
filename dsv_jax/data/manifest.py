"""The manifest of a prepared dataset (`manifest.json` beside its ArrayRecord shards).

Each shard holds samples of one bucket, so the bucket of every record is known without reading it:

    {"format": "dsv-jax-dataset/1", "codec": "pixel:1x2x2", "channels": 12,
     "text": {"kind": "caption"}  or  {"kind": "embedding", "max_len": L, "dim": D, "encoder": "..."},
     "buckets": [{"shape": [T, H, W], "pixel_shape": [F, PH, PW], "count": n}, ...],
     "shards":  [{"file": "b00-00000.array_record", "bucket": 0, "count": n}, ...],
     "records": N, "failed": [{"file": ..., "error": ...}], "skipped": [{"file": ..., "reason": ...}]}

Shapes are latent (T, H, W); pixel_shape is what the codec read from the files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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

    @property
    def records(self) -> int:
        return sum(s["count"] for s in self.shards)

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """Latent shapes of the buckets that hold at least one sample."""
        return [tuple(b["shape"]) for b in self.buckets if b["count"] > 0]

    def shard_paths(self) -> list[str]:
        return [os.path.join(self.directory, s["file"]) for s in self.shards]

    def record_buckets(self) -> np.ndarray:
        """int32 [records]: the bucket index of each record, in the order of shard_paths()."""
        return np.concatenate([np.full(s["count"], s["bucket"], np.int32) for s in self.shards]) \
            if self.shards else np.zeros(0, np.int32)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "codec": self.codec, "channels": self.channels, "text": self.text,
                "buckets": self.buckets, "shards": self.shards, "records": self.records,
                "failed": self.failed, "skipped": self.skipped, **self.extra}

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
            raise FileNotFoundError(f"{directory!r} has no {MANIFEST}: prepare it with `dsv-jax prepare-data "
                                    f"--input VIDEOS --output {directory}`")
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if d.get("format") != FORMAT:
            raise ValueError(f"{path} has format {d.get('format')!r}, expected {FORMAT!r}")
        known = {"format", "codec", "channels", "text", "buckets", "shards", "records", "failed", "skipped"}
        m = cls(directory=os.path.abspath(directory), codec=d["codec"], channels=int(d["channels"]), text=d["text"],
                buckets=d["buckets"], shards=d["shards"], failed=d.get("failed", []), skipped=d.get("skipped", []),
                extra={k: v for k, v in d.items() if k not in known})
        missing = [p for p in m.shard_paths() if not os.path.exists(p)]
        if missing:
            raise FileNotFoundError(f"{path} lists {len(missing)} shard(s) that do not exist, e.g. {missing[0]!r}")
        if m.records == 0:
            raise ValueError(f"the dataset at {directory!r} holds no samples")
        return m
