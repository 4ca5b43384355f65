"""The sampler's options: a negative prompt for the unconditional half of guidance (Python and `dsv-jax sample`,
built-in and precomputed text encoders), the solver (euler, unipc) and the config's defaults. Wan's own sampler
against diffusers: tests/test_wan_sampling.py."""

import jax
import numpy as np
import pytest
from flax import nnx

import dsv_jax
from dsv_jax.config import ConfigError, get_config
from dsv_jax.export import LoadedModel, load_model, write_export
from dsv_jax.model.t2v import TextToVideo
from dsv_jax.sample import generate_latents, prompt_batch, save_video
from dsv_jax.solvers import make_schedule, unipc_orders, unipc_step
from tests.conftest import small_config
from tests.test_cli import run_cli
from tests.test_prepare import text_encoder_hook

PROMPTS = ["a red circle moving left", "a blue square moving up"]
NEGATIVE = "a green triangle moving down"
HOOK = "tests.test_prepare:text_encoder_hook"  # [N, 5, 7] embeddings
ONE_BUCKET = ["model.depth=1", "data.buckets=[[2,8,8]]", "data.bucket_weights=[1.0]"]


def random_model(cfg) -> LoadedModel:
    """`cfg`'s model with random weights (a fresh model's zero output layer would ignore the prompts)."""
    graphdef, params = nnx.split(TextToVideo(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return LoadedModel(model=nnx.merge(graphdef, jax.tree.unflatten(tree, leaves)), config=cfg, step=0)


@pytest.fixture(scope="module")
def builtin():
    return random_model(small_config(*ONE_BUCKET))


@pytest.fixture(scope="module")
def precomputed(tmp_path_factory):
    """An export of a model that takes the test hook's [N, 5, 7] embeddings."""
    cfg = small_config(*ONE_BUCKET, "text.encoder=precomputed", "model.text_dim=7", "text.max_len=5")
    loaded = random_model(cfg)
    out = str(tmp_path_factory.mktemp("precomputed") / "model")
    meta = {"step": 0, "dtype": "float32", "text_encoder": HOOK}
    write_export(out, cfg, nnx.to_pure_dict(nnx.state(loaded.model, nnx.Param)), meta)
    return out


def test_the_negative_prompt_is_the_unconditional_half_of_the_batch():
    cfg = small_config()
    ids, mask = (prompt_batch(cfg, PROMPTS, negative_prompt=NEGATIVE)[k] for k in ("text_ids", "text_mask"))
    alone = prompt_batch(cfg, [NEGATIVE, NEGATIVE])
    np.testing.assert_array_equal(ids[2:], alone["text_ids"][:2])
    np.testing.assert_array_equal(mask[2:], alone["text_mask"][:2])
    # the built-in encoder's empty caption is training's dropped caption: "" and no negative prompt agree
    for key, value in prompt_batch(cfg, PROMPTS).items():
        np.testing.assert_array_equal(value, prompt_batch(cfg, PROMPTS, negative_prompt="")[key])
    per_prompt = prompt_batch(cfg, PROMPTS, negative_prompt=[NEGATIVE, "a yellow circle"])["text_ids"]
    assert (per_prompt[2] == ids[2]).all() and (per_prompt[3] != ids[3]).any()
    with pytest.raises(ValueError, match="one caption per prompt"):
        prompt_batch(cfg, PROMPTS, negative_prompt=[NEGATIVE])

    pre = small_config("text.encoder=precomputed", "model.text_dim=7", "text.max_len=5")
    calls = []

    def encoder(captions):
        calls.append(list(captions))
        return text_encoder_hook()(captions)

    batch = prompt_batch(pre, PROMPTS, encoder, negative_prompt=NEGATIVE)
    assert calls == [PROMPTS + [NEGATIVE]]  # one call; the shared negative prompt encoded once
    emb, mask = text_encoder_hook()(PROMPTS + [NEGATIVE, NEGATIVE])
    np.testing.assert_array_equal(batch["text_emb"], emb)
    np.testing.assert_array_equal(batch["text_mask"], mask)
    dropped = prompt_batch(pre, PROMPTS, encoder)  # no negative prompt: training's dropped caption
    assert not dropped["text_emb"][2:].any() and (dropped["text_mask"][2:].sum(1) == 1).all()
    prompt_batch(pre, PROMPTS, encoder, negative_prompt="")
    assert calls[-1] == PROMPTS + [""]  # "" is a caption for the encoder (umT5 gives it nonzero embeddings)


def test_generate_guides_away_from_the_negative_prompt(builtin):
    plain = dsv_jax.generate(builtin, PROMPTS, steps=2, seed=0)
    negative = dsv_jax.generate(builtin, PROMPTS, steps=2, seed=0, negative_prompt=NEGATIVE)
    assert negative.shape == plain.shape and (negative != plain).any()
    np.testing.assert_array_equal(dsv_jax.generate(builtin, PROMPTS, steps=2, seed=0, negative_prompt=""), plain)
    # guidance 1 is the conditional branch alone: no negative prompt can change it
    cond = dsv_jax.generate(builtin, PROMPTS, steps=2, guidance=1.0)
    np.testing.assert_array_equal(dsv_jax.generate(builtin, PROMPTS, steps=2, guidance=1.0, negative_prompt="x"), cond)


def gaussian_flow(mean: float, std: float, solver: str, steps: int, shift: float) -> float:
    """The largest error of `solver` on the flow of 1-d Gaussian data N(mean, std^2), whose velocity and solution
    are known: x at level sigma has variance V = (1 - sigma)^2 std^2 + sigma^2, the ideal model's velocity is
    E[eps - x0 | x], and the noise z lands on mean + std z."""
    z = np.random.default_rng(0).standard_normal(1000)

    def velocity(x, sigma):
        var = (1 - sigma) ** 2 * std**2 + sigma**2
        d = x - (1 - sigma) * mean
        return sigma / var * d - (mean + (1 - sigma) * std**2 / var * d)

    schedule = make_schedule(solver, steps, shift)
    sigmas = schedule.sigmas.astype(np.float64)
    x, x_last, m_prev2, m_prev = z, 0 * z, 0 * z, 0 * z
    for i in range(steps):
        v = velocity(x, sigmas[i])
        if solver == "euler":
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        else:
            m = x - sigmas[i] * v
            x_last, x = unipc_step(x, x_last, m_prev2, m_prev, m, schedule.coefficients[i].astype(np.float64))
            m_prev2, m_prev = m_prev, m
    return float(np.abs(x - (mean + std * z)).max())


@pytest.mark.parametrize("mean,std", [(0.5, 0.5), (1.0, 0.3)])
def test_unipc_is_much_closer_than_euler_at_wans_settings(mean, std):
    """On Gaussian data, where the exact flow is known: at Wan's 50 steps and shift 3, UniPC lands 16-18 times
    closer than Euler (measured: Euler 0.11 and 0.10, UniPC 0.0067 and 0.0055); Euler's error halves as the
    steps double (first order)."""
    euler, unipc = (gaussian_flow(mean, std, solver, 50, 3.0) for solver in ("euler", "unipc"))
    assert unipc < euler / 10 and euler < 0.12
    half = gaussian_flow(mean, std, "euler", 25, 3.0)
    assert 1.8 < half / gaussian_flow(mean, std, "euler", 50, 3.0) < 2.2


def test_the_solver_is_an_option_and_the_config_gives_the_defaults(builtin):
    """`solver` picks the loop; the config's train.sample_solver and train.sample_steps are the defaults."""
    import dataclasses

    cfg = builtin.config
    graphdef, params = nnx.split(builtin.model, nnx.Param)
    run = lambda c=cfg, **kw: generate_latents(c, graphdef, params, PROMPTS, (2, 8, 8), guidance=2.0, **kw)
    unipc = run(steps=2, solver="unipc")
    assert np.abs(run(steps=2, solver="euler") - unipc).max() > 1e-3
    np.testing.assert_array_equal(run(steps=2), run(steps=2, solver="euler"))  # the tiny preset's
    wan_like = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, sample_solver="unipc"))
    np.testing.assert_array_equal(run(wan_like, steps=2), unipc)
    frames = dsv_jax.generate(dataclasses.replace(builtin, config=wan_like), PROMPTS[0], steps=2)
    np.testing.assert_array_equal(frames, dsv_jax.generate(builtin, PROMPTS[0], steps=2, solver="unipc"))
    thirty = dataclasses.replace(wan_like, train=dataclasses.replace(wan_like.train, sample_steps=3))
    np.testing.assert_array_equal(
        dsv_jax.generate(dataclasses.replace(builtin, config=thirty), PROMPTS[0]),
        dsv_jax.generate(builtin, PROMPTS[0], steps=3, solver="unipc"),
    )
    with pytest.raises(ValueError, match="solver 'heun'"):
        run(steps=2, solver="heun")


