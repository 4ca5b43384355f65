"""Solvers of the flow ODE that the sampler integrates: Euler, and the UniPC multistep solver Wan samples with.

Both run x from noise at sigma = 1 to data at sigma = 0 along dx/dsigma = v(x, sigma), the velocity the model
predicts (x_sigma = (1 - sigma) x0 + sigma eps, v = eps - x0: dsv_jax/train/loss.py). A `Schedule` holds what one
run of `steps` steps needs, computed on the host once: the noise levels, the timestep the model sees at each step,
and for UniPC each step's update coefficients; the compiled loop (dsv_jax/sample.py) only applies them.

euler  our grid: `steps` + 1 levels uniform in [1, 0] moved by the shift (train.loss.shift_timesteps); the model
       sees 1000 sigma; x <- x + (sigma' - sigma) v. First order: its error per unit of time falls as 1/steps.
unipc  Wan 2.1's sampler as its diffusers pipelines configure it (UniPCMultistepScheduler with flow sigmas,
       order 2, B(h) = e^h - 1, data prediction, corrector on, first order at the last step): its grid is
       `steps` levels uniform in [1, 1/1000] moved by the same shift, the first nudged to 1 - 1e-6, then 0;
       the model sees floor(1000 sigma), a whole number as diffusers' integer timesteps. Second order: each step
       extrapolates from the previous step's prediction of the clean latents and corrects the step before
       with the new one, at one model call per step like Euler.

UniPC in this setting (Zhao et al. 2023, "UniPC", with x0-prediction): with alpha = 1 - sigma and
lambda = log(alpha / sigma), the model's velocity gives the clean-latent prediction m = x - sigma v, and the
exact solution of the flow ODE from level s to t is x_t = (sigma_t / sigma_s) x_s + sigma_t * integral of
e^lambda m over [lambda_s, lambda_t]. UniPC approximates m in that integral by a polynomial through the latest
predictions: the predictor (UniP) uses m at s and at the step before (linear in lambda), the corrector (UniC)
redoes the last step once m at its end is known. Every update is a fixed linear combination of the latents and
the predictions, so `unipc_coefficients` computes the weights per step (in float64, from the float32 levels
diffusers steps with) and the loop applies

    m_i   = x_i - sigma_i v_i
    x_i  <- cx x_i + cl x_{i-1} + c2 m_{i-2} + c1 m_{i-1} + c0 m_i      corrector (step 0: x_i unchanged)
    x_i+1 = px x_i + p1 m_{i-1} + p0 m_i                                  predictor

where x_{i-1} is the previous step's corrected latents. tests/test_wan_sampling.py feeds one velocity sequence
to this and to diffusers' scheduler and compares the latents after every step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

SOLVERS = ("euler", "unipc")
TRAIN_TIMESTEPS = 1000  # the model's timestep is 1000 sigma (Wan's num_train_timesteps)
# UniPC-order-2 coefficient columns: corrector (cx, cl, c2, c1, c0), then predictor (px, p1, p0)
UNIPC_COLUMNS = ("cx", "cl", "c2", "c1", "c0", "px", "p1", "p0")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One sampling run's grid: `sigmas` [steps + 1] float32 noise levels from 1 (or just under) to 0,
    `timesteps` [steps] float32 what the model is given at each step (in 0..1000, its time_scale 1), and for
    UniPC `coefficients` [steps, 8] float32 (UNIPC_COLUMNS)."""

    solver: str
    sigmas: np.ndarray
    timesteps: np.ndarray
    coefficients: np.ndarray | None = None

    @property
    def steps(self) -> int:
        return len(self.timesteps)


def shifted(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """The time shift, as train.loss.shift_timesteps and Wan's flow_shift: sigma -> s sigma / (1 + (s - 1) sigma)."""
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def wan_sigmas(steps: int, shift: float) -> tuple[np.ndarray, np.ndarray]:
    """(sigmas [steps + 1] float32, timesteps [steps] float32) of Wan's UniPC grid (see the module's doc)."""
    base = np.linspace(1.0, 1.0 / TRAIN_TIMESTEPS, steps + 1)[:-1]  # float64, as diffusers computes it
    sigmas = shifted(base, shift)
    if abs(sigmas[0] - 1.0) < 1e-6:
        sigmas[0] -= 1e-6  # level 1 exactly has alpha = 0: lambda would be -inf
    timesteps = (sigmas * TRAIN_TIMESTEPS).astype(np.int64).astype(np.float32)  # truncated to whole numbers
    return np.append(sigmas, 0.0).astype(np.float32), timesteps


def time_grid(steps: int, shift: float = 1.0):
    """Euler's `steps + 1` levels, from 1 (noise) down to 0 (data), shifted; in jax's float32."""
    import jax.numpy as jnp

    from dsv_jax.train.loss import shift_timesteps

    return shift_timesteps(jnp.linspace(1.0, 0.0, steps + 1), shift)


def make_schedule(solver: str, steps: int, shift: float) -> Schedule:
    """The grid and coefficients of `steps` steps of `solver` with time shift `shift`."""
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r} is not one of {', '.join(SOLVERS)}")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a whole number >= 1")
    if solver == "euler":
        sigmas = np.asarray(time_grid(int(steps), shift), np.float32)
        # the model's own scaling of t in [0, 1] (time_scale 1000), done here in the same float32 product
        return Schedule("euler", sigmas, np.float32(TRAIN_TIMESTEPS) * sigmas[:-1])
    sigmas, timesteps = wan_sigmas(int(steps), shift)
    return Schedule("unipc", sigmas, timesteps, unipc_coefficients(sigmas))


