"""Block-sparse attention: the public entry points, which run the fastest implementation a call can have.

    o[tile] = softmax(q[tile] k[sel]^T * sm_scale) v[sel],   sel = blocks kv_index[b, h, tile, :kv_count[b, h, tile]]

The definition (layouts, padded keys, lse, the backward under merged statistics) is the reference's:
`pallas_kernels.sparse_attention_reference`. The implementations, fastest first (IMPLEMENTATIONS):

    sparse_attention_mgpu    Hopper (sm90), Pallas Mosaic GPU: wgmma, TMA, warp specialisation
    sparse_attention_token   token level (kv_block = 1) on sm80+: Triton kernels through jax-triton
                             (the `token` extra), row gathers pipelined with cp.async
    sparse_attention_triton  any GPU while jax has Pallas' Triton lowering; interpret mode off a GPU
    sparse_attention_reference  plain JAX, everywhere (impl="xla", and the fallback of impl="auto")

Each implementation module imports only the reference and the shared helpers (mgpu_common, tuning,
sparse_index, partitioning, lowering); this module imports them and re-exports the reference's names, so
`from pallas_kernels.sparse_attention import sparse_attention_reference, RESIDUAL_NAME, ...` works.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

import jax

from pallas_kernels import sparse_attention_mgpu, sparse_attention_token
from pallas_kernels.defaults import KV_BLOCK, Q_TILE
from pallas_kernels.lowering import log_fallback, triton_missing
from pallas_kernels.sparse_attention_reference import (
    RESIDUAL_NAME,
    check_sparse_inputs,
    check_statistics,
    masked_softmax_attend,
    name_residuals,
    row_term,
    sparse_attention_reference,
    sparse_attention_reference_backward,
)

__all__ = [
    "IMPLEMENTATIONS",
    "RESIDUAL_NAME",
    "Implementation",
    "check_sparse_inputs",
    "check_statistics",
    "kernel_path",
    "masked_softmax_attend",
    "name_residuals",
    "row_term",
    "sparse_attention",
    "sparse_attention_backward",
    "sparse_attention_reference",
    "sparse_attention_reference_backward",
]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A Pallas implementation of sparse attention, as the dispatcher sees it.

    name: what kernel_path answers; label: how its reasons are named.
    interprets: impl="pallas" runs it off a GPU (interpret mode); else only a GPU runs it.
    missing(device): why this process cannot run it on `device` (None: it can), asked before `module()`.
    module(): the implementation module, which defines
        supported(q, k, v, *, q_tile, kv_block) -> None or why the call does not fit,
        attention(q, k, v, kv_index, kv_count, *, q_tile, kv_block, sm_scale, kv_valid, return_lse, interpret),
        attention_backward(q, k, v, kv_index, kv_count, o, lse, do, dlse, *, q_tile, kv_block, sm_scale,
                           kv_valid, interpret),
    taking inputs that check_sparse_inputs accepted (tests/test_kernel_dispatch.py checks the signatures)."""

    name: str
    label: str
    interprets: bool
    missing: Callable
    module: Callable[[], ModuleType]


def _triton() -> ModuleType:
    from pallas_kernels import sparse_attention_triton  # imports Pallas' Triton lowering, which jax may lack

    return sparse_attention_triton


def _mgpu() -> ModuleType:
    return sparse_attention_mgpu  # imports no GPU-only module until a kernel is built


IMPLEMENTATIONS = (
    Implementation(
        name="mgpu",
        label="Mosaic GPU kernels",
        interprets=False,
        missing=lambda device: sparse_attention_mgpu.available(device),
        module=_mgpu,
    ),
    Implementation(
        name="token",
        label="token kernels (jax-triton)",
        interprets=False,
        missing=lambda device: sparse_attention_token.available(device),
        module=lambda: sparse_attention_token,
    ),
    Implementation(
        name="triton", label="Triton kernels", interprets=True, missing=lambda device: triton_missing(), module=_triton
    ),
)