def test_stop_after_and_noise_give_the_first_steps():
    cfg = small_config(*ONE_BUCKET)
    model = random_model(cfg)
    graphdef, params = nnx.split(model.model, nnx.Param)
    noise = np.random.default_rng(0).standard_normal((1, 2, 8, 8, cfg.model.in_channels)).astype(np.float32)
    run = lambda **kw: generate_latents(cfg, graphdef, params, PROMPTS[:1], (2, 8, 8), steps=4, noise=noise, **kw)
    np.testing.assert_array_equal(run(stop_after=0), noise)
    seeded = generate_latents(cfg, graphdef, params, PROMPTS[:1], (2, 8, 8), steps=4, seed=3)
    from_seed = np.asarray(jax.random.normal(jax.random.key(3), noise.shape))
    np.testing.assert_array_equal(
        generate_latents(cfg, graphdef, params, PROMPTS[:1], (2, 8, 8), steps=4, noise=from_seed), seeded
    )
    np.testing.assert_array_equal(run(stop_after=4), run())
    assert np.abs(run(stop_after=1) - run()).max() > 1e-3
    with pytest.raises(ValueError, match="noise has shape"):
        generate_latents(cfg, graphdef, params, PROMPTS, (2, 8, 8), noise=noise)  # noise of one prompt, two asked


