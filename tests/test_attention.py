import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv_jax.attention import (
    attention,
    available_backends,
    merge_attention,
    register_backend,
    resolve_backend,
    unregister_backend,
)


def naive(q, k, v, kv_lens=None, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if kv_lens is not None:
        logits = jnp.where(jnp.arange(k.shape[1])[None, None, None] < kv_lens[:, None, None, None], logits, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v.astype(jnp.float32))


def qkv(b=2, sq=37, skv=29, h=3, d=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(ks[0], (b, sq, h, d)),
        jax.random.normal(ks[1], (b, skv, h, d)),
        jax.random.normal(ks[2], (b, skv, h, d)),
    )


def test_xla_backend_matches_naive_with_lengths():
    q, k, v = qkv()
    lens = jnp.array([29, 11], jnp.int32)
    np.testing.assert_allclose(attention(q, k, v, backend="xla", kv_lens=lens), naive(q, k, v, lens), atol=1e-5)
    np.testing.assert_allclose(attention(q, k, v, backend="auto", sm_scale=0.3), naive(q, k, v, scale=0.3), atol=1e-5)


def test_auto_is_xla_on_cpu_and_unknown_backend_is_named():
    q, k, v = qkv()
    assert resolve_backend("auto", q) == "xla"
    assert {"xla", "cudnn"} <= set(available_backends())
    with pytest.raises(ValueError, match="unknown attention backend 'nope'.*xla"):
        attention(q, k, v, backend="nope")


def test_shape_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="disagree"):
        attention(q[..., :8], k, v)


def test_registered_backend_reaches_call_sites():
    calls = []

    @register_backend("test_double")
    def double(q, k, v, *, kv_lens, sm_scale, factor=2.0):
        calls.append(factor)
        return factor * attention(q, k, v, backend="xla", kv_lens=kv_lens, sm_scale=sm_scale)

    try:
        q, k, v = qkv()
        out = attention(q, k, v, backend="test_double", factor=3.0)
        np.testing.assert_allclose(out, 3.0 * naive(q, k, v), atol=1e-5)
        assert calls == [3.0]
    finally:
        unregister_backend("test_double")
    assert "test_double" not in available_backends()


# -- log-sum-exp output and merging ------------------------------------------------------------------


def naive_with_lse(q, k, v, kv_lens=None, scale=None):
    """(o, lse [B, H, Sq]) by brute force; rows without a key: o = 0, lse = -inf."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
    if kv_lens is not None:
        logits = jnp.where(jnp.arange(k.shape[1])[None, None, None] < kv_lens[:, None, None, None], logits, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(logits, -1, keepdims=True))
    m = jnp.where(m == -jnp.inf, 0.0, m)
    e = jnp.exp(logits - m)
    l = jnp.sum(e, -1, keepdims=True)
    o = jnp.einsum("bhqk,bkhd->bqhd", e / jnp.where(l > 0, l, 1.0), v, precision="highest")
    return o, jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)[..., 0]


def grads_through_both(fn, q, k, v, seed=9):
    """Gradients of fn's (o, lse) for random cotangents of both outputs (nonzero on -inf rows too)."""
    (o, lse), pullback = jax.vjp(jax.jit(fn), q, k, v)
    ks = jax.random.split(jax.random.key(seed), 2)
    return o, lse, pullback((jax.random.normal(ks[0], o.shape), jax.random.normal(ks[1], lse.shape)))


def test_xla_backend_returns_lse_and_its_gradient():
    q, k, v = qkv()
    lens = jnp.array([29, 11], jnp.int32)
    o, lse, grads = grads_through_both(
        lambda q, k, v: attention(q, k, v, backend="xla", kv_lens=lens, sm_scale=0.3, return_lse=True), q, k, v
    )
    ro, rl, rgrads = grads_through_both(lambda q, k, v: naive_with_lse(q, k, v, lens, 0.3), q, k, v)
    assert lse.shape == (2, 3, 37) and lse.dtype == jnp.float32
    np.testing.assert_allclose(o, ro, atol=1e-5)
    np.testing.assert_allclose(lse, rl, atol=1e-5)
    for g, rg in zip(grads, rgrads):
        np.testing.assert_allclose(g, rg, atol=1e-4)


