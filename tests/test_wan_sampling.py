"""Sampling as Wan samples, against diffusers: the UniPC solver step by step against diffusers'
UniPCMultistepScheduler (configured as Wan's pipelines configure it) on the same velocities, our time shift
against its flow shift, and an imported tiny random Wan model's first denoising steps (without guidance, and with
guidance against a negative prompt's embeddings) against diffusers' transformer run through the loop of
WanPipeline.__call__. Needs torch's CPU build and diffusers (the test extra on Python 3.11)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (CPU build) + diffusers are the reference; the test extra has them")
diffusers = pytest.importorskip(
    "diffusers", reason="diffusers 0.42 is the parity oracle; the test extra installs it on Python < 3.12 (main leg)"
)

from dsv_jax.solvers import make_schedule, unipc_step  # noqa: E402
from tests.test_wan import CONFIGS, random_wan  # noqa: E402

SHAPE = (3, 6, 10)  # latent T x H x W
TEXT_LEN = 512  # Wan's: umT5's tokens, zero-filled past each caption
PROMPTS = ["a red fox running through snow", "waves breaking on rocks"]
NEGATIVE = "blurry, static, low quality"
# Of the largest value compared. Our forward is diffusers' to 1e-5 (tests/test_wan.py), but at the first
# timestep, 999-1000, the time embedding's float32 sinusoids of up to 1000 radians differ from torch's by an
# ulp in some frequencies (test_wan.py: test_time_features_are_diffusers_timestep_embedding): measured 4e-6 at
# 999 and 1.3-1.4e-5 at 1000, and 4-8e-6 along the 4 UniPC steps. The sampler adds nothing: against our own
# forward's guided velocity, 3.5e-7 to 1.5e-6.
DIFFUSERS_TOL = 3e-5
FORWARD_TOL = 5e-6


def wan_scheduler(shift: float):
    """diffusers' UniPC scheduler as Wan's pipelines use it (the Wan2.1 diffusers repos' scheduler config)."""
    return diffusers.UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=shift
    )


@pytest.mark.parametrize("steps,shift", [(1, 3.0), (2, 3.0), (5, 1.0), (12, 5.0), (50, 3.0)])
def test_unipc_equals_diffusers_scheduler_step_by_step(steps, shift):
    """The same grid and timesteps, and the same latents after every step when both are fed the velocity of
    the latents each holds (a fixed nonlinear field: the corrector and the second-order terms all act)."""
    import jax.numpy as jnp

    ref = wan_scheduler(shift)
    ref.set_timesteps(steps)
    ours = make_schedule("unipc", steps, shift)
    np.testing.assert_array_equal(ours.sigmas, ref.sigmas.numpy())
    np.testing.assert_array_equal(ours.timesteps, ref.timesteps.numpy().astype(np.float32))
    rng = np.random.default_rng(steps)
    mix = rng.standard_normal((10, 10)).astype(np.float32) * 0.3

    def velocity(x, i):
        return np.tanh(x @ mix) + 0.5 * x + np.float32(0.1 * i)

    x0 = rng.standard_normal((2, 16, 3, 10)).astype(np.float32)
    theirs = torch.from_numpy(x0)
    x, x_last, m_prev2, m_prev = (jnp.asarray(a) for a in (x0, 0 * x0, 0 * x0, 0 * x0))
    for i, t in enumerate(ref.timesteps):
        theirs = ref.step(torch.from_numpy(velocity(theirs.numpy(), i)), t, theirs, return_dict=False)[0]
        m = x - ours.sigmas[i] * jnp.asarray(velocity(np.asarray(x), i))
        x_last, x = unipc_step(x, x_last, m_prev2, m_prev, m, jnp.asarray(ours.coefficients[i]))
        m_prev2, m_prev = m_prev, m
        want = theirs.numpy()
        assert np.abs(np.asarray(x) - want).max() <= 2e-6 * np.abs(want).max(), f"step {i}"


def test_our_time_shift_is_wans_flow_shift():
    """train.loss.shift_timesteps (our sampler's grid and training's t) is the flow shift diffusers applies."""
    import jax.numpy as jnp

    from dsv_jax.train.loss import shift_timesteps

    levels = np.linspace(0.95, 0.02, 12)
    for shift in (1.0, 3.0, 5.0):
        ref = wan_scheduler(shift)
        ref.set_timesteps(sigmas=levels.copy())  # its own levels, flow-shifted as Wan's are
        ours = np.asarray(shift_timesteps(jnp.asarray(levels, jnp.float32), shift))
        np.testing.assert_allclose(ours, ref.sigmas.numpy()[:-1], rtol=1e-6)


# ------------------------------------------------------------------------- an imported model, denoising


