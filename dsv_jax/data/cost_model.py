"""The step-time model of shape benchmarking: t = a + b * B * S**p, fitted to measured steps.

    model = fit_cost_model(batch_sizes, seq_lens, step_times)     # seconds
    model.predict(8, 4096)                                        # predicted seconds of a B=8, S=4096 step
    model.save("cost.json"); CostModel.load("cost.json")

`a` is the fixed cost of a step (launches, optimizer update, communication of gradients), `b * S**p`
the cost of one sample of S tokens: p = 1 for pure matmul work, 2 for attention alone, in between for
a transformer. The fit is scipy's non-linear least squares on relative residuals (every shape counts,
not only the slowest), with B and S rescaled so the three parameters are of order one.

The same JSON carries the budgets the dual-constraint batch rule reads (`m_mem` tokens per batch,
`m_comp` in units of B * S**p) and how they were derived (`info`), as written by `dsv-jax fit-cost`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

P_BOUNDS = (0.5, 3.0)  # physically 1 <= p <= 2; a little slack either side keeps the fit honest


@dataclass(frozen=True)
class CostModel:
    a: float  # seconds per step
    b: float  # seconds per (sample * token**p)
    p: float
    r2: float | None = None  # goodness of fit on the measured points
    max_rel_error: float | None = None
    m_mem: float | None = None  # memory budget, tokens per (global) batch
    m_comp: float | None = None  # compute budget, B * S**p per (global) batch
    info: dict[str, Any] = field(default_factory=dict)

    def predict(self, batch_size, seq_len):
        """Predicted step time in seconds (numpy-broadcasting over arrays)."""
        return self.a + self.b * np.asarray(batch_size, np.float64) * np.asarray(seq_len, np.float64) ** self.p

    def compute_budget_for(self, step_time: float) -> float:
        """M_comp such that a batch with B * S**p = M_comp is predicted to take `step_time` seconds."""
        if step_time <= self.a:
            raise ValueError(f"target step time {step_time:.4g} s is not above the fixed cost a = {self.a:.4g} s")
        return (step_time - self.a) / self.b

    def save(self, path: str) -> str:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(self), f, indent=2, default=_json_default)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str) -> "CostModel":
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"cost model {path!r} does not exist (write one with `dsv-jax fit-cost`)") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"cost model {path!r} is not valid JSON: {e}") from None
        missing = [k for k in ("a", "b", "p") if k not in d]
        if missing:
            raise ValueError(f"cost model {path!r} lacks field(s) {missing}")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


def _json_default(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def fit_cost_model(batch_sizes: Sequence[float], seq_lens: Sequence[float], step_times: Sequence[float]) -> CostModel:
    """Least-squares fit of t = a + b * B * S**p (scipy.optimize.curve_fit, bounded a >= 0, b > 0,
    p in P_BOUNDS) on relative residuals. Needs >= 3 points with at least two distinct S."""
    from scipy.optimize import curve_fit

    B, S, t = (np.asarray(x, np.float64).ravel() for x in (batch_sizes, seq_lens, step_times))
    if not len(B) == len(S) == len(t):
        raise ValueError(f"batch_sizes, seq_lens and step_times differ in length: {len(B)}, {len(S)}, {len(t)}")
    if len(t) < 3:
        raise ValueError(f"fitting a, b and p needs at least 3 measured steps, got {len(t)}")
    for name, x in (("batch_sizes", B), ("seq_lens", S), ("step_times", t)):
        if not np.all(np.isfinite(x)) or np.any(x <= 0):
            raise ValueError(f"{name} must be finite and > 0, got {x.tolist()}")
    if len(np.unique(S)) < 2:
        raise ValueError(f"all steps have seq_len {S[0]:g}: the exponent p needs at least two sequence lengths")

    # Rescale so a, b and p are all of order one for the optimiser.
    s_ref, t_ref = float(np.max(S)), float(np.median(t))
    x = (B, S / s_ref)
    y = t / t_ref

    def model(x, a, b, p):
        bb, ss = x
        return a + b * bb * ss**p

    # Start from the largest per-sample cost with p = 1.5 and a fifth of the fastest step as overhead.
    a0 = 0.2 * float(np.min(y))
    b0 = max(float(np.max((y - a0) / (B * (S / s_ref) ** 1.5))), 1e-9)
    params, _ = curve_fit(
        model,
        x,
        y,
        p0=(a0, b0, 1.5),
        sigma=y,
        bounds=((0.0, 1e-12, P_BOUNDS[0]), (np.inf, np.inf, P_BOUNDS[1])),
        maxfev=20000,
    )
    a_n, b_n, p = (float(v) for v in params)
    a, b = a_n * t_ref, b_n * t_ref / s_ref**p
    pred = a + b * B * S**p
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return CostModel(a=a, b=b, p=p, r2=r2, max_rel_error=float(np.max(np.abs(pred - t) / t)), info={"points": len(t)})


def predict_schedule(model: CostModel, seq_lens, shares, batch_sizes) -> dict[str, float]:
    """Predicted step-time statistics of bucketed training where each sample is seen once per epoch:
    bucket k is a step with frequency ~ share_k / B_k (what a bucket batcher over the data does)."""
    seq, b = np.asarray(seq_lens, np.float64), np.asarray(batch_sizes, np.float64)
    freq = np.asarray(shares, np.float64) / b
    freq = freq / freq.sum()
    t = model.predict(b, seq)
    mean = float(np.sum(freq * t))
    std = math.sqrt(float(np.sum(freq * (t - mean) ** 2)))
    return {"cv": std / mean, "tokens_per_s": float(np.sum(freq * b * seq)) / mean, "mean_step_s": mean}


def balance_target(
    model: CostModel, seq_lens, shares, rule_for_target, equal_batches, max_loss: float = 0.03
) -> tuple[float, list[dict]]:
    """The target step time (it sets M_comp) that makes step times most even at a bounded cost.

    Candidates are the predicted times of every bucket at every batch size up to its equal-token
    batch (the times the dual rule can actually hit, since B is an integer); among those whose
    predicted tokens/s is within `max_loss` of equal tokens, the one with the lowest predicted
    step-time CV wins. `rule_for_target(t)` -> batch sizes per bucket. Returns (target, sweep)."""
    seq = np.asarray(seq_lens, np.float64)
    base = predict_schedule(model, seq, shares, equal_batches)
    times = {float(model.predict(b, s)) for s, e in zip(seq, equal_batches) for b in range(1, int(e) + 1)}
    sweep = []
    for target in sorted(t for t in times if t > model.a * 1.001):
        batches = [int(b) for b in rule_for_target(target)]
        pred = predict_schedule(model, seq, shares, batches)
        sweep.append(
            {
                "target_s": target,
                "batch": batches,
                "cv": pred["cv"],
                "tokens_per_s_ratio": pred["tokens_per_s"] / base["tokens_per_s"],
            }
        )
    ok = [s for s in sweep if s["tokens_per_s_ratio"] >= 1 - max_loss]
    if not ok:
        return float(model.predict(equal_batches, seq).max()), sweep
    best = min(ok, key=lambda s: (round(s["cv"], 4), -s["target_s"]))
    return best["target_s"], sweep


def step_time_cv(times: Sequence[float]) -> float:
    """Coefficient of variation (std / mean) of step times: the imbalance measure of AdaptiveLoad."""
    x = np.asarray(times, np.float64)
    if len(x) < 2 or not x.mean() > 0:
        return math.nan
    return float(x.std() / x.mean())
