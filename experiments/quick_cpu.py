"""Put a --quick run on the CPU before jax starts; scripts with a --quick mode import this module first.

    import experiments.quick_cpu  # noqa: F401 (first: jax reads these variables when it is imported)

jax reads JAX_PLATFORMS when it is imported and XLA_FLAGS when its backend starts, so a script cannot
set them from its argument parser. With --quick on the command line: JAX_PLATFORMS=cpu (unless set), and
XLA's cheapest compile (the quick runs are mostly compilation, of interpret-mode Pallas kernels too).
"""

import os
import sys


def use_cpu(devices: int | None = None, fast_compile: bool = True) -> None:
    """JAX_PLATFORMS=cpu (unless set); `devices` fake CPU devices (unless XLA_FLAGS already asks for a
    number); fast_compile: XLA's backend optimisation level 0."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if devices and "xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={devices}"
    if fast_compile and "xla_backend_optimization_level" not in flags:
        flags += " --xla_backend_optimization_level=0"
    os.environ["XLA_FLAGS"] = flags.strip()


if "--quick" in sys.argv[1:]:
    use_cpu()
