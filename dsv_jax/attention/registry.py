"""Backend registry behind `dsv_jax.attention.attention`."""

from __future__ import annotations

from typing import Callable, Protocol

import jax


class Backend(Protocol):
    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array, *, kv_lens: jax.Array | None, sm_scale: float, **options
    ) -> jax.Array | tuple[jax.Array, jax.Array]: ...

    # return_lse=True is passed (only when asked) to backends that support it: then (o, lse [B, H, Sq]).


_BACKENDS: dict[str, Backend] = {}
_AUTO_RULES: dict[str, Callable[[jax.Array], str | None]] = {}  # by backend, in registration order


def register_backend(name: str, *, auto_rule: Callable[[jax.Array], str | None] | None = None):
    """Decorator registering `fn` as backend `name`. `auto_rule(q)` may claim "auto" for inputs it suits."""

    def wrap(fn: Backend) -> Backend:
        _BACKENDS[name] = fn
        if auto_rule is not None:
            _AUTO_RULES[name] = auto_rule
        return fn

    return wrap


def unregister_backend(name: str) -> None:
    """Remove backend `name` (and its auto rule): a plugin or test that registered one cleans up."""
    _BACKENDS.pop(name, None)
    _AUTO_RULES.pop(name, None)


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend(backend: str, q: jax.Array) -> str:
    if backend == "auto":
        for rule in _AUTO_RULES.values():
            name = rule(q)
            if name is not None:
                return name
        return "xla"
    if backend not in _BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; available: {['auto'] + available_backends()}")
    return backend


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    backend: str = "auto",
    kv_lens: jax.Array | None = None,
    sm_scale: float | None = None,
    return_lse: bool = False,
    **options,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """softmax(q k^T * sm_scale) v over heads; q [B, Sq, H, D], k/v [B, Skv, H, D].

    backend: "auto" (cuDNN on GPU for 16-bit inputs, else XLA), a registered name, or a callable plan
        taking (q, k, v, *, kv_lens, sm_scale, **options) such as a context-parallel `ContextAttention`.
    kv_lens: optional int32 [B]; keys at positions >= kv_lens[b] are ignored.
    sm_scale: defaults to D ** -0.5. Other keyword options go to the backend (e.g. a sparse plan;
        the dense backends take kv_mask, bool [B, Skv] or [Skv]: only True keys are attended).
    return_lse: return (o, lse) with lse [B, H, Sq] fp32, the natural-log log-sum-exp of each query's
        attended logits (-inf where a query attends to no key), differentiable: partial results over
        disjoint key sets merge exactly with `merge_attention`. The backend must support it.
    """
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(
            f"attention expects q [B, Sq, H, D] and k, v [B, Skv, H, D]; got {q.shape}, {k.shape}, {v.shape}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch, heads or head dim")
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    if return_lse:  # only then: backends written before lse need not take the argument
        options = {**options, "return_lse": True}
    if callable(backend):  # a plan object that runs the call itself (e.g. dsv_jax.parallel.ContextPlan)
        return backend(q, k, v, kv_lens=kv_lens, sm_scale=scale, **options)
    name = resolve_backend(backend, q)
    return _BACKENDS[name](q, k, v, kv_lens=kv_lens, sm_scale=scale, **options)
