"""The timestep shift towards noise: of the training t (train.t_logit_mean) and of the sampler's grid
(train.sample_shift), which every sampler reads from the run's config."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv_jax.config import ConfigError, get_config
from dsv_jax.sample import generate_latents, sampler_shift, time_grid
from dsv_jax.train.loss import flow_matching_loss, sample_timesteps, shift_timesteps
from dsv_jax.train.step import init_state
from tests.conftest import small_config


def test_shift_keeps_the_endpoints_and_the_order_and_moves_towards_noise():
    t = np.sort(np.random.default_rng(0).uniform(0.001, 0.999, 64))
    for shift in (0.5, 1.0, 3.0, 7.0):
        moved = shift_timesteps(t, shift)  # float64 numpy: the odds below are exact enough near t = 1
        assert float(shift_timesteps(0.0, shift)) == 0.0 and float(shift_timesteps(1.0, shift)) == pytest.approx(1.0)
        assert np.all(np.diff(moved) > 0)
        # the odds t / (1 - t) are multiplied by the shift
        np.testing.assert_allclose(moved / (1 - moved), shift * t / (1 - t), rtol=1e-9)
        np.testing.assert_allclose(np.asarray(shift_timesteps(jnp.asarray(t, jnp.float32), shift)), moved, rtol=1e-5)
    assert np.all(np.asarray(shift_timesteps(jnp.asarray(t), 3.0)) > t)
    np.testing.assert_allclose(np.asarray(shift_timesteps(jnp.asarray(t), 1.0)), t, rtol=1e-6)


def test_training_t_with_logit_mean_log_s_is_the_shifted_t():
    base = get_config("tiny").train
    plain = dataclasses.replace(base, t_logit_mean=0.0, t_logit_std=1.3)
    shifted = dataclasses.replace(plain, t_logit_mean=float(np.log(3.0)))
    key = jax.random.key(11)
    t0, t1 = sample_timesteps(key, 4096, plain), sample_timesteps(key, 4096, shifted)
    np.testing.assert_allclose(np.asarray(t1), np.asarray(shift_timesteps(t0, 3.0)), rtol=1e-5, atol=1e-6)
    assert float(jnp.median(t1)) == pytest.approx(0.75, abs=0.02)  # sigmoid(log 3): 3/4 of the draws at t < 0.75


def test_resolution_shift_moves_larger_clips_towards_noise_in_training():
    """train.resolution_shift_ref: a clip with n latent positions trains at t_logit_mean + log(sqrt(n / ref)),
    i.e. the shifted t of sqrt(n / ref); at ref, and with the option off, nothing changes."""
    plain = dataclasses.replace(get_config("tiny").train, t_logit_mean=0.5, t_logit_std=1.2)
    ref = dataclasses.replace(plain, resolution_shift_ref=1024)
    key = jax.random.key(3)
    base = sample_timesteps(key, 2048, plain, positions=8192)
    np.testing.assert_array_equal(np.asarray(sample_timesteps(key, 2048, ref, positions=1024)), np.asarray(base))
    for positions in (256, 8192):
        np.testing.assert_allclose(
            np.asarray(sample_timesteps(key, 2048, ref, positions=positions)),
            np.asarray(shift_timesteps(base, np.sqrt(positions / 1024))),
            rtol=1e-5,
            atol=1e-6,
        )
    with pytest.raises(ValueError, match="resolution_shift_ref"):  # a caller that forgets the clips' size
        sample_timesteps(key, 4, ref)


def test_the_loss_samples_t_at_its_clips_resolution(monkeypatch):
    """flow_matching_loss hands the batch's latent positions (T x H x W) to the timestep sampler."""
    import dsv_jax.train.loss as loss_module

    seen = []
    monkeypatch.setattr(
        loss_module, "sample_timesteps", lambda key, b, cfg, positions=0: seen.append(positions) or jnp.full((b,), 0.5)
    )

    class Model:  # the loss's view of a model: text encoding and a velocity
        def encode_text(self, batch, drop=None):
            return None, None

        def __call__(self, x, t, text, mask, **kw):
            return x, {}

    batch = {"latents": jnp.ones((2, 3, 4, 5, 6))}
    flow_matching_loss(Model(), batch, jax.random.key(0), get_config("tiny").train)
    assert seen == [3 * 4 * 5]


