"""How many samples of a bucket go into one step: the one batch-size rule of every feed.

A bucket is a latent shape (T, H, W) with S tokens per sample. Two rules:

    equal_tokens   B = tokens_per_batch // S                  (B x S constant: the usual baseline)
    dual           B = min(M_mem // S, M_comp // S**p)       (AdaptiveLoad's dual constraint)

The dual rule caps memory (tokens per batch, linear in S) and compute (a step costs ~ B x S**p with
p > 1 because attention is quadratic) at once: long videos get fewer samples than equal tokens would
give them, so their steps take no longer than the compute budget allows. All budgets are for the
global batch of the mesh the cost model was measured on (`dsv-jax fit-cost`). The result is then
capped at `max_batch` and rounded down to a multiple of the data-parallel size (at least one row per
device), because every device of an SPMD step holds the same number of samples.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger(__name__)

BATCHING_MODES = ("equal_tokens", "dual")


def tokens_per_sample(shape: tuple[int, int, int], patch: tuple[int, int, int]) -> int:
    """S of a bucket: the tokens of one sample of latent shape (T, H, W) in patches of `patch`."""
    return math.prod(s // p for s, p in zip(shape, patch))


def dual_constraint_batch_size(seq_len: int, m_mem: float, m_comp: float, p: float) -> int:
    """max(1, min(floor(m_mem / seq_len), floor(m_comp / seq_len**p)))."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1 (tokens per sample)")
    if not m_mem > 0:
        raise ValueError(f"m_mem={m_mem} must be > 0 (memory budget in tokens per batch)")
    if not m_comp > 0:
        raise ValueError(f"m_comp={m_comp} must be > 0 (compute budget in units of B * S**p)")
    if not p > 0:
        raise ValueError(f"p={p} must be > 0 (cost exponent of the sequence length)")
    by_memory = math.floor(m_mem / seq_len)
    by_compute = math.floor(m_comp / float(seq_len) ** p)
    return max(1, min(by_memory, by_compute))


def equal_token_batch_size(seq_len: int, tokens_per_batch: int, max_batch: int, multiple: int) -> int:
    """B x S ~ const: the baseline rule. Rounded down to a multiple of the data-parallel size."""
    b = min(max(1, tokens_per_batch // seq_len), max_batch)
    return round_to_multiple(b, multiple)


def round_to_multiple(b: int, multiple: int) -> int:
    """Round down to a multiple of `multiple`, but never below one row per data-parallel device."""
    return max(multiple, b // multiple * multiple)


@dataclass(frozen=True)
class BatchRule:
    """seq_len -> global batch size, for one of BATCHING_MODES. Build it with `batch_rule(data_cfg, ...)`."""

    mode: str
    max_batch: int
    multiple: int = 1
    tokens_per_batch: int = 0  # equal_tokens
    m_mem: float = 0.0  # dual
    m_comp: float = 0.0
    p: float = 1.0

    def __post_init__(self):
        if self.mode not in BATCHING_MODES:
            raise ValueError(f"batching mode {self.mode!r} is not one of {list(BATCHING_MODES)}")
        if self.mode == "equal_tokens" and self.tokens_per_batch < 1:
            raise ValueError(f"equal_tokens batching needs tokens_per_batch >= 1, got {self.tokens_per_batch}")
        if self.mode == "dual":
            dual_constraint_batch_size(1, self.m_mem, self.m_comp, self.p)  # validates the budgets

    def __call__(self, seq_len: int) -> int:
        if self.mode == "equal_tokens":
            return equal_token_batch_size(seq_len, self.tokens_per_batch, self.max_batch, self.multiple)
        b = min(dual_constraint_batch_size(seq_len, self.m_mem, self.m_comp, self.p), self.max_batch)
        return round_to_multiple(b, self.multiple)

    def describe(self) -> str:
        if self.mode == "equal_tokens":
            return f"equal_tokens (B x S = {self.tokens_per_batch})"
        return f"dual (M_mem={self.m_mem:.4g} tokens, M_comp={self.m_comp:.4g}, p={self.p:.3f})"


def batch_rule(data_cfg, multiple: int = 1) -> BatchRule:
    """The rule that `data_cfg` (a DataConfig) asks for. For `dual`, budgets not set explicitly
    (data.m_mem, data.m_comp, data.cost_p) come from the fit-cost JSON at data.cost_model."""
    if data_cfg.batching == "equal_tokens":
        return BatchRule(
            "equal_tokens", max_batch=data_cfg.max_batch, multiple=multiple, tokens_per_batch=data_cfg.tokens_per_batch
        )
    m_mem, m_comp, p = data_cfg.m_mem, data_cfg.m_comp, data_cfg.cost_p
    if data_cfg.cost_model:
        from dsv_jax.data.cost_model import CostModel

        model = CostModel.load(data_cfg.cost_model)
        m_mem = m_mem or (model.m_mem or 0.0)
        m_comp = m_comp or (model.m_comp or 0.0)
        p = p or model.p
    missing = [name for name, v in (("data.m_mem", m_mem), ("data.m_comp", m_comp), ("data.cost_p", p)) if not v]
    if missing:
        where = (
            f"the cost model {data_cfg.cost_model!r} has none of them"
            if data_cfg.cost_model
            else "run `dsv-jax fit-cost` and pass data.cost_model=PATH"
        )
        raise ValueError(f"data.batching=dual needs {', '.join(missing)}: {where}")
    return BatchRule("dual", max_batch=data_cfg.max_batch, multiple=multiple, m_mem=m_mem, m_comp=m_comp, p=p)


def warn_over_memory(rule: BatchRule, seq_lens: dict) -> None:
    """Rounding up to one row per device can exceed M_mem for very long samples: say so before training."""
    if rule.mode != "dual":
        return
    for name, s in seq_lens.items():
        b = rule(s)
        if b * s > rule.m_mem:
            log.warning(
                "bucket %s: B=%d (one row per data-parallel device) holds %d tokens, more than "
                "M_mem=%d; it may run out of memory (consider parallel.context > 1)",
                name,
                b,
                b * s,
                int(rule.m_mem),
            )
