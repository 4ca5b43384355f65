"""Shared helpers of the DSV tests: random arrays, dense references, a small perturbed model."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv_jax.config import get_config
from dsv_jax.model import VideoDiT
from dsv_jax.parallel.comm import _subjaxprs


def rand(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


def masked_dense(q, k, v, allowed):
    """Reference: softmax over the keys allowed[b, h, i, j] only. q, k, v [B, S, H, D]."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    p = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), -1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def block_scores(q_lr, k_lr, q_tile, kv_block, reduce):
    b, s, h, r = q_lr.shape
    proxy = q_lr.reshape(b, s // q_tile, q_tile, h, r).mean(2)
    sc = jnp.einsum("bthr,bshr->bhts", proxy, k_lr).reshape(b, h, s // q_tile, s // kv_block, kv_block)
    return np.asarray(sc.mean(-1) if reduce == "mean" else sc.max(-1))


def dsv_model(arch, seed=0, **model_kw):
    cfg = get_config(
        "tiny",
        [
            "model.hidden=32",
            "model.heads=2",
            "model.depth=2",
            "model.text_dim=16",
            "attention=dsv",
            f"model.arch={arch}",
            "dsv.rank=4",
        ],
    )
    import dataclasses

    model = VideoDiT(dataclasses.replace(cfg.model, **model_kw), rngs=nnx.Rngs(seed), predictor_rank=4)
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(kk, x.shape, x.dtype) for x, kk in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


def model_inputs(shape, b=2):
    x = rand(20, (b, *shape, 3))
    t = jax.random.uniform(jax.random.key(21), (b,))
    text = rand(22, (b, 5, 16))
    mask = jnp.arange(5)[None] < jnp.array([3, 5])[:b, None]
    return x, t, text, mask


def count_primitive(jaxpr, name: str) -> int:
    """Occurrences of a primitive in a jaxpr and every jaxpr nested in its equations (scan, remat, pjit...)."""
    return sum(
        (eqn.primitive.name == name) + sum(count_primitive(sub, name) for _, sub in _subjaxprs(eqn))
        for eqn in jaxpr.eqns
    )
