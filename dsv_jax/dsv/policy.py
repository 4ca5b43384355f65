"""Attention policies: what each block's video attention runs at every step, decided on the host.

The training loop, evaluation and sampling ask a policy for the static per-block plans of a step and
their runtime inputs, and feed it what a profiled step measured; they never ask which policy it is.

    policy = make_policy(cfg)                    # StaticPolicy, or the DSV controller for attention=dsv
    events = policy.before_step(step)            # log lines (e.g. "DSV stage 2 from step ...")
    profile = policy.profile_due(step, shape)
    plans = policy.plans(shape, train=True, profile=profile, step=step)  # hashable: part of the compile key
    inputs = policy.inputs(shape, train=True, step=step)  # runtime arrays of the plans, or None
    ... run the step ...
    events = policy.observe(step, shape, host_metrics)         # only after a profiled step
    policy.record(shape, step=step, profile=profile)  # metrics of the step (which the policy may count)
    policy.state_dict()                          # JSON state for checkpoints
    policy.summary(shapes)                       # logged once, with the compile time
    policy.run_summary(costs)                    # logged at the end of a run: what the policy did

`StaticPolicy` serves every fixed choice: a dense backend name, the window baseline, or a wrapper's
fixed plans (context parallelism wraps any policy: `dsv_jax.parallel.policy.ContextPolicy`).
"""

from __future__ import annotations

from typing import Any, Protocol

from dsv_jax.dsv.controller import DSVController
from dsv_jax.dsv.plan import static_plans


class AttentionPolicy(Protocol):
    # step: the training step the plans are for (None: any step; plans may differ between steps)
    def plans(self, shape, *, train: bool = True, profile: bool = False, step: int | None = None) -> Any: ...
    def inputs(self, shape, *, train: bool = True, step: int | None = None) -> dict | None: ...
    def profile_due(self, step: int, shape) -> bool: ...
    def before_step(self, step: int) -> list[str]: ...
    def observe(self, step: int, shape, metrics: dict[str, Any]) -> list[str]: ...
    def record(self, shape, *, step: int | None = None, profile: bool = False) -> dict[str, Any]: ...
    def summary(self, shapes) -> dict[str, Any]: ...
    def run_summary(self, costs: dict[str, float] | None = None) -> dict[str, Any]: ...
    def state_dict(self) -> dict[str, Any] | None: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StaticPolicy:
    """The same plans at every step: a backend name, or one plan (or one per block) such as the window
    baseline. Nothing to profile, decide or checkpoint."""

    def __init__(self, attention: Any):
        self.attention = attention

    def plans(self, shape, *, train: bool = True, profile: bool = False, step: int | None = None) -> Any:
        return self.attention

    def inputs(self, shape, *, train: bool = True, step: int | None = None) -> None:
        return None

    def profile_due(self, step: int, shape) -> bool:
        return False

    def before_step(self, step: int) -> list[str]:
        return []

    def observe(self, step: int, shape, metrics: dict[str, Any]) -> list[str]:
        return []

    def record(self, shape, *, step: int | None = None, profile: bool = False) -> dict[str, Any]:
        return {}

    def summary(self, shapes) -> dict[str, Any]:
        return {}

    def run_summary(self, costs: dict[str, float] | None = None) -> dict[str, Any]:
        return {}

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def make_policy(cfg, state: dict[str, Any] | None = None) -> AttentionPolicy:
    """The policy of a config: the DSV controller for attention=dsv (restored from `state`, a
    checkpoint's JSON), else a StaticPolicy of the backend name or window plan."""
    if cfg.attention == "dsv":
        return DSVController(cfg, state)
    return StaticPolicy(static_plans(cfg))