def encoder(captions):
    """A stand-in umT5: per caption, random [k, 32] embeddings (k from the caption) then zeros to 512."""
    text_dim = CONFIGS["a"]["text_dim"]
    emb = np.zeros((len(captions), TEXT_LEN, text_dim), np.float32)
    for i, caption in enumerate(captions):
        rng = np.random.default_rng(sum(caption.encode()))
        k = 1 + len(caption.split())
        emb[i, :k] = rng.standard_normal((k, text_dim))
    return emb, emb.any(-1)


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """(diffusers' tiny random Wan transformer, our fp32 import of it: a LoadedModel)."""
    import dsv_jax
    from dsv_jax.wan import import_weights

    root = tmp_path_factory.mktemp("wan_sampling")
    model = random_wan(0, **CONFIGS["a"])
    model.save_pretrained(root / "diffusers")
    import_weights(str(root / "diffusers"), str(root / "ours"), dtype="fp32")
    loaded = dsv_jax.load_model(str(root / "ours"))
    assert loaded.config.train.sample_solver == "unipc" and loaded.config.text.max_len == TEXT_LEN
    return model, loaded


def guided(forward, x, timestep, guidance):
    """Wan's guided velocity v_neg + g (v_pos - v_neg) (g = 1: v_pos alone) of `forward`(x, t, text)."""
    positive, _ = encoder(PROMPTS)
    negative, _ = encoder([NEGATIVE] * len(PROMPTS))
    t = torch.full((len(PROMPTS),), float(timestep))
    with torch.no_grad():
        v = forward(x, t, torch.from_numpy(positive))
        if guidance == 1.0:
            return v
        v_neg = forward(x, t, torch.from_numpy(negative))
    return v_neg + guidance * (v - v_neg)


def reference_velocity(model, x, timestep, guidance):
    """Diffusers' transformer, guided as WanPipeline guides it."""
    return guided(lambda *a: model(*a).sample, x, timestep, guidance)


def ours(wan, noise_cf, *, steps, guidance, solver, stop_after):
    """Our latents after `stop_after` steps, channels first as diffusers'."""
    from flax import nnx

    from dsv_jax.sample import generate_latents

    loaded = wan[1]
    graphdef, params = nnx.split(loaded.model, nnx.Param)
    latents = generate_latents(
        loaded.config,
        graphdef,
        params,
        PROMPTS,
        SHAPE,
        steps=steps,
        guidance=guidance,
        solver=solver,
        text_encoder=encoder,
        negative_prompt=NEGATIVE,
        noise=noise_cf.numpy().transpose(0, 2, 3, 4, 1),
        stop_after=stop_after,
    )
    return latents.transpose(0, 4, 1, 2, 3)


def noise(seed):
    return torch.randn(len(PROMPTS), 16, *SHAPE, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("solver", ["euler", "unipc"])
@pytest.mark.parametrize("guidance", [1.0, 5.0])
def test_first_denoising_step_is_diffusers_transformer_at_the_first_timestep(wan, solver, guidance):
    """One step of the preset's 50 at shift 3, from given noise: our latents move by (sigma_1 - sigma_0) times
    the velocity diffusers' transformer gives at the grid's first timestep (1000 sigma_0: 1000 on our Euler
    grid, 999 on Wan's), guided against the negative prompt's embeddings as Wan guides (guidance 5) or not (1).
    The first UniPC step is this Euler step too (x0-prediction at first order is exact for the flow)."""
    x0 = noise(1)
    schedule = make_schedule(solver, 50, 3.0)
    assert schedule.timesteps[0] == (1000.0 if solver == "euler" else 999.0)
    dt = float(schedule.sigmas[1] - schedule.sigmas[0])
    from dsv_jax.wan import diffusers_forward

    v_ref = reference_velocity(wan[0], x0, schedule.timesteps[0], guidance).numpy()
    v_ours = (ours(wan, x0, steps=50, guidance=guidance, solver=solver, stop_after=1) - x0.numpy()) / dt
    assert np.abs(v_ours - v_ref).max() <= DIFFUSERS_TOL * np.abs(v_ref).max()
    forward = lambda *a: torch.from_numpy(np.array(diffusers_forward(wan[1], *a)))  # our model, alone
    v_forward = guided(forward, x0, schedule.timesteps[0], guidance).numpy()
    assert np.abs(v_ours - v_forward).max() <= FORWARD_TOL * np.abs(v_ref).max()


def test_sampling_follows_the_wan_pipeline_loop(wan):
    """WanPipeline.__call__'s denoising loop (both branches of guidance on diffusers' transformer, Wan's
    combination, UniPC's step) for 4 steps at shift 3, guidance 5, with a negative prompt: our latents after
    each step."""
    model = wan[0]
    x = noise(2)
    scheduler = wan_scheduler(3.0)
    scheduler.set_timesteps(4)
    for i, t in enumerate(scheduler.timesteps):
        x = scheduler.step(reference_velocity(model, x, t, 5.0), t, x, return_dict=False)[0]
        got = ours(wan, noise(2), steps=4, guidance=5.0, solver="unipc", stop_after=i + 1)
        assert np.abs(got - x.numpy()).max() <= DIFFUSERS_TOL * np.abs(x.numpy()).max(), f"step {i}"
