"""Metrics to a JSONL file (one record per logged step) and TensorBoard (tensorboardX).

On resume the log is first cut back to the restored step: a run killed after its last checkpoint
(kill -9, a crash) may have logged steps that the resumed run trains again, and a record torn by
the kill is not valid JSON. So the file always holds each step once, in order.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import numpy as np

log = logging.getLogger("dsv_jax")


def _plain(v: Any):
    if isinstance(v, (np.generic, np.ndarray)) and np.ndim(v) == 0:
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


def _parse(lines) -> tuple[list[dict[str, Any]], int]:
    """(records, lines that are not a JSON record): a line torn by a kill is dropped, not fatal."""
    records, bad = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            bad += 1
    return records, bad


def cut_metrics(path: str, step: int | None) -> list[dict[str, Any]]:
    """Rewrite the JSONL at `path` keeping only records up to `step` (None: none) and return them."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        records, torn = _parse(f)
    kept = [r for r in records if step is not None and r.get("step", 0) <= step]
    if len(kept) != len(records) or torn:
        log.info(
            "metrics.jsonl: kept %d records up to step %s, dropped %d after it%s",
            len(kept),
            step,
            len(records) - len(kept),
            f" and {torn} torn line(s)" if torn else "",
        )
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, path)
    return kept


class MetricsWriter:
    def __init__(self, workdir: str, *, enabled: bool = True, resume_step: int | None = None):
        """`resume_step`: the step the run restored (None: a fresh start, which drops an old log)."""
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        self.history: list[dict[str, Any]] = []  # the records kept from earlier runs
        if enabled:
            from tensorboardX import SummaryWriter

            self.history = cut_metrics(self.path, resume_step)
            # TensorBoard hides earlier runs' events from this step on (the same cut)
            purge = 0 if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=purge)
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
        """Idempotent; a failing flush (a full disk) is logged: the run's own error says it already."""
        if self.enabled and not self._file.closed:
            for close in (self._file.close, self._tb.close):
                try:
                    close()
                except OSError as e:
                    log.debug("closing the metrics writers: %s", e)


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        return _parse(f)[0]
