"""Head-wise context parallelism (HCP, Ulysses): all-to-all from sequence shards to head shards and back.

Before attention every device holds S/n tokens of all H heads; one all-to-all gives it all S tokens
of H/n heads, attention runs locally, and a second all-to-all returns the output to sequence shards.

Sparse attention makes heads unequal: a head of sparsity s_h costs ~ (1 - s_h) of a dense one, so
devices holding the densest heads straggle (DSV measured 35.7%). `balance_heads` assigns heads to
devices by longest-processing-time-first under the equal-heads-per-device constraint that the
all-to-all needs, and returns a permutation of the heads; the permutation is a runtime array (a
gather of heads before the all-to-all), so a new assignment never recompiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_heads(heads: int, degree: int) -> None:
    if heads % degree:
        raise ValueError(f"head-wise context parallelism splits {heads} heads over an HCP degree of {degree}: "
                         f"{heads} is not divisible by {degree}; pick an HCP degree that divides the head count")


def balance_heads(loads, degree: int) -> jax.Array:
    """Permutation [H] of the heads: device j gets heads perm[j*H/n:(j+1)*H/n] (n = degree).

    Longest processing time first: heads in decreasing load, each to the least loaded device that
    still has room for another head. Works eagerly or under jit (loads may be traced)."""
    loads = jnp.asarray(loads, jnp.float32)
    h = loads.shape[0]
    check_heads(h, degree)
    per = h // degree
    order = jnp.argsort(-loads, stable=True)

    def place(i, state):
        dev_load, dev_fill, owner = state
        head = order[i]
        cand = jnp.where(dev_fill < per, dev_load, jnp.inf)
        d = jnp.argmin(cand)
        return dev_load.at[d].add(loads[head]), dev_fill.at[d].add(1), owner.at[head].set(d)

    init = (jnp.zeros(degree, jnp.float32), jnp.zeros(degree, jnp.int32), jnp.zeros(h, jnp.int32))
    _, _, owner = jax.lax.fori_loop(0, h, place, init)
    # Heads of device 0 first, then device 1, ...; stable, so each device keeps its heads in order.
    return jnp.argsort(owner * h + jnp.arange(h), stable=True).astype(jnp.int32)


def device_loads(loads, perm, degree: int) -> np.ndarray:
    """Load of each device under permutation `perm` (host-side, for metrics and tests)."""
    loads, perm = np.asarray(loads, np.float64), np.asarray(perm)
    return loads[perm].reshape(degree, -1).sum(axis=1)


def head_loads_from_counts(kv_count) -> jax.Array:
    """Work per head of a sparse selection: selected blocks summed over batch and query tiles."""
    return jnp.sum(kv_count.astype(jnp.float32), axis=(0, 2))


def seq_to_heads(x, axis: str, head_axis: int = 2, seq_axis: int = 1):
    """[.., S/n (seq_axis), .., H (head_axis), ..] -> [.., S, .., H/n, ..] over mesh axis `axis`."""
    return jax.lax.all_to_all(x, axis, head_axis, seq_axis, tiled=True)


def heads_to_seq(x, axis: str, head_axis: int = 2, seq_axis: int = 1):
    return jax.lax.all_to_all(x, axis, seq_axis, head_axis, tiled=True)
