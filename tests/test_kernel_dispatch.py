"""Which sparse-attention implementation runs where, and a jax without Pallas' Triton lowering."""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import sparse_attention as sa


@dataclasses.dataclass
class FakeDevice:
    device_kind: str
    compute_capability: str
    platform: str = "gpu"


H200, A100 = FakeDevice("NVIDIA H200", "9.0"), FakeDevice("NVIDIA A100-SXM4-80GB", "8.0")


def qkv(s=256, d=64, dtype=jnp.bfloat16):
    x = jax.ShapeDtypeStruct((1, s, 2, d), dtype)
    return x, x, x


def test_hopper_takes_mosaic_gpu_other_gpus_triton_cpu_the_reference():
    assert sa.kernel_path(*qkv(), q_tile=64, kv_block=64, device=H200) == ("mgpu", [])
    path, why = sa.kernel_path(*qkv(), q_tile=64, kv_block=64, device=A100)
    assert path == "triton" and "compute capability 8.0" in why[0]
    path, why = sa.kernel_path(*qkv(), q_tile=32, kv_block=64, device=H200)  # geometry the Hopper kernels lack
    assert path == "triton" and "q_tile=32" in why[0]
    path, why = sa.kernel_path(*qkv(d=96), q_tile=64, kv_block=64, device=H200)
    assert path == "triton" and "head dim 96" in why[0]
    assert sa.kernel_path(*qkv(), q_tile=64, kv_block=64, impl="xla", device=H200) == ("xla", [])
    assert sa.kernel_path(*qkv(), q_tile=64, kv_block=64)[0] == "xla"  # the tests' CPU
    assert sa.kernel_path(*qkv(), q_tile=64, kv_block=64, impl="pallas")[0] == "triton"  # interpret mode


def test_without_the_triton_lowering_auto_falls_back_and_pallas_says_why(monkeypatch):
    monkeypatch.setattr(sa, "triton_missing", lambda: "jax 0.12 has no Pallas Triton lowering")
    assert sa.kernel_path(*qkv(), q_tile=64, kv_block=64, device=H200) == ("mgpu", [])  # unaffected
    path, why = sa.kernel_path(*qkv(), q_tile=64, kv_block=64, device=A100)
    assert path == "xla" and "no Pallas Triton lowering" in why[-1]
    with pytest.raises(ValueError, match="no Pallas path here.*no Pallas Triton lowering"):
        sa.kernel_path(*qkv(), q_tile=64, kv_block=64, impl="pallas", device=A100)


def test_the_whole_stack_runs_with_the_triton_lowering_blocked():
    """Simulates jax removing `jax.experimental.pallas.triton`: the library imports, a DSV model with
    sparse plans trains a step on the references, explicit Pallas requests name the missing lowering."""
    code = """
import sys; sys.modules["jax.experimental.pallas.triton"] = None
import jax, jax.numpy as jnp, numpy as np
from dsv_jax.train.trainer import Trainer  # the whole library imports
from dsv_jax.dsv.plan import AttentionPlan
from dsv_jax.config import get_config
from dsv_jax.model import VideoDiT
from flax import nnx
from pallas_kernels import adaln, lowering
assert lowering.triton_missing()
cfg = get_config("tiny", ["model.depth=1", "model.hidden=32", "model.heads=2", "model.patch=[1,2,2]"])
model = VideoDiT(cfg.model, rngs=nnx.Rngs(0), predictor_rank=4)
plan = AttentionPlan(mode="dsv", sparse=True, keep=0.5, predictor=True)
x = jax.random.normal(jax.random.key(0), (1, 4, 16, 16, 3))
out, aux = model(x, jnp.array([0.5]), jnp.ones((1, 4, cfg.model.text_dim)), jnp.ones((1, 4), bool),
                 attention=[plan], return_aux=True)
assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(aux["predictor_loss"])).all()
try:
    adaln.adaln_modulate(jnp.ones((1, 8, 32)), jnp.zeros((1, 32)), jnp.zeros((1, 32)), impl="pallas")
except RuntimeError as e:
    assert "Triton lowering" in str(e)
else:
    raise AssertionError("impl='pallas' ran without the Triton lowering")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_a_128_token_layout_tile_with_64_token_kv_blocks_reaches_the_hopper_kernels():
    """docs/guide/kernels.md: `model.tile` of 128 tokens with dsv.kv_block=64 gives 128-row query tiles over 64-token KV
    blocks (the faster Mosaic GPU geometry, docs/kernels/mgpu_notes.md), which Hopper runs."""
    from dsv_jax.dsv.plan import AttentionPlan
    from dsv_jax.model.tokens import token_layout

    geometry = AttentionPlan(mode="dsv", kv_block=64).geometry(token_layout((8, 16, 16), (2, 8, 8)), batch=1)
    assert (geometry.q_tile, geometry.kv_block, geometry.kv_valid) == (128, 64, None)
    assert sa.kernel_path(*qkv(s=2048, d=128), q_tile=128, kv_block=64, device=H200) == ("mgpu", [])


def test_every_implementation_takes_the_dispatchers_calls():
    """Each entry of sa.IMPLEMENTATIONS (a new kernel is one module and one entry) answers `supported` and
    accepts the exact calls that sparse_attention and sparse_attention_backward make of it."""
    import inspect

    q, _, _ = qkv()
    idx, cnt = jnp.zeros((1, 2, 4, 2), jnp.int32), jnp.ones((1, 2, 4), jnp.int32)
    lse = jax.ShapeDtypeStruct((1, 2, 256), jnp.float32)
    common = dict(q_tile=64, kv_block=64, sm_scale=0.125, kv_valid=None, interpret=True)
    assert [path.name for path in sa.IMPLEMENTATIONS] == ["mgpu", "token", "triton"]  # fastest first
    for path in sa.IMPLEMENTATIONS:
        module = path.module()
        kv_block = 1 if path.name == "token" else 64  # the token kernels take token level only
        assert module.supported(q, q, q, q_tile=64, kv_block=kv_block) is None, path.name
        assert "q_tile=8" in module.supported(q, q, q, q_tile=8, kv_block=kv_block), path.name
        inspect.signature(module.attention).bind(q, q, q, idx, cnt, return_lse=True, **common)
        inspect.signature(module.attention_backward).bind(q, q, q, idx, cnt, q, lse, q, lse, **common)
        if path.name != "token":  # its package, jax-triton, is a GPU extra (tests/test_sparse_attention_token.py)
            assert path.missing(H200 if path.name == "mgpu" else A100) is None, path.name
