"""Metrics to a JSONL file (one record per logged step) and TensorBoard (tensorboardX)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


def _plain(v: Any):
    if isinstance(v, (np.generic, np.ndarray)) and np.ndim(v) == 0:
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


class MetricsWriter:
    def __init__(self, workdir: str, *, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if enabled:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
            self._file = open(self.path, "a", encoding="utf-8")

    def write(self, step: int, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in record.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tb.close()


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    path = os.path.join(workdir, "metrics.jsonl")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