def test_schedules():
    euler = make_schedule("euler", 4, 3.0)
    np.testing.assert_allclose(euler.sigmas, [1.0, 0.9, 0.75, 0.5, 0.0], atol=1e-6)  # 3t / (1 + 2t) of 1, .75, ...
    np.testing.assert_allclose(euler.timesteps, 1000 * euler.sigmas[:-1], rtol=1e-7)
    wan = make_schedule("unipc", 4, 3.0)
    assert wan.timesteps.tolist() == [999, 900, 750, 500] and wan.sigmas[-1] == 0 and wan.coefficients.shape == (4, 8)
    assert unipc_orders(1) == [1] and unipc_orders(4) == [1, 2, 2, 1]
    with pytest.raises(ValueError, match="steps"):
        make_schedule("unipc", 0, 3.0)


def test_wan_presets_sample_as_wan():
    for name in ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b"):
        t = get_config(name).train
        assert (t.sample_solver, t.sample_steps, t.guidance, t.sample_shift, t.resolution_shift_ref) == (
            "unipc",
            50,
            5.0,
            3.0,
            0,
        )
    assert get_config("tiny").train.sample_solver == "euler"
    with pytest.raises(ConfigError, match="train.sample_solver"):
        get_config("tiny", ["train.sample_solver=dpm"])


def test_sample_cli_negative_prompt_with_a_text_encoder_hook(precomputed, tmp_path):
    """`dsv-jax sample --negative-prompt` on a precomputed-text model: the hook encodes the negative prompt, and
    the CLI writes what `generate` returns for the same options."""
    import imageio.v3 as iio

    clip = str(tmp_path / "clip.gif")
    args = ["--steps", "2", "--text-encoder", HOOK, "--solver", "unipc"]
    prompts = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]
    r = run_cli("sample", "--model", precomputed, "--out", clip, *prompts, *args, "--negative-prompt", NEGATIVE)
    assert r.returncode == 0, r.stderr[-3000:]
    model = load_model(precomputed)
    videos = dsv_jax.generate(model, PROMPTS, steps=2, text_encoder=HOOK, solver="unipc", negative_prompt=NEGATIVE)
    written = iio.imread(clip, index=None)
    np.testing.assert_array_equal(iio.imread(save_video(videos, str(tmp_path / "py.gif")), index=None), written)
    plain = dsv_jax.generate(model, PROMPTS, steps=2, text_encoder=HOOK, solver="unipc")
    assert (plain != videos).any()
