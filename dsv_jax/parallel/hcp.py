"""Head-wise context parallelism (HCP, Ulysses): all-to-all from sequence shards to head shards and back.

Before attention every device holds S/n tokens of all H heads; one all-to-all gives it all S tokens
of H/n heads, attention runs locally, and a second all-to-all returns the output to sequence shards.

Sparse attention makes heads unequal: a head of sparsity s_h costs ~ (1 - s_h) of a dense one, so
devices holding the densest heads straggle (DSV measured 35.7%). `balance_heads` assigns heads to
devices: longest processing time first, then swaps that lower the most loaded device. The all-to-all
needs the same number of head slots on every device: `slots` = H/n gives each device exactly H/n
heads; more slots let a device holding a dense head take fewer heads (empty slots are zero heads
that select a single block, so a sparse kernel spends almost nothing on them) at the price of
moving n * slots / H times the bytes. The assignment is a runtime array (a gather of heads before the
all-to-all), so a new assignment never recompiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv_jax.parallel.groups import GroupAxis


def check_heads(heads: int, degree: int) -> None:
    if heads % degree:
        raise ValueError(
            f"head-wise context parallelism splits {heads} heads over an HCP degree of {degree}: "
            f"{heads} is not divisible by {degree}; pick an HCP degree that divides the head count"
        )


def _slots(h, degree, slots):
    check_heads(h, degree)
    slots = h // degree if slots is None else int(slots)
    if not h // degree <= slots <= h:
        raise ValueError(f"hcp slots={slots} per device must be between H/degree = {h // degree} and H = {h}")
    return slots


def balance_heads(loads, degree: int, slots: int | None = None) -> jax.Array:
    """Assignment of H heads to `degree` devices with `slots` head slots each (default H / degree).

    Returns int32 [degree * slots]: device j runs heads out[j*slots:(j+1)*slots]; an entry >= H is
    an empty slot. With slots = H / degree it is a permutation of the heads. Longest processing time
    first (heads in decreasing load, each to the least loaded device with a free slot), then up to H
    swaps between the most loaded device and any other while one lowers the larger of the two
    (empty slots take part as heads of load 0, so a swap with one is a move). Eager or under jit;
    `balance_heads_host` is the same algorithm in numpy."""
    loads = jnp.asarray(loads, jnp.float32)
    h = loads.shape[0]
    slots = _slots(h, degree, slots)
    n = degree * slots
    items = jnp.concatenate([loads, jnp.zeros(n - h, jnp.float32)])  # empty slots: items of load 0
    order = jnp.argsort(-items, stable=True)

    def place(i, state):
        dev_load, dev_fill, owner = state
        item = order[i]
        d = jnp.argmin(jnp.where(dev_fill < slots, dev_load, jnp.inf))
        return dev_load.at[d].add(items[item]), dev_fill.at[d].add(1), owner.at[item].set(d)

    init = (jnp.zeros(degree, jnp.float32), jnp.zeros(degree, jnp.int32), jnp.zeros(n, jnp.int32))
    _, _, owner = jax.lax.fori_loop(0, n, place, init)

    def swap(_, owner):
        dev = jax.ops.segment_sum(items, owner, degree)
        top = jnp.argmax(dev)
        delta = items[:, None] - items[None, :]  # [a, b]: a leaves the top device, b joins it
        new = jnp.maximum(dev[top] - delta, dev[owner][None, :] + delta)
        new = jnp.where((owner == top)[:, None] & (owner != top)[None, :], new, jnp.inf)
        best = jnp.argmin(new)
        a, b = best // n, best % n
        better = new.reshape(-1)[best] < dev[top] - 1e-6 * jnp.abs(dev[top])
        return jnp.where(better, owner.at[a].set(owner[b]).at[b].set(top), owner)

    owner = jax.lax.fori_loop(0, h, swap, owner)
    # Device 0's slots first, then device 1's, ...; heads in ascending order, empty slots last.
    perm = jnp.argsort(owner * n + jnp.arange(n), stable=True).astype(jnp.int32)
    return jnp.where(perm < h, perm, h)


def balance_heads_host(loads, degree: int, rebalance: bool = True, slots: int | None = None) -> list[list[int]]:
    """Heads of each device (numpy; the planner's copy of `balance_heads`); rebalance=False: in order."""
    loads = np.asarray(loads, np.float64)
    h = len(loads)
    slots = _slots(h, degree, slots)
    if not rebalance:
        per = h // degree
        return [list(range(j * per, (j + 1) * per)) for j in range(degree)]
    n = degree * slots
    items = np.concatenate([loads, np.zeros(n - h)])
    owner, dev, fill = np.zeros(n, np.int64), np.zeros(degree), np.zeros(degree, np.int64)
    for item in np.argsort(-items, kind="stable"):
        d = int(np.argmin(np.where(fill < slots, dev, np.inf)))
        owner[item], dev[d], fill[d] = d, dev[d] + items[item], fill[d] + 1
    for _ in range(h):
        dev = np.bincount(owner, items, degree)
        top = int(np.argmax(dev))
        delta = items[:, None] - items[None, :]
        new = np.maximum(dev[top] - delta, dev[owner][None, :] + delta)
        new[~((owner == top)[:, None] & (owner != top)[None, :])] = np.inf
        a, b = np.unravel_index(int(np.argmin(new)), new.shape)
        if not new[a, b] < dev[top] - 1e-6 * abs(dev[top]):
            break
        owner[a], owner[b] = owner[b], top
    return [sorted(i for i in np.flatnonzero(owner == j).tolist() if i < h) for j in range(degree)]


def head_loads_from_counts(kv_count) -> jax.Array:
    """Work per head of a sparse selection: selected blocks summed over batch and query tiles."""
    return jnp.sum(kv_count.astype(jnp.float32), axis=(0, 2))


def seq_to_heads(x, group: GroupAxis, head_axis: int = 2, seq_axis: int = 1):
    """[.., S/n (seq_axis), .., H (head_axis), ..] -> [.., S, .., H/n, ..] over an HCP group of n devices."""
    return group.all_to_all(x, head_axis, seq_axis)


def heads_to_seq(x, group: GroupAxis, head_axis: int = 2, seq_axis: int = 1):
    return group.all_to_all(x, seq_axis, head_axis)
