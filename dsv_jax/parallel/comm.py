"""Communication accounting of context parallelism: bytes each device sends per attention call (layer).

Two views that the tests hold against each other:
- `context_bytes(...)`: closed-form formulas per strategy (what the planner and the metrics use);
- `collective_bytes(fn, *args)`: the bytes of every collective in fn's jaxpr (inside shard_map,
  shapes are per device), multiplied by loop trip counts.

Per-device bytes sent by one collective over a group of n devices, operand of b bytes:
    all_to_all b (n-1)/n    all_gather b (n-1)    reduce_scatter b (n-1)/n    ppermute b
    psum / pmax (all-reduce) 2 b (n-1)/n
A true hybrid's collectives act within groups smaller than the context axis: they are rounds of
ppermute (`groups.GroupAxis`) that send the same bytes per device as the native collective.
"""

from __future__ import annotations

import math
from collections import defaultdict

import jax
import numpy as np

from pallas_kernels.defaults import KV_BLOCK, Q_TILE

INT_BYTES = 4


def context_bytes(
    *,
    hcp: int,
    scp: int,
    scp_strategy: str,
    batch: int,
    seq_len: int,
    heads: int,
    head_dim: int,
    itemsize: int,
    sparse: bool = False,
    top_k: int = 0,
    q_tile: int = Q_TILE,
    kv_block: int = KV_BLOCK,
    capacity: int = 0,
    mesh_devices: int | None = None,
    hcp_slots: int | None = None,
) -> dict[str, float]:
    """Bytes one device sends in one context-parallel attention call (forward, backward, per part).

    batch: samples per device (the batch after the data axes); itemsize: bytes per q/k/v element
    (gradients travel in the same dtype, except the ring's dK/dV accumulators, which are float32);
    top_k: K of kv_index; capacity: selective blocks per peer; mesh_devices: all devices of the mesh
    (selective reduces three int32 scalars of statistics over it); hcp_slots: head slots per HCP
    device (default heads / hcp; more slots move hcp * slots / heads times the HCP bytes)."""
    n = hcp * scp
    slots = heads // hcp if hcp_slots is None else hcp_slots
    # One device's q/k/v/o after HCP (S/scp tokens of its head slots); without extra slots it has the
    # size of the sequence shard before HCP.
    y = batch * (seq_len // scp) * slots * head_dim * itemsize
    parts = defaultdict(float)
    if hcp > 1:
        a2a = (hcp - 1) / hcp
        parts["hcp_forward"] = 4 * a2a * y  # q, k, v in; o out
        parts["hcp_backward"] = 4 * a2a * y  # dO in; dq, dk, dv out
        if sparse:
            tiles = batch * hcp * slots * (seq_len // q_tile // n)
            parts["hcp_forward"] += a2a * tiles * (top_k + 1) * INT_BYTES  # kv_index, kv_count
    if scp > 1:
        if scp_strategy == "ring":
            parts["scp_forward"] = 2 * (scp - 1) * y
            parts["scp_backward"] = 2 * (scp - 1) * y + 2 * scp * y * 4 / itemsize
        elif scp_strategy == "allgather":
            parts["scp_forward"] = 2 * (scp - 1) * y
            parts["scp_backward"] = 2 * (scp - 1) * y
        elif scp_strategy == "selective":
            kv = 2 * (scp - 1) * capacity * kv_block * head_dim * itemsize
            # the overflow total (over the whole context axis), then the request ids
            control = 2 * (n - 1) / n * INT_BYTES + (scp - 1) * capacity * INT_BYTES
            m = mesh_devices or n
            stats = 3 * 2 * (m - 1) / m * INT_BYTES
            parts["scp_forward"] = kv + control + stats
            parts["scp_backward"] = kv
        else:
            raise ValueError(f"unknown SCP strategy {scp_strategy!r}")
    fwd = parts["hcp_forward"] + parts["scp_forward"]
    bwd = parts["hcp_backward"] + parts["scp_backward"]
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd, **parts}


# -- measuring the program ------------------------------------------------------------------------


def _axis_size(sizes, names) -> int:
    names = names if isinstance(names, (tuple, list)) else (names,)
    return math.prod(sizes[a] for a in names)


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


_ALIASES = {"psum_scatter": "reduce_scatter", "psum2": "psum"}


def _sent(eqn, sizes) -> tuple[str, float] | None:
    name = eqn.primitive.name.replace("_invariant", "")  # newer jax names some collectives *_invariant
    name = _ALIASES.get(name, name)
    p = eqn.params
    if name in ("all_to_all", "all_gather", "reduce_scatter", "ppermute", "psum", "pmax", "pmin"):
        axes = p.get("axis_name", p.get("axes"))
        axes = tuple(a for a in (axes if isinstance(axes, (tuple, list)) else (axes,)) if isinstance(a, str))
        if not axes:
            return None
        n = _axis_size(sizes, axes)
        b = sum(_nbytes(v.aval) for v in eqn.invars if hasattr(v, "aval"))
        if n == 1:
            return name, 0.0
        if name == "all_to_all":
            return name, b * (n - 1) / n
        if name == "all_gather":
            return name, b * (n - 1)
        if name == "reduce_scatter":
            return name, b * (n - 1) / n
        if name == "ppermute":
            moving = sum(1 for s, d in p["perm"] if s != d)
            return name, b * moving / n
        return name, 2 * b * (n - 1) / n  # all-reduce
    return None


def _subjaxprs(eqn):
    for key, val in eqn.params.items():
        for sub in val if isinstance(val, (tuple, list)) else (val,):
            jaxpr = getattr(sub, "jaxpr", sub)
            if hasattr(jaxpr, "eqns"):
                yield key, jaxpr


def _walk(jaxpr, sizes, mult, acc, cond_branch):
    for eqn in jaxpr.eqns:
        sent = _sent(eqn, sizes)
        if sent is not None:
            acc[sent[0]] += mult * sent[1]
            continue
        name = eqn.primitive.name
        if name == "shard_map":
            inner = dict(sizes)
            inner.update(dict(eqn.params["mesh"].shape))
            _walk(eqn.params["jaxpr"], inner, mult, acc, cond_branch)
        elif name == "scan":
            _walk(eqn.params["jaxpr"].jaxpr, sizes, mult * eqn.params["length"], acc, cond_branch)
        elif name == "cond":
            _walk(eqn.params["branches"][cond_branch].jaxpr, sizes, mult, acc, cond_branch)
        elif name == "while":
            body = eqn.params["body_jaxpr"].jaxpr
            probe = defaultdict(float)
            _walk(body, sizes, 1, probe, cond_branch)
            if any(probe.values()):
                raise ValueError("a while loop with collectives has no static trip count to account for")
        else:
            for _, sub in _subjaxprs(eqn):
                _walk(sub, sizes, mult, acc, cond_branch)


def collective_bytes(fn, *args, cond_branch: int = 0) -> dict[str, float]:
    """Per-device bytes sent by the collectives of fn(*args), by primitive, plus "total".

    cond_branch: which branch of a lax.cond to count (0 = the false branch, which is the selective
    exchange without overflow)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    acc: dict[str, float] = defaultdict(float)
    _walk(jaxpr.jaxpr, {}, 1, acc, cond_branch)
    out = dict(acc)
    out["total"] = float(sum(acc.values()))
    return out
