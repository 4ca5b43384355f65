"""The token-level Triton kernels (pallas_kernels.sparse_attention_token), run in Triton's interpreter.

The interpreter executes the kernels' own code on the host (numpy), so these tests check the forward, the
one-pass backward with its atomics, the custom VJP and the ring's backward against the dense masked
reference. float16: the interpreter's dot is wrong for bfloat16 (the GPU check covers bfloat16).
"""

import dataclasses
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if sys.platform == "linux" and platform.machine() == "x86_64":
    import triton  # noqa: F401  (the test extra installs it here: these tests must run, never skip)
else:
    pytest.importorskip("triton", reason="triton has wheels for Linux x86-64 only")

from pallas_kernels import sparse_attention as sa
from pallas_kernels import sparse_attention_token as token
from pallas_kernels import triton_call
from pallas_kernels.sparse_attention_reference import dense_masked_reference, sparse_attention_reference
from pallas_kernels.tuning import TokenAttentionTuning, token_attention_tuning

SMALL = TokenAttentionTuning(fwd_block_n=16, bwd_block_n=16)  # several loop steps per list at these sizes


def selection(key, b, h, tiles, s, n_sel, *, empty_first=True):
    """Distinct random token ids per (b, h, tile), random counts 0..n_sel (tile 0 empty), and garbage
    (out-of-range ids) past each count, which the kernels must never read."""
    k_ids, k_count = jax.random.split(key)
    ids = jnp.argsort(jax.random.uniform(k_ids, (b, h, tiles, s)), axis=-1)[..., :n_sel].astype(jnp.int32)
    count = jax.random.randint(k_count, (b, h, tiles), 0, n_sel + 1).astype(jnp.int32)
    if empty_first:
        count = count.at[:, :, 0].set(0)
    live = jnp.arange(n_sel) < count[..., None]
    return jnp.where(live, ids, 10**6), count, jnp.where(live, ids, 0)


def inputs(seed, b, s, h, d):
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(k, (b, s, h, d), jnp.float32).astype(jnp.float16) for k in keys]


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.sqrt(np.sum((got - want) ** 2) / max(np.sum(want**2), 1e-30)))