def unipc_orders(steps: int) -> list[int]:
    """The predictor's order at each step: 1 at the first (no earlier prediction yet) and at the last (the
    jump to sigma = 0, where a second-order step is unstable at few steps), else 2."""
    return [1 if i == 0 or i == steps - 1 else 2 for i in range(steps)]


def unipc_coefficients(sigmas: np.ndarray) -> np.ndarray:
    """[steps, 8] float32 weights of UniPC-2 (B(h) = e^h - 1, x0-prediction) on the levels `sigmas`
    [steps + 1] (decreasing, the last 0, the others in (0, 1)): see the module's doc for the update."""
    s = np.asarray(sigmas, np.float32).astype(np.float64)  # the float32 levels, exactly
    steps = len(s) - 1
    if steps < 1 or s[-1] != 0 or not np.all((s[:-1] > 0) & (s[:-1] < 1)) or not np.all(np.diff(s) < 0):
        raise ValueError("UniPC needs decreasing levels in (0, 1) that end at 0")
    alpha = 1.0 - s
    with np.errstate(divide="ignore"):
        lam = np.log(alpha) - np.log(s)  # +inf at the final level 0
    orders = unipc_orders(steps)
    out = np.zeros((steps, len(UNIPC_COLUMNS)))
    for i in range(steps):
        c = dict.fromkeys(UNIPC_COLUMNS, 0.0)
        if i == 0:
            c["cx"] = 1.0
        else:  # redo the step from level i - 1 to i with the prediction m_i at its end
            h = lam[i] - lam[i - 1]
            phi = np.expm1(-h)  # h phi_1(h) of the exponential integrator, and B(h) of "bh2"
            a = alpha[i]
            c["cl"] = s[i] / s[i - 1]
            if orders[i - 1] == 1:  # the trapezoid between m_{i-1} and m_i: weights 1/2, 1/2 on the difference
                c["c1"] = -a * phi + 0.5 * a * phi
                c["c0"] = -0.5 * a * phi
            else:  # through m_{i-2}, m_{i-1} and m_i: the weights that match e^lambda m's expansion to order 2
                r = (lam[i - 2] - lam[i - 1]) / h
                g1 = phi / -h - 1.0
                b1 = g1 / phi
                b2 = 2.0 * (g1 / -h - 0.5) / phi
                rho0 = (b1 - b2) / (1.0 - r)  # [[1, 1], [r, 1]] @ rho = [b1, b2]
                rho1 = b1 - rho0
                c["c2"] = -a * phi * rho0 / r
                c["c1"] = -a * phi + a * phi * rho0 / r + a * phi * rho1
                c["c0"] = -a * phi * rho1
        if s[i + 1] == 0:  # the last step lands on the current prediction of the clean latents
            c["p0"] = 1.0
        else:
            h = lam[i + 1] - lam[i]
            phi = np.expm1(-h)
            a = alpha[i + 1]
            c["px"] = s[i + 1] / s[i]
            c["p0"] = -a * phi
            if orders[i] == 2:  # the slope in lambda from m_{i-1} to m_i, at half weight (UniP-2 with bh2)
                r = (lam[i - 1] - lam[i]) / h
                c["p0"] += 0.5 * a * phi / r
                c["p1"] = -0.5 * a * phi / r
        out[i] = [c[k] for k in UNIPC_COLUMNS]
    return out.astype(np.float32)


def unipc_step(x, x_last, m_prev2, m_prev, m, coefficients):
    """One UniPC step on arrays (jax or numpy): (corrected x_i, next latents x_{i+1}) from the latents x_i, the
    previous corrected latents x_last, predictions m_{i-2}, m_{i-1}, m_i and the step's row of coefficients."""
    cx, cl, c2, c1, c0, px, p1, p0 = (coefficients[k] for k in range(len(UNIPC_COLUMNS)))
    corrected = cx * x + cl * x_last + c2 * m_prev2 + c1 * m_prev + c0 * m
    return corrected, px * corrected + p1 * m_prev + p0 * m