def test_sampler_grid_runs_from_noise_to_data_and_spends_more_steps_near_noise():
    uniform, shifted = np.asarray(time_grid(10)), np.asarray(time_grid(10, 3.0))
    np.testing.assert_allclose(uniform, np.linspace(1, 0, 11), atol=1e-6)
    for grid in (uniform, shifted):
        assert len(grid) == 11 and grid[0] == pytest.approx(1.0) and grid[-1] == 0.0 and np.all(np.diff(grid) < 0)
    assert np.sum(shifted > 0.5) > np.sum(uniform > 0.5)


def test_generate_reads_the_shift_from_the_run_config():
    cfg = small_config("model.depth=1", "data.buckets=[[2,8,8]]", "data.bucket_weights=[1.0]")
    state = init_state(cfg)
    from dsv_jax.train.step import abstract_model

    graphdef, _ = abstract_model(cfg)
    # random weights: a fresh model's zero-initialised output layer would make every grid give the noise back
    leaves, tree = jax.tree.flatten(state.params)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    params = jax.tree.unflatten(tree, [p + 0.2 * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys)])
    shifted = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, sample_shift=4.0))
    run = lambda c, **kw: generate_latents(c, graphdef, params, ["a red circle moving left"], (2, 8, 8), steps=3, **kw)
    from_config = run(shifted)
    np.testing.assert_allclose(from_config, run(cfg, shift=4.0), rtol=1e-5, atol=1e-5)
    assert np.abs(from_config - run(cfg)).max() > 1e-3
    # train.resolution_shift_ref: a (2, 8, 8) clip has 4x the positions of ref 32, so its grid shifts 2x more;
    # an explicit shift is the one used, at any shape
    by_size = dataclasses.replace(shifted, train=dataclasses.replace(shifted.train, resolution_shift_ref=32))
    assert sampler_shift(by_size, (2, 8, 8)) == pytest.approx(8.0) and sampler_shift(by_size, (1, 4, 8)) == 4.0
    assert sampler_shift(by_size, (2, 8, 8), 1.5) == 1.5 and sampler_shift(shifted, (2, 8, 8)) == 4.0
    np.testing.assert_allclose(run(by_size), run(cfg, shift=8.0), rtol=1e-5, atol=1e-5)


def test_sample_and_eval_hand_an_asked_shift_to_the_sampler(tmp_path, monkeypatch):
    """`dsv-jax sample --shift` and `eval --shift` override the run's train.sample_shift."""
    import dsv_jax.sample
    from dsv_jax.evaluate import semantic_eval

    cfg = small_config("model.depth=1", "data.buckets=[[2,8,8]]", "data.bucket_weights=[1.0]")
    seen = []

    def recording(cfg, graphdef, params, prompts, shape, **kw):
        seen.append(kw.get("shift"))
        return np.random.default_rng(0).normal(size=(len(prompts), *shape, cfg.model.in_channels)).astype(np.float32)

    monkeypatch.setattr(dsv_jax.sample, "generate_latents", recording)
    semantic_eval(cfg, None, None, clips=1, steps=2, shift=2.5)
    dsv_jax.sample.sample_from_state(cfg, None, None, str(tmp_path / "x.gif"), steps=2, shift=4.0)
    dsv_jax.sample.sample_from_state(cfg, None, None, str(tmp_path / "y.gif"), steps=2)
    assert seen == [2.5, 4.0, None]  # None: generate_latents takes the config's


@pytest.mark.parametrize("override", ["train.sample_shift=0", "train.sample_steps=0", "train.resolution_shift_ref=-1"])
def test_bad_shift_or_steps_is_rejected(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        get_config("tiny", [override])