@pytest.mark.parametrize(
    "q_tile, d, n_sel, masked",
    [(16, 32, 40, True), (32, 64, 48, False), (64, 32, 20, True)],
)
def test_forward_and_backward_match_the_dense_reference(q_tile, d, n_sel, masked):
    """o, lse and the gradients of (o, lse) with random cotangents, with padded keys, an empty tile and
    lists of every length: the interpreted kernels against one dense masked softmax in float32."""
    b, s, h = 2, 128, 2
    q, k, v, do = inputs(q_tile + d, b, s, h, d)
    index, count, clean = selection(jax.random.key(d), b, h, s // q_tile, s, n_sel)
    kv_valid = (jax.random.uniform(jax.random.key(3), (b, s)) > 0.25).astype(jnp.int32) if masked else None
    dlse = jax.random.normal(jax.random.key(4), (b, h, s), jnp.float32)
    scale = d**-0.5

    def kernels(q, k, v):
        return token.attention(
            q, k, v, index, count, q_tile=q_tile, kv_block=1, sm_scale=scale, kv_valid=kv_valid, return_lse=True,
            interpret=True, tuning=SMALL,
        )  # fmt: skip

    def dense(q, k, v):
        return dense_masked_reference(q, k, v, clean, count, kv_valid, q_tile=q_tile, kv_block=1, sm_scale=scale)

    (o, lse), vjp = jax.vjp(kernels, q, k, v)
    (o_ref, lse_ref), vjp_ref = jax.vjp(dense, q, k, v)
    assert o.dtype == jnp.float16 and lse.shape == (b, h, s)
    assert np.array_equal(np.isinf(lse), np.isinf(lse_ref))  # rows with no key: lse = -inf (the empty tile)
    assert np.isinf(lse[:, :, :q_tile]).all()
    assert np.all(np.asarray(o[:, :q_tile]) == 0)
    assert rel_err(o, o_ref) < 2e-3
    assert rel_err(jnp.where(jnp.isinf(lse), 0, lse), jnp.where(jnp.isinf(lse_ref), 0, lse_ref)) < 1e-5
    grads = vjp((do, dlse))
    grads_ref = vjp_ref((do.astype(jnp.float32), dlse))
    for name, got, want in zip("qkv", grads, grads_ref):
        assert got.dtype == jnp.float16, name
        assert rel_err(got, want) < 3e-3, name
    if masked:  # a padded key gets no gradient
        padded = np.asarray(kv_valid) == 0
        assert np.all(np.asarray(grads[1])[padded] == 0) and np.all(np.asarray(grads[2])[padded] == 0)


def test_the_backward_of_a_share_of_a_merged_attention_matches_the_reference():
    """sparse_attention_backward's contract (the ring): gradients of this call's keys' share of an attention
    whose merged (o, lse) come from elsewhere, with an lse cotangent."""
    b, s, h, d, q_tile = 1, 128, 2, 32, 32
    q, k, v, do = inputs(7, b, s, h, d)
    index, count, clean = selection(jax.random.key(8), b, h, s // q_tile, s, 24, empty_first=False)
    o = jax.random.normal(jax.random.key(9), q.shape, jnp.float32).astype(jnp.float16)
    _, lse_own = sparse_attention_reference(q, k, v, clean, count, q_tile=q_tile, kv_block=1, return_lse=True)
    lse = lse_own + 0.7  # the merged softmax holds more mass than this share
    dlse = jax.random.normal(jax.random.key(10), (b, h, s), jnp.float32)
    common = dict(q_tile=q_tile, kv_block=1, sm_scale=d**-0.5)
    got = token.attention_backward(q, k, v, index, count, o, lse, do, dlse, interpret=True, tuning=SMALL, **common)
    want = sa.sparse_attention_reference_backward(q, k, v, clean, count, o, lse, do, dlse, **common)
    for name, g, w in zip("qkv", got, want):
        assert rel_err(g, w) < 3e-3, name


def test_a_loss_through_jax_grad_and_jit():
    """The custom VJP without lse, under jit: jax.grad of a scalar loss equals the reference's."""
    b, s, h, d, q_tile = 1, 64, 1, 32, 16
    q, k, v, w = inputs(11, b, s, h, d)
    index, count, clean = selection(jax.random.key(12), b, h, s // q_tile, s, 30, empty_first=False)

    def loss(attend, index):
        return lambda q, k, v: jnp.sum(attend(q, k, v, index).astype(jnp.float32) * w.astype(jnp.float32))

    ours = lambda q, k, v, i: token.attention(
        q, k, v, i, count, q_tile=q_tile, kv_block=1, sm_scale=d**-0.5, interpret=True, tuning=SMALL
    )
    ref = lambda q, k, v, i: sparse_attention_reference(q, k, v, i, count, q_tile=q_tile, kv_block=1)
    got = jax.jit(jax.grad(loss(ours, index), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(ref, clean), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", got, want):
        assert rel_err(g, r) < 3e-3, name


def test_what_the_token_kernels_take_and_refuse():
    x = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    assert token.supported(x, x, x, q_tile=32, kv_block=1) is None
    assert "kv_block=16" in token.supported(x, x, x, q_tile=32, kv_block=16)
    assert "q_tile=48" in token.supported(x, x, x, q_tile=48, kv_block=1)
    odd = jax.ShapeDtypeStruct((1, 256, 2, 96), jnp.bfloat16)
    assert "head dim 96" in token.supported(odd, odd, odd, q_tile=32, kv_block=1)
    f32 = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float32)
    assert "bfloat16 or all float16" in token.supported(f32, f32, f32, q_tile=32, kv_block=1)
    q = jnp.zeros((1, 64, 1, 32), jnp.bfloat16)
    idx, cnt = jnp.zeros((1, 1, 4, 8), jnp.int32), jnp.ones((1, 1, 4), jnp.int32)
    with pytest.raises(ValueError, match="interpret the token kernels in float16"):
        token.attention(q, q, q, idx, cnt, q_tile=16, kv_block=1, sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="must be a power of two >= 16"):
        TokenAttentionTuning(fwd_block_n=24)
    # warps that keep the kernels' registers from spilling (ptxas, sm90): 8 for the backward at D = 128
    assert (token_attention_tuning(32, 128).fwd_warps, token_attention_tuning(32, 128).bwd_warps) == (4, 8)
    assert (token_attention_tuning(32, 64).bwd_warps, token_attention_tuning(128, 64).fwd_warps) == (4, 8)
    hash(token.LaunchConfig(16, 0.1, SMALL))  # a nondiff argument of the custom VJP
    big = jax.ShapeDtypeStruct((1, 131072, 128, 128), jnp.bfloat16)  # offsets within a batch entry are int32
    assert "2**31" in token.supported(big, big, big, q_tile=32, kv_block=1)


@dataclasses.dataclass
class FakeDevice:
    device_kind: str
    compute_capability: str
    platform: str = "gpu"


def test_the_dispatcher_takes_the_token_kernels_at_token_level_where_jax_triton_is(monkeypatch):
    h100, a100 = FakeDevice("NVIDIA H100 80GB HBM3", "9.0"), FakeDevice("NVIDIA A100-SXM4-80GB", "8.0")
    x = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    monkeypatch.setattr(
        triton_call.importlib.util, "find_spec", lambda name: None if name == "jax_triton" else object()
    )
    path, why = sa.kernel_path(x, x, x, q_tile=32, kv_block=1, device=h100)
    assert path == "triton" and "jax_triton is not installed" in why[1] and "[token]" in why[1]
    monkeypatch.setattr(triton_call.importlib.util, "find_spec", lambda name: object())
    path, why = sa.kernel_path(x, x, x, q_tile=32, kv_block=1, device=h100)
    assert path == "token" and "Mosaic GPU" in why[0]
    assert sa.kernel_path(x, x, x, q_tile=32, kv_block=1, device=a100)[0] == "token"
    assert sa.kernel_path(x, x, x, q_tile=64, kv_block=64, device=a100)[0] == "triton"  # blocks: not its job
    old = FakeDevice("Tesla V100", "7.0")
    assert "compute capability 7.0" in token.available(old)
    assert "not a GPU" in token.available(jax.devices("cpu")[0])
    assert sa.kernel_path(x, x, x, q_tile=32, kv_block=1)[0] == "xla"  # this CPU, impl="auto"


def test_a_shard_addresses_its_rows_by_its_own_shape():
    """Under partitioned_over_batch_and_heads the launch config is traced with the global shapes and each
    device's call gets its own (batch, head) shard: the kernels must address rows by the operands' sizes.
    Here the per-shard launch runs on heads 2..3 of 8 with the config made for all 8."""
    b, s, h, d, q_tile = 2, 64, 8, 16, 16
    q, k, v, _ = inputs(21, b, s, h, d)
    index, count, clean = selection(jax.random.key(22), b, h, s // q_tile, s, 12)
    kv_valid = (jax.random.uniform(jax.random.key(23), (b, s)) > 0.3).astype(jnp.int32)
    prepare = dict(q_tile=q_tile, kv_block=1, sm_scale=d**-0.5, tuning=SMALL, interpret=True)
    launch, index_k, count_k, key_valid = token._prepare(q, k, v, index, count, kv_valid, **prepare)
    heads = slice(2, 4)
    o, lse2 = token._forward(
        q[:, :, heads], k[:, :, heads], v[:, :, heads], index_k[:, heads], count_k[:, heads], key_valid, launch
    )
    want = sparse_attention_reference(
        q[:, :, heads], k[:, :, heads], v[:, :, heads], clean[:, heads], count[:, heads], q_tile=q_tile, kv_block=1,
        kv_valid=kv_valid,
    )  # fmt: skip
    assert rel_err(o, want) < 2e-3


def test_inside_shard_map_each_device_runs_its_own_heads():
    """What context parallelism does: the kernels inside shard_map over an 8-device (batch, heads) mesh."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "heads"))
    b, s, h, d, q_tile = 2, 64, 8, 16, 16
    q, k, v, _ = inputs(24, b, s, h, d)
    index, count, clean = selection(jax.random.key(25), b, h, s // q_tile, s, 12)
    rows, lists = P("data", None, "heads"), P("data", "heads")
    local = jax.shard_map(
        lambda q, k, v, i, c: token.attention(
            q, k, v, i, c, q_tile=q_tile, kv_block=1, sm_scale=d**-0.5, interpret=True, tuning=SMALL
        ),
        mesh=mesh,
        in_specs=(rows,) * 3 + (lists,) * 2,
        out_specs=rows,
        check_vma=False,
    )
    want = sparse_attention_reference(q, k, v, clean, count, q_tile=q_tile, kv_block=1)
    assert rel_err(jax.jit(local)(q, k, v, index, count), want) < 2e-3
