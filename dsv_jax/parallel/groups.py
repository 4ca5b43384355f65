"""Collectives within groups of devices along one mesh axis (inside shard_map).

A hybrid of HCP degree ph and SCP degree ps runs on the caller's mesh, whose `context` axis holds
n = ph * ps devices: jit rejects a program that mixes two meshes once it holds device-bound custom
calls (cuDNN, Pallas on the GPU), so the (cp_seq, cp_head) grid cannot be a mesh of its own. It is
a view of the axis instead: device i is member i % ph of its HCP group (ph neighbours, one node's
NVLink) and member i // ph of its SCP group (ps devices, stride ph).

A group spanning the whole axis uses the native collectives. A smaller group is served by
ppermute (collective permute), the one collective whose device pairs are explicit and supported
everywhere: a shift is one ppermute, an all-gather or all-to-all is size - 1 shifts. Each device
then sends exactly the bytes of the native collective: an all-gather b (size - 1), an all-to-all
b (size - 1) / size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GroupAxis:
    """Groups of `size` devices along mesh axis `name` of `total` devices; member m of a group sits
    `stride` devices after member m - 1. Hashable: a static argument of custom_vjp and jit."""

    name: str
    size: int
    stride: int = 1
    total: int | None = None  # devices on the axis; default size * stride

    def __post_init__(self):
        total = self.size * self.stride if self.total is None else self.total
        object.__setattr__(self, "total", total)
        if total % (self.size * self.stride):
            raise ValueError(f"groups of {self.size} with stride {self.stride} do not tile {total} devices")

    @property
    def whole(self) -> bool:
        return self.size == self.total

    def index(self):
        """This device's member index in its group."""
        i = jax.lax.axis_index(self.name)
        return i if self.whole else (i // self.stride) % self.size

    def pairs(self, shift: int) -> list[tuple[int, int]]:
        """(source, destination) over the axis: every member m sends to member m + shift of its group."""
        out = []
        for i in range(self.total):
            m = (i // self.stride) % self.size
            out.append((i, i + ((m + shift) % self.size - m) * self.stride))
        return out

    def shift(self, x, shift: int = 1):
        """x of member m - shift (member m sends its x to member m + shift)."""
        return jax.lax.ppermute(x, self.name, self.pairs(shift))

    def all_gather(self, x, axis: int):
        """The group's x concatenated along `axis` in member order (tiled all-gather)."""
        if self.whole:
            return jax.lax.all_gather(x, self.name, axis=axis, tiled=True)
        # shift r brings the x of member me - r
        return self._member_order([x] + [self.shift(x, r) for r in range(1, self.size)], axis)

    def all_to_all(self, x, split_axis: int, concat_axis: int):
        """Tiled all-to-all: chunk j of x along split_axis goes to member j; the chunks received
        are concatenated along concat_axis in member order."""
        if self.whole:
            return jax.lax.all_to_all(x, self.name, split_axis, concat_axis, tiled=True)
        me = self.index()
        chunks = jnp.stack(jnp.split(x, self.size, axis=split_axis))
        # shift r: send member me + r its chunk, receive member me - r's chunk for me
        got = [chunks[me]] + [self.shift(chunks[(me + r) % self.size], r) for r in range(1, self.size)]
        return self._member_order(got, concat_axis)

    def _member_order(self, pieces, axis):
        """pieces[r] is from member me - r -> concatenated along axis as members 0, 1, ..."""
        order = (self.index() - jnp.arange(self.size)) % self.size
        ordered = jnp.take(jnp.stack(pieces), order, axis=0)
        return jnp.concatenate([ordered[j] for j in range(self.size)], axis=axis)


def context_groups(n: int, hcp_degree: int, scp_degree: int) -> tuple[GroupAxis, GroupAxis]:
    """(SCP group, HCP group) of a hybrid over the `context` axis of n devices: HCP groups are ph
    neighbouring devices, SCP groups every ph-th device; a pure strategy's group spans the axis."""
    if hcp_degree * scp_degree != n:
        raise ValueError(f"HCP degree {hcp_degree} x SCP degree {scp_degree} != context axis size {n}")
    return (
        GroupAxis("context", scp_degree, stride=hcp_degree, total=n),
        GroupAxis("context", hcp_degree, stride=1, total=n),
    )