def kernel_path(q, k, v, *, q_tile: int, kv_block: int, impl: str = "auto", device=None) -> tuple[str, list[str]]:
    """Which implementation `sparse_attention` runs, and why each faster one was passed over.

    -> ("mgpu" | "token" | "triton" | "xla", reasons). On a GPU, "auto" and "pallas" take the first of
    IMPLEMENTATIONS that this machine has and whose geometry fits (the Hopper kernels on sm90, else the
    portable Triton-lowered kernels while jax has them); "auto" then falls back to the XLA reference,
    "pallas" stops with the reasons. Off a GPU "pallas" runs the Triton kernels in interpret mode (tests)."""
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"impl={impl!r} is not one of 'auto', 'pallas', 'xla'")
    if impl == "xla":
        return "xla", []
    device = device or jax.devices()[0]
    on_gpu = device.platform == "gpu"
    if not on_gpu and impl == "auto":
        return "xla", [f"device {device.device_kind!r} is not a GPU"]
    reasons = []
    for path in IMPLEMENTATIONS:
        if not (on_gpu or path.interprets):
            continue
        reason = path.missing(device) or path.module().supported(q, k, v, q_tile=q_tile, kv_block=kv_block)
        if reason is None:
            return path.name, reasons
        reasons.append(f"{path.label}: {reason}")
    if impl == "pallas":
        raise ValueError("sparse_attention(impl='pallas') has no Pallas path here: " + "; ".join(reasons))
    return "xla", reasons


def _chosen(q, k, v, *, q_tile, kv_block, impl, caller) -> Implementation | None:
    """The implementation to run (None: the reference), with the reasons logged once on a GPU."""
    name, reasons = kernel_path(q, k, v, q_tile=q_tile, kv_block=kv_block, impl=impl)
    if reasons and jax.default_backend() == "gpu":
        log_fallback(caller, f"{name} path", "; ".join(reasons))
    return next((path for path in IMPLEMENTATIONS if path.name == name), None)


def sparse_attention(
    q,
    k,
    v,
    kv_index,
    kv_count,
    *,
    q_tile=Q_TILE,
    kv_block=KV_BLOCK,
    sm_scale=None,
    kv_valid=None,
    return_lse=False,
    impl="auto",
):
    """impl: "pallas" (the Pallas kernels; interpret mode off GPU), "xla" (the reference), or "auto": the
    fastest path this device and geometry have (`kernel_path`: Mosaic GPU on sm90, the Triton lowering
    on other GPUs, else the reference, with the reason logged once). The Pallas paths assume the live
    ids of a tile are distinct (as selections are).

    Returns o [B, S, H, D] in q.dtype, or (o, lse [B, H, S] fp32) with return_lse (see the reference)."""
    check_sparse_inputs(q, k, v, kv_index, kv_count, q_tile, kv_block, kv_valid)
    path = _chosen(q, k, v, q_tile=q_tile, kv_block=kv_block, impl=impl, caller="sparse_attention")
    if path is None:
        return sparse_attention_reference(
            q,
            k,
            v,
            kv_index,
            kv_count,
            q_tile=q_tile,
            kv_block=kv_block,
            sm_scale=sm_scale,
            kv_valid=kv_valid,
            return_lse=return_lse,
        )
    return path.module().attention(
        q,
        k,
        v,
        kv_index,
        kv_count,
        q_tile=q_tile,
        kv_block=kv_block,
        sm_scale=q.shape[-1] ** -0.5 if sm_scale is None else sm_scale,
        kv_valid=kv_valid,
        return_lse=return_lse,
        interpret=jax.default_backend() != "gpu",
    )


def sparse_attention_backward(
    q,
    k,
    v,
    kv_index,
    kv_count,
    o,
    lse,
    do,
    dlse=None,
    *,
    q_tile=Q_TILE,
    kv_block=KV_BLOCK,
    sm_scale=None,
    kv_valid=None,
    impl="auto",
):
    """(dq, dk, dv) in the dtypes of q, k, v: the gradients of this call's share of an attention whose merged
    output o [B, S, H, D] and log-sum-exp lse [B, H, S] (fp32, natural log, -inf: no key) are given, for
    cotangents do and dlse (None: 0). See the reference. Same paths as sparse_attention (impl)."""
    check_sparse_inputs(q, k, v, kv_index, kv_count, q_tile, kv_block, kv_valid)
    check_statistics(q, o, lse, do, dlse)
    path = _chosen(q, k, v, q_tile=q_tile, kv_block=kv_block, impl=impl, caller="sparse_attention_backward")
    if path is None:
        return sparse_attention_reference_backward(
            q,
            k,
            v,
            kv_index,
            kv_count,
            o,
            lse,
            do,
            dlse,
            q_tile=q_tile,
            kv_block=kv_block,
            sm_scale=sm_scale,
            kv_valid=kv_valid,
        )
    return path.module().attention_backward(
        q,
        k,
        v,
        kv_index,
        kv_count,
        o,
        lse,
        do,
        dlse,
        q_tile=q_tile,
        kv_block=kv_block,
        sm_scale=q.shape[-1] ** -0.5 if sm_scale is None else sm_scale,
        kv_valid=kv_valid,
        interpret=jax.default_backend() != "gpu",
    )
