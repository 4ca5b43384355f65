"""DSV and the window baseline under context parallelism, in the trainer (8 fake CPU devices).

The same run on one device (parallel.context=1) and on eight (context-parallel sparse attention with
per-block placements from the planner) must give the same losses step for step and the same gradients.
Tolerance: float32 on the CPU; the context-parallel program sums attention partials, softmax
statistics and predictor-loss terms in another order (collectives, per-device partial sums), which
moves results by a few ulps per reduction: rtol 1e-4 on losses and gradients (measured: < 1e-6).
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv_jax.dsv.controller import DSVController
from dsv_jax.dsv.policy import make_policy
from dsv_jax.parallel.mesh import make_mesh
from dsv_jax.parallel.policy import ContextPolicy
from dsv_jax.train.loss import flow_matching_loss
from dsv_jax.train.step import abstract_model, init_state
from tests.conftest import SMALL, small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 4 x 16 x 32 latents, patch 1x2x2: 512 tokens = 16 tiles of 2x4x4, two per device on eight devices.
# Decisions forced: stage 2 after two steps, every block sparse at the rung 0.25 (4 of 16 KV blocks),
# whatever the profile measures (threshold 0, keep ratios scaled far below the rung).
DSV = [
    "attention=dsv",
    "model.patch=[1,2,2]",
    "model.tile=[2,4,4]",
    "data.buckets=[[4,16,32]]",
    "data.bucket_weights=[1.0]",
    "data.tokens_per_batch=1024",
    "dsv.stage1_steps=2",
    "dsv.profile_every=1",
    "dsv.threshold=0.0",
    "dsv.ladder=[0.25,1.0]",
    "dsv.keep_scale=0.3",
    "parallel.fsdp=1",
]


def cli_train(workdir, *overrides, steps=4):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv_jax",
            "train",
            "--config",
            "tiny",
            "--workdir",
            workdir,
            "--steps",
            str(steps),
            "--no-progress",
            *SMALL,
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()], r.stderr


def test_cli_dsv_on_eight_context_devices_matches_one_device(tmp_path):
    recs8, log8 = cli_train(str(tmp_path / "cp8"), *DSV, "parallel.context=8")
    recs1, _ = cli_train(str(tmp_path / "cp1"), *DSV, "parallel.context=1")
    steps8 = [r for r in recs8 if "loss" in r]
    steps1 = [r for r in recs1 if "loss" in r]
    assert [r["dsv/stage"] for r in steps8] == [1, 1, 2, 2]
    assert all(r["dsv/sparse_blocks"] == 2 for r in steps8[2:])  # stage 2: both blocks sparse
    np.testing.assert_allclose([r["loss"] for r in steps8], [r["loss"] for r in steps1], rtol=1e-4)
    np.testing.assert_allclose(
        [r["dsv/predictor_loss"] for r in steps8], [r["dsv/predictor_loss"] for r in steps1], rtol=1e-4
    )
    # the sparse blocks ran the planner's placement and fetched selected KV blocks
    assert "context parallel 4x16x32 block 0:" in log8
    assert all(r["cp/requested_blocks"] > 0 for r in steps8[2:] if "cp/fallback" in r)
    assert steps8[-1]["cp/bytes_per_step"] < steps8[0]["cp/bytes_per_step"]  # sparse blocks send less
    info = next(r for r in recs8 if "compile_seconds" in r)
    assert info["cp/4x16x32/plan"].split()[0] in ("8x1", "4x2", "2x4", "1x8")


def _stage2_state(cfg, latent):
    """A controller state with every block sparse at the rung 0.25 on the test bucket."""
    ctl = DSVController(cfg)
    depth, heads = cfg.model.depth, cfg.model.heads
    entry = {"sparsity": np.full((depth, heads), 0.5).tolist(), "rungs": [0.25] * depth, "profiles": 1}
    ctl.load_state_dict({"stage": 2, "switch_step": 0, "loss_ema": 0.0, "shapes": {"x".join(map(str, latent)): entry}})
    return ctl.state_dict()


def _grads(cfg, mesh, plans, inputs, params, batch):
    graphdef, _ = abstract_model(cfg)

    def loss(params):
        model = nnx.merge(graphdef, params)
        value, aux = flow_matching_loss(model, batch, jax.random.key(3), cfg.train, plans, inputs, return_aux=True)
        return value + jnp.sum(aux.get("predictor_loss", 0.0))

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize(
    "extra, latent",
    [
        (["parallel.hcp_degree=2"], (4, 16, 32)),
        (["parallel.context_strategy=ring"], (4, 16, 32)),
        (["attention=window", "dsv.window=0.5"], (4, 16, 32)),
        (["model.arch=mmdit", "model.adaln=single"], (4, 16, 32)),  # sparse video part + text merged by lse
        (["parallel.context_strategy=selective"], (3, 20, 28)),  # token grid 3 x 10 x 14: padded tiles
    ],
    ids=["hybrid-2x4", "ring", "window", "mmdit", "padded-selective"],
)
def test_gradients_on_eight_context_devices_equal_one_device(extra, latent):
    """One block (compile time); the CLI test above covers the planner's own choice over two blocks."""
    shape = list(latent)
    over = [*DSV, f"data.buckets=[{shape}]", "model.depth=1", *extra]
    cfg8 = small_config(*over, "parallel.context=8")
    cfg1 = small_config(*over, "parallel.context=1")
    rng = np.random.default_rng(0)
    batch = {
        "latents": jnp.asarray(rng.standard_normal((2, *latent, 3)), jnp.float32),
        "text_ids": jnp.asarray(rng.integers(1, 8, (2, 8)), jnp.int32),
        "text_mask": jnp.arange(8)[None] < jnp.array([[5], [8]]),
    }
    params = init_state(cfg1).params
    state = _stage2_state(cfg1, latent) if cfg1.attention == "dsv" else None
    out = []
    for cfg in (cfg1, cfg8):
        mesh = make_mesh(cfg.parallel)
        policy = make_policy(cfg, state)
        if cfg.parallel.context > 1:
            policy = ContextPolicy(policy, cfg, mesh, lambda shape: 2)
        inputs = policy.inputs(latent, train=False)
        plans = policy.plans(latent, train=True)
        assert all(getattr(p, "sparse", False) for p in (plans if isinstance(plans, tuple) else [plans]))
        out.append(_grads(cfg, mesh, plans, inputs, params, batch))
    (l1, g1), (l8, g8) = out
    np.testing.assert_allclose(float(l8), float(l1), rtol=1e-4)
    flat1, flat8 = jax.tree.leaves(g1), jax.tree.leaves(g8)
    scale = max(float(jnp.max(jnp.abs(g))) for g in flat1)
    for a, b in zip(flat1, flat8):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-4 * scale, rtol=1e-4)
