"""Using a model from Python: `dsv_jax.generate(model, prompts, ...)` -> uint8 videos, prompts tokenized
inside, and the model called with a Python scalar timestep."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv_jax
from dsv_jax.export import LoadedModel
from dsv_jax.model.t2v import TextToVideo
from tests.conftest import small_config

PROMPTS = ["a red circle moving left", "a blue square moving up"]


@pytest.fixture(scope="module")
def model():
    """A one-block model with random weights: a fresh model's output layer is zero, so its velocity (and
    its videos) would not depend on the prompt."""
    cfg = small_config("model.depth=1", "data.buckets=[[2,8,8]]", "data.bucket_weights=[1.0]")
    graphdef, params = nnx.split(TextToVideo(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return LoadedModel(model=nnx.merge(graphdef, jax.tree.unflatten(tree, leaves)), config=cfg, step=0)


def test_generate_gives_uint8_videos_fixed_by_the_seed_and_the_prompt(model):
    frames = dsv_jax.generate(model, PROMPTS, steps=2, seed=0)
    assert isinstance(frames, np.ndarray) and frames.dtype == np.uint8
    assert frames.shape == (2, 2, 8, 8, 3)  # [N, T, H, W, 3]: the config's bucket, pixel codec
    np.testing.assert_array_equal(dsv_jax.generate(model, PROMPTS, steps=2, seed=0), frames)
    assert (dsv_jax.generate(model, PROMPTS, steps=2, seed=1) != frames).any()
    other = dsv_jax.generate(model, ["a green triangle moving down", PROMPTS[1]], steps=2, seed=0)
    assert (other[0] != frames[0]).any()  # another prompt, another video
    np.testing.assert_array_equal(other[1], frames[1])  # the same prompt and noise: the same video
    one = dsv_jax.generate(model, "a red circle moving left", frames=1, height=8, width=16, steps=2)
    assert one.shape == (1, 1, 8, 16, 3)


def test_generate_names_a_size_it_cannot_make(model):
    with pytest.raises(ValueError, match=r"height 10 .* multiple of 4"):
        dsv_jax.generate(model, PROMPTS, height=10, steps=1)
    with pytest.raises(ValueError, match="prompts"):
        dsv_jax.generate(model, [], steps=1)


def test_the_model_takes_a_python_scalar_timestep_and_prompts_as_text(model):
    cfg = model.config
    latents = jax.random.normal(jax.random.key(0), (2, 2, 8, 8, cfg.model.in_channels))
    text, mask = model.encode_text(PROMPTS)  # tokenized with the model's text config
    assert text.shape == (2, cfg.text.max_len, cfg.model.text_dim) and mask.shape == (2, cfg.text.max_len)
    v = model(latents, 0.5, text, mask)
    np.testing.assert_allclose(np.asarray(v), np.asarray(model(latents, jnp.full((2,), 0.5), text, mask)), atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.model(latents, 0.5, text, mask)), np.asarray(v), atol=1e-6)
    with pytest.raises(ValueError, match="timesteps"):
        model(latents, jnp.ones((3,)), text, mask)