def test_chunked_lse_of_the_cudnn_path():
    """softmax_lse (cuDNN's lse, computed beside its output) over query chunks that do not divide Sq, against
    brute force: values and gradients; a batch entry without keys gives -inf and no NaN."""
    from dsv_jax.attention.dense import lse_chunk, softmax_lse

    q, k, v = qkv()
    lens = jnp.array([23, 0], jnp.int32)
    ks = jax.random.split(jax.random.key(3), 1)
    cot = jax.random.normal(ks[0], (2, 3, 37))
    lse, pullback = jax.vjp(jax.jit(lambda q, k: softmax_lse(q, k, lens, 0.25, chunk=16)), q, k)
    ref, ref_pullback = jax.vjp(jax.jit(lambda q, k: naive_with_lse(q, k, v, lens, 0.25)[1]), q, k)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref))
    assert bool(jnp.all(lse[1] == -jnp.inf))
    np.testing.assert_allclose(lse[0], ref[0], atol=1e-5)
    for g, rg in zip(pullback(cot), ref_pullback(cot)):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, rg, atol=1e-4)
    assert lse_chunk(1, 16, 65536, 65536) == 64 and lse_chunk(2, 3, 29, 37) == 37  # bounded logits, whole if small


def test_merge_of_two_key_halves_is_full_attention():
    q, k, v = qkv(skv=30)
    cut = 13

    def merged(q, k, v):
        a = attention(q, k[:, :cut], v[:, :cut], backend="xla", return_lse=True)
        b = attention(q, k[:, cut:], v[:, cut:], backend="xla", return_lse=True)
        return merge_attention(*a, *b)

    o, lse, grads = grads_through_both(merged, q, k, v)
    ro, rl, rgrads = grads_through_both(naive_with_lse, q, k, v)
    np.testing.assert_allclose(o, ro, atol=1e-5)
    np.testing.assert_allclose(lse, rl, atol=1e-5)
    for g, rg in zip(grads, rgrads):
        np.testing.assert_allclose(g, rg, atol=1e-4)


def test_merge_with_empty_parts():
    """One part empty (lse = -inf): the other part unchanged; both empty: o = 0, lse = -inf; no NaN in the
    gradients with respect to either o or lse."""
    ks = jax.random.split(jax.random.key(7), 4)
    o_a, o_b = jax.random.normal(ks[0], (2, 5, 3, 4)), jax.random.normal(ks[1], (2, 5, 3, 4))
    lse_a = jax.random.normal(ks[2], (2, 3, 5))
    lse_b = jnp.full((2, 3, 5), -jnp.inf).at[0].set(jax.random.normal(ks[3], (3, 5)))  # batch 1: b is empty
    merge = jax.jit(merge_attention)
    o, lse = merge(o_a, lse_a, o_b, lse_b)
    np.testing.assert_allclose(o[1], o_a[1], atol=1e-6)
    np.testing.assert_allclose(lse[1], lse_a[1], atol=1e-6)
    np.testing.assert_allclose(lse[0], jnp.logaddexp(lse_a[0], lse_b[0]), atol=1e-6)
    empty = jnp.full_like(lse_a, -jnp.inf)
    o, lse = merge(o_a, empty, o_b, empty)
    assert float(jnp.max(jnp.abs(o))) == 0.0 and bool(jnp.all(lse == -jnp.inf))

    def loss(o_a, l_a, o_b, l_b):
        o, lse = merge_attention(o_a, l_a, o_b, l_b)
        return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    for la, lb in [(lse_a, lse_b), (empty, empty), (empty, lse_b)]:
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in grad(o_a, la, o_b, lb))
    d_oa, d_la, d_ob, d_lb = grad(o_a, lse_a, o_b, lse_b)
    assert float(jnp.max(jnp.abs(d_ob[1]))) == 0.0 and float(jnp.max(jnp.abs(d_lb[1]))) == 0.0
    with pytest.raises(ValueError, match="merge_attention expects"):
        merge_attention(o_a, lse_a.transpose(0, 2, 1), o_b, lse_b)


def test_sparse_backends_pass_return_lse_through():
    """backend="dsv" with every block selected returns the same (o, lse) as dense attention."""
    b, s, h, d, tile = 1, 32, 2, 8, 16
    q, k, v = qkv(b=b, sq=s, skv=s, h=h, d=d)
    idx = jnp.broadcast_to(jnp.arange(2, dtype=jnp.int32), (b, h, 2, 2))
    o, lse = attention(q, k, v, backend="dsv", kv_index=idx, q_tile=tile, kv_block=tile, return_lse=True)
    ro, rl = naive_with_lse(q, k, v)
    np.testing.assert_allclose(o, ro, atol=1e-5)
    np.testing.assert_allclose(lse, rl, atol=1e-5)
