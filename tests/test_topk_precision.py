"""lowrank_topk's score precision (TopkTuning.precision): every choice lowers to its own Triton kernel for the
GPU, and interpret mode (fp32 on the host) runs any of them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lowrank_topk_triton
from pallas_kernels.lowrank_topk import lowrank_topk_reference
from pallas_kernels.tuning import TOPK_PRECISIONS, TopkTuning
from tests.conftest import triton_lowering_on_cpu


@triton_lowering_on_cpu
def test_each_precision_lowers_to_its_own_kernel():
    lr = jax.ShapeDtypeStruct((1, 512, 2, 16), jnp.bfloat16)
    texts = set()
    for precision in TOPK_PRECISIONS:
        static = (16, 64, 1, "mean", TopkTuning(precision=precision), False)
        select = jax.jit(lambda a, b, static=static: lowrank_topk_triton._select(a, b, static))
        text = select.trace(lr, lr).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text
        texts.add(text)
    assert len(texts) == len(TOPK_PRECISIONS)  # the choice reaches the kernel's dot


def test_a_gpu_only_precision_still_runs_in_interpret_mode():
    """TF32x3 is a GPU dot algorithm (XLA's CPU has none): interpret mode runs the dot in fp32 and picks the
    reference's ids."""
    ks = jax.random.split(jax.random.key(7), 2)
    q_lr = jax.random.normal(ks[0], (1, 256, 2, 16), jnp.bfloat16)
    k_lr = jax.random.normal(ks[1], (1, 256, 2, 16), jnp.bfloat16)
    tuning = TopkTuning(tiles_per_program=16, keys_per_step=32, precision="tf32x3")
    for kv_block, top_k in [(1, 40), (16, 5)]:
        kw = dict(q_tile=32, kv_block=kv_block, block_reduce="mean")
        got = lowrank_topk_triton.lowrank_topk_pallas(q_lr, k_lr, top_k, tuning=tuning, interpret=True, **kw)
        np.testing.assert_array_equal(got, lowrank_topk_reference(q_lr, k_lr, top_k, **kw))


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="TopkTuning.precision='fp64' is not one of"):
        TopkTuning(precision="fp64")
