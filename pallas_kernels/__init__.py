"""Pallas kernels, each beside its plain-JAX reference and custom_vjp.

Every public kernel takes `impl="auto" | "pallas" | "xla"`: "auto" runs the Pallas kernel on a GPU
and the reference elsewhere; "pallas" on a CPU runs in interpret mode (how CI tests kernels).

Each kernel is a few modules that import one way (tests/test_layers.py keeps the shape):

    <kernel>.py            the public entry points: pick an implementation per call, re-export the reference's names
    <kernel>_reference.py  the definition: input checks, the plain-JAX reference, helpers the implementations share
    <kernel>_triton.py     the Pallas kernels on the Triton lowering (any GPU; interpret mode on a CPU)
    <kernel>_mgpu*.py      the Pallas Mosaic GPU kernels (Hopper)

for sparse_attention (triton, mgpu), lowrank_topk (triton) and adaln (triton). Implementations import
only their reference and the shared helpers: tuning (every kernel's tunings and per-device defaults),
mgpu_common (the Mosaic GPU kernels' warpgroups, rings, work items), sparse_index (index sanitising,
the dK/dV work list), partitioning (custom_partitioning of the calls) and lowering (what this jax lacks).
A new implementation of sparse attention is one module and one entry of
`sparse_attention.IMPLEMENTATIONS`.
"""
