"""What DSV's own work costs, from the wall time of each training step (the end-of-run summary).

    costs = StepCosts()
    costs.add(shape, step_kind(record), seconds)    # every training step, its policy record and wall time
    costs.estimate()                                # None, or the overhead over the plain steps (below)

A stage-2 DSV step that neither trains the predictor nor profiles runs full attention's program where its
blocks are dense (`tests/test_backoff.py`), so what DSV adds is the extra time of the steps that do. Per
bucket, the median plain step is the reference; each kind's extra is its median step minus that; the
overhead is the stage-2 steps' extra time over their reference time (buckets without a plain step are left
out). Medians, so that one slow step (a first call, a save in the same second) does not count as DSV's.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

KINDS = ("plain", "predictor", "profile", "stage1")


def step_kind(record: dict[str, Any]) -> str | None:
    """The kind of a DSV training step from its policy record (`DSVController.record` with its step), or None
    (not DSV): "stage1", else "profile", "predictor" (it trained the predictor) or "plain"."""
    if "dsv/profile_step" not in record:
        return None
    if record.get("dsv/stage") == 1:
        return "stage1"
    if record["dsv/profile_step"]:
        return "profile"
    return "predictor" if record.get("dsv/predictor_step") else "plain"


class StepCosts:
    def __init__(self):
        self.seconds: dict[tuple[str, str], list[float]] = defaultdict(list)

    def add(self, shape, kind: str | None, seconds: float) -> None:
        if kind is not None:
            self.seconds["x".join(str(int(v)) for v in shape), kind].append(float(seconds))

    def estimate(self) -> dict[str, float] | None:
        """{"overhead": extra time of the stage-2 steps / their reference time, "plain_step_s": the reference
        averaged over the stage-2 steps, "<kind>_extra": a step's median extra over its bucket's reference,
        relative to it, "<kind>_steps": steps timed}, or None without a plain stage-2 step."""
        refs = {b: statistics.median(t) for (b, k), t in self.seconds.items() if k == "plain" and t}
        if not refs:
            return None
        out: dict[str, float] = {}
        base = extra = 0.0
        for kind in KINDS:
            steps = ref_sum = extra_sum = 0.0
            for bucket, ref in refs.items():
                times = self.seconds.get((bucket, kind), [])
                if times:
                    steps += len(times)
                    ref_sum += len(times) * ref
                    extra_sum += len(times) * (statistics.median(times) - ref)
            if not steps:
                continue
            out[f"{kind}_steps"] = int(steps)
            if kind != "plain":
                out[f"{kind}_extra"] = extra_sum / ref_sum
            if kind != "stage1":
                base, extra = base + ref_sum, extra + extra_sum
        out["overhead"] = extra / base
        out["plain_step_s"] = base / (
            out.get("plain_steps", 0) + out.get("predictor_steps", 0) + out.get("profile_steps", 0)
        )
        return out
