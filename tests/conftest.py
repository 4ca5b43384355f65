"""Tests run on the CPU with 8 fake devices (set before jax is imported anywhere)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    # Optimisation level 0 halves XLA:CPU compile time; tests run small programs where it does not matter.
    fake_devices = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    os.environ["XLA_FLAGS"] = f"{flags} {fake_devices}".strip()

import pytest  # noqa: E402

from dsv_jax.config import get_config  # noqa: E402

# A model small enough to compile in seconds; two buckets so bucket scheduling is exercised.
SMALL = [
    "model.hidden=32", "model.heads=2", "model.depth=2", "model.text_dim=16", "model.patch=[1,4,4]",
    "data.buckets=[[1,16,16],[4,16,16]]", "data.bucket_weights=[0.5,0.5]", "data.tokens_per_batch=64",
    "text.max_len=8", "text.hash_buckets=8", "train.log_every=1", "train.eval_batches=1",
    "train.sample_at_end=false", "train.warmup_steps=2",
]


def small_config(*overrides, preset="tiny"):
    return get_config(preset, SMALL + list(overrides))


@pytest.fixture
def small_cfg():
    return small_config
