"""Pallas kernels, each beside its plain-JAX reference and custom_vjp.

Every public kernel takes `impl="auto" | "pallas" | "xla"`: "auto" runs the Pallas kernel on a GPU
and the reference elsewhere; "pallas" on a CPU runs in interpret mode (how CI tests kernels).
"""
