"""Real Triton kernels from JAX: the jax-triton launch on a GPU, Triton's interpreter on the host.

The token-level kernels are `@triton.jit` code (row gathers, atomics, histograms: what Pallas lacks), called
through jax-triton (the `token` extra). `call` keeps jax-triton's contract in both modes: the kernel's
parameters are the call's inputs (arrays and scalars, in order), then its outputs; `zeroed_outputs` are zero
at launch. With interpret=True the kernel runs in Triton's interpreter on numpy copies of the inputs, through
jax.pure_callback, so CPU tests run the kernels' own code (triton installed, no GPU). The interpreter needs
TRITON_INTERPRET=1 before triton is first imported (tests/conftest.py sets it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading

import jax
import numpy as np

INSTALL_HINT = "pip install -e '.[token]'"
# The interpreter patches triton.language globally while a kernel runs, so launches from several devices'
# callbacks (a sharded call on the fake CPU devices) take turns.
_INTERPRETER = threading.Lock()


def missing(device=None) -> str | None:
    """None if this process can launch Triton kernels through jax-triton on `device`, else why not."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return f"device {device.device_kind!r} is not a GPU"
    for package in ("triton", "jax_triton"):
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed ({INSTALL_HINT})"
    capability = getattr(device, "compute_capability", None)
    if capability is not None and float(capability) < 8.0:
        return f"compute capability {capability} < 8.0"
    return None


@functools.lru_cache(maxsize=None)
def load_kernels(module: str, interpret: bool):
    """The module holding the @triton.jit code; for the interpreter a second copy, loaded with
    TRITON_INTERPRET=1 so that triton.jit makes every function in it (helpers too) an interpreted one."""
    if not interpret:
        return importlib.import_module(module)
    with _interpreting():
        import triton.language as tl
        from triton.runtime.jit import JITFunction

        if isinstance(tl.zeros, JITFunction):  # triton's own library was decorated for compiling
            raise RuntimeError(
                "interpret=True needs TRITON_INTERPRET=1 in the environment before triton is first imported "
                "(tests/conftest.py sets it)"
            )
        spec = importlib.util.find_spec(module)
        copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(copy)
    return copy


@contextlib.contextmanager
def _interpreting():
    """TRITON_INTERPRET=1 for the block (triton reads it when decorating and again while interpreting)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


class _HostArray:
    """A numpy array as Triton's interpreter takes a tensor (it asks for torch's storage methods)."""

    def __init__(self, array):
        self.array = array

    dtype = property(lambda self: self.array.dtype)

    def data_ptr(self):
        return self.array.ctypes.data

    def untyped_storage(self):
        return self

    def cpu(self):
        return self  # already on the host: the interpreter works in place

    def copy_(self, other):
        del other

    def new_empty(self, *shape, **options):
        return _HostArray(self.array)

    def set_(self, storage, offset, size, stride):
        return self

    def storage_offset(self):
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(step // self.array.itemsize for step in self.array.strides)


def _is_scalar(arg) -> bool:
    return isinstance(arg, int | float | np.generic)


def _interpreted(*args, kernel, out_shape, grid, **constants):
    """The kernel in Triton's interpreter on the host; every output starts at zero."""
    arrays = [a for a in args if not _is_scalar(a)]

    def host(*values):
        values = iter(values)
        inputs = [
            a.item() if isinstance(a, np.generic) else a if _is_scalar(a) else np.array(next(values)) for a in args
        ]
        outputs = [np.zeros(o.shape, o.dtype) for o in out_shape]
        params = [a if _is_scalar(a) else _HostArray(a) for a in inputs] + [_HostArray(o) for o in outputs]
        with _INTERPRETER, _interpreting():
            kernel[grid](*params, **constants)
        return outputs

    return jax.pure_callback(host, list(out_shape), *arrays)


def call(*args, kernel, out_shape, grid, zeroed_outputs=(), warps, stages, interpret, **constants):
    """Launch `kernel` (from load_kernels(..., interpret)) over `grid`; returns the outputs (a list).
    Scalars: pass np.float32 / np.int32 for 32-bit parameters (jax-triton types a Python float as fp64)."""
    if interpret:
        return _interpreted(*args, kernel=kernel, out_shape=out_shape, grid=grid, **constants)
    import jax_triton

    return jax_triton.triton_call(
        *args,
        kernel=kernel,
        out_shape=list(out_shape),
        grid=grid,
        zeroed_outputs=zeroed_outputs,
        num_warps=warps,
        num_stages=stages,
        **constants,
    )
