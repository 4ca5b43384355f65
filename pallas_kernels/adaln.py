"""AdaLN: LayerNorm (no affine) + modulation, optionally after a gated residual add; the public entry points.

    adaln_modulate(x, scale, shift)        = LN(x) * (1 + scale[:, None]) + shift[:, None]
    gated_residual_adaln(r, b, g, sc, sh)  = (h, adaln_modulate(h, sc, sh)),  h = r + g[:, None] * b

`impl` picks the path: the Pallas kernels (pallas_kernels.adaln_triton) or the plain-JAX reference
(pallas_kernels.adaln_reference, the definition). Their names are re-exported here.
"""

from __future__ import annotations

import jax

from pallas_kernels.adaln_reference import (
    adaln_modulate_reference,
    check_adaln_inputs,
    check_gated_inputs,
    gated_residual_adaln_reference,
)
from pallas_kernels.adaln_triton import adaln_modulate_pallas, gated_residual_adaln_pallas
from pallas_kernels.lowering import log_fallback, triton_missing
from pallas_kernels.tuning import BlockSizes

__all__ = [
    "BlockSizes",
    "adaln_modulate",
    "adaln_modulate_pallas",
    "adaln_modulate_reference",
    "check_adaln_inputs",
    "check_gated_inputs",
    "gated_residual_adaln",
    "gated_residual_adaln_pallas",
    "gated_residual_adaln_reference",
]


def _use_pallas(impl: str) -> bool:
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"impl={impl!r} is not one of 'auto', 'pallas', 'xla'")
    want = impl == "pallas" or (impl == "auto" and jax.default_backend() == "gpu")
    missing = triton_missing() if want else None
    if missing and impl == "pallas":
        raise RuntimeError(f"adaln impl='pallas' needs the Pallas Triton lowering: {missing}")
    if missing:
        log_fallback("adaln", "XLA reference", missing)
    return want and not missing


def adaln_modulate(x, scale, shift, *, eps=1e-6, impl="auto"):
    """LN(x) * (1 + scale[:, None]) + shift[:, None]; x [B, N, C], scale/shift [B, C]; output x.dtype.

    impl: "auto" (Pallas on a GPU, the XLA reference elsewhere), "pallas" (interpret mode off GPU), "xla"."""
    check_adaln_inputs(x, scale, shift)
    if _use_pallas(impl):
        return adaln_modulate_pallas(x, scale, shift, eps=eps)
    return adaln_modulate_reference(x, scale, shift, eps=eps)


def gated_residual_adaln(residual, branch, gate, scale, shift, *, eps=1e-6, impl="auto"):
    """(h, adaln_modulate(h, scale, shift)) with h = residual + gate[:, None] * branch (residual.dtype)."""
    check_gated_inputs(residual, branch, gate, scale, shift)
    if _use_pallas(impl):
        return gated_residual_adaln_pallas(residual, branch, gate, scale, shift, eps=eps)
    return gated_residual_adaln_reference(residual, branch, gate, scale, shift, eps=eps)
