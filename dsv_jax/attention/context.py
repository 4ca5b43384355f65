"""What a context-parallel attention backend offers the model: the `ContextBackend` interface.

An attention plan's `backend` is a dense backend name, or a `ContextBackend`: attention over a sequence
sharded on the mesh's `context` axis (`dsv_jax.parallel.context.ContextAttention` implements it). The
model's block glue (`dsv_jax.model.attention`) and the DSV selection ask `isinstance(backend,
ContextBackend)` and then use these members; they never probe for attributes. The interface lives in
the attention layer because both the model (which calls it) and the parallel layer (which implements
it) sit above it.
"""

from __future__ import annotations

import abc


class ContextBackend(abc.ABC):
    """Context-parallel attention, passed wherever a backend name goes (`attention(q, k, v, backend=...)`).

    Implementations are hashable (a plan holding one is a static argument of jit) and name the dense
    attention they run per device in `backend`."""

    backend: str  # the per-device dense attention backend ("auto", "xla", "cudnn")

    @abc.abstractmethod
    def __call__(self, q, k, v, *, kv_lens=None, sm_scale=None, **options):
        """Attention over the sequence-sharded q, k, v (dense, or sparse with kv_index / kv_count)."""

    @property
    @abc.abstractmethod
    def token_multiple(self) -> int:
        """Token layouts pad their tile count to a multiple of this, so that every device holds whole tiles."""

    @abc.abstractmethod
    def constrain(self, x):
        """x [B, S, ...] with the sharding the attention wants (sequence over `context`)."""

    @abc.abstractmethod
    def select_kv(self, q_lr, k_lr, top_k, keep=None, *, q_tile, kv_block, block_reduce="mean", kv_valid=None):
        """The DSV selection (as `dsv_jax.dsv.selection.select_kv`) computed where the query tiles live."""

    @abc.abstractmethod
    def cross_attention(self, q, k, v, *, kv_lens=None, return_lse=False):
        """Sequence-sharded queries attending to keys every device holds (DiT's text tokens)."""

    @abc.abstractmethod
    def partial_attention(self, q, k, v, *, kv_mask=None):
        """Queries every device holds attending to sequence-sharded keys: one partial result per device,
        (o [n, B, Sq, H, D], lse [n, B, H, Sq]), to merge by log-sum-exp."""
