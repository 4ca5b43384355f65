"""The two-stage DSV controller (dsv_jax/dsv/controller.py)."""

import json

import numpy as np
import pytest

from dsv_jax.dsv.controller import DSVController
from dsv_jax.dsv.plan import AttentionPlan
from tests.conftest import small_config


def controller(*overrides):
    return DSVController(small_config("attention=dsv", "model.depth=3", "model.heads=2", *overrides))


def observe(ctl, step, shape, loss, sparsity):
    return ctl.observe(step, shape, {"dsv/predictor_loss": np.full(3, loss), "dsv/sparsity": np.asarray(sparsity)})


def test_controller_switches_on_the_loss_and_decides_per_block():
    ctl = controller("dsv.stage1_steps=0", "dsv.ema=0.5", "dsv.threshold=0.8", "dsv.ladder=[0.1,0.2,0.5,1.0]")
    shape = (4, 16, 16)
    assert ctl.profile_due(7, shape)  # never profiled: profile now
    sp = [[0.95, 0.93], [0.85, 0.7], [0.5, 0.6]]  # block means 0.94, 0.775, 0.55
    assert observe(ctl, 0, shape, 0.5, sp) == [] and ctl.stage == 1
    assert not ctl.profile_due(7, shape) and ctl.profile_due(50, shape)
    plans = ctl.plans(shape, profile=True)
    assert all(not p.sparse and p.predictor and p.profile for p in plans)
    assert ctl.plans(shape, train=False)[0] == AttentionPlan(mode="dsv", kv_block=0)  # dense, no predictor
    for step in range(50, 500, 50):  # loss EMA 0.25, 0.125, ... falls below 0.01 at the 6th observation
        events = observe(ctl, step, shape, 0.0, sp)
        if ctl.stage == 2:
            break
    assert step == 300 and ctl.switch_step == 301 and "stage 2" in events[0] and ctl.loss_ema < 0.01
    plans = ctl.plans(shape)
    assert [p.sparse for p in plans] == [True, False, False]
    # stage 2 lowers the predictor's rate: fewer sampled queries, except on profile steps
    assert {p.max_queries for p in plans} == {64} and {p.max_queries for p in ctl.plans(shape, profile=True)} == {256}
    assert plans[0].keep == 0.1  # max head keep 0.07 -> rung 0.1
    np.testing.assert_allclose(ctl.inputs(shape)["keep"], 1 - np.asarray(sp), atol=1e-6)
    # stage 2 trains the predictor on every 4th step (and on profile steps) at 4x the per-step rate
    assert ctl.inputs(shape)["predictor_lr"] == pytest.approx(4e-5)  # predictor_lr * 0.1 * 4
    assert [all(p.predictor for p in ctl.plans(shape, step=s)) for s in (300, 301, 302, 303, 304)] == [
        True,
        False,
        False,
        False,
        True,
    ]
    assert not any(p.predictor for p in ctl.plans(shape, step=301))  # one flag for every block
    assert all(p.predictor for p in ctl.plans(shape, step=301, profile=True))
    assert ctl.plans(shape, step=301)[0].sparse  # the selection still runs (the predictor's forward)
    # hysteresis: block 0 at mean 0.78 stays sparse (needs < 0.75 to turn dense); its rung rises with need
    observe(ctl, 150, shape, 0.0, [[0.61, 0.61], [0.85, 0.7], [0.5, 0.6]])  # EMA 0.78
    assert ctl.plans(shape)[0].sparse and ctl.plans(shape)[0].keep == 0.5
    observe(ctl, 200, shape, 0.0, [[0.4, 0.4], [0.85, 0.7], [0.5, 0.6]])  # EMA 0.59 -> dense
    assert not ctl.plans(shape)[0].sparse
    # JSON round trip gives the same decisions
    clone = controller("dsv.stage1_steps=0", "dsv.ema=0.5", "dsv.threshold=0.8", "dsv.ladder=[0.1,0.2,0.5,1.0]")
    clone.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert clone.plans(shape) == ctl.plans(shape) and clone.stage == 2
    np.testing.assert_array_equal(clone.inputs(shape)["keep"], ctl.inputs(shape)["keep"])


def test_stage2_predictor_every_one_trains_every_step():
    ctl = controller("dsv.stage1_steps=1", "dsv.stage2_predictor_every=1")
    assert all(p.predictor for p in ctl.plans((4, 16, 16), step=7))  # stage 1: always
    ctl.before_step(1)
    assert ctl.stage == 2 and all(p.predictor for s in range(4) for p in ctl.plans((4, 16, 16), step=s))
    assert ctl.inputs((4, 16, 16))["predictor_lr"] == pytest.approx(1e-5)
    with pytest.raises(Exception, match="stage2_predictor_every"):
        controller("dsv.stage2_predictor_every=0")


def test_controller_switches_after_the_configured_steps():
    ctl = controller("dsv.stage1_steps=30")
    assert ctl.before_step(29) == [] and ctl.stage == 1
    assert "after 30 stage-1 steps" in ctl.before_step(30)[0] and ctl.stage == 2
    # a shape first profiled in stage 2 is decided at once
    observe(ctl, 31, (1, 16, 16), 0.3, [[0.9, 0.9]] * 3)
    assert all(p.sparse for p in ctl.plans((1, 16, 16)))
    with pytest.raises(ValueError, match="3 blocks x 2 heads"):
        controller().load_state_dict(
            {
                "stage": 1,
                "switch_step": None,
                "loss_ema": None,
                "shapes": {"1x16x16": {"sparsity": [[0.5]], "rungs": [0.0], "profiles": 1}},
            }
        )


def test_controller_keeps_what_the_recall_target_needs():
    """With dsv.recall_target, a head keeps the smallest profiled fraction whose (EMA) recall reaches the
    target; the block goes sparse when 1 - mean keep clears the threshold; the curves survive a round trip."""
    from dsv_jax.dsv.profiler import RECALL_FRACTIONS

    overrides = (
        "dsv.stage1_steps=100",
        "dsv.recall_target=0.94",
        "dsv.ema=0.5",
        "dsv.threshold=0.5",
        "dsv.ladder=[0.1,0.2,0.5,1.0]",
    )
    ctl = controller(*overrides)
    shape, f = (4, 16, 16), np.asarray(RECALL_FRACTIONS)

    def curve(knee):  # recall 0.9 below the knee fraction, 0.99 from it on
        return np.where(f >= knee - 1e-9, 0.99, 0.9)

    curves = np.stack(
        [np.stack([curve(0.05), curve(0.1)]), np.stack([curve(0.6), curve(0.8)]), np.full((2, len(f)), np.nan)]
    )  # block 2: no predictor measured
    sparsity = np.full((3, 2), 0.97)  # the theta rule alone would keep 3% everywhere
    ctl.observe(0, shape, {"dsv/predictor_loss": np.ones(3), "dsv/sparsity": sparsity, "dsv/recall_curve": curves})
    np.testing.assert_allclose(ctl.keep(shape), [[0.05, 0.1], [0.6, 0.8], [0.03, 0.03]], atol=1e-9)
    # the EMA: block 0 head 0 now measures recall 0.9 up to f = 0.2; averaged, 0.945 from 0.05 on still
    # reaches 0.94 (the new curve alone would need 0.2)
    curves2 = curves.copy()
    curves2[0, 0] = curve(0.2)
    ctl.observe(50, shape, {"dsv/predictor_loss": np.ones(3), "dsv/sparsity": sparsity, "dsv/recall_curve": curves2})
    stored = np.asarray(ctl.shapes["4x16x16"]["recall_curve"][0])[0]
    np.testing.assert_allclose(stored[(f >= 0.05) & (f < 0.2)], 0.945)
    assert ctl.keep(shape)[0, 0] == pytest.approx(0.05)
    assert "stage 2" in ctl.before_step(100)[0]
    plans = ctl.plans(shape)
    assert [p.sparse for p in plans] == [True, False, True]  # block 1 needs 70% of its blocks: dense
    assert plans[0].keep == 0.1 and plans[2].keep == 0.1
    clone = controller(*overrides)
    clone.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    np.testing.assert_array_equal(clone.keep(shape), ctl.keep(shape))
    assert clone.plans(shape) == plans
    rec = ctl.record(shape)
    assert rec["dsv/head_keep/block1"] == pytest.approx(0.7) and rec["dsv/keep/block1"] == 1.0
    for broken in ([[0.5] * 3] * 2, [[None] * len(f)] * 2):  # wrong shape; JSON nulls
        bad = json.loads(json.dumps(ctl.state_dict()))
        bad["shapes"]["4x16x16"]["recall_curve"][0] = broken
        with pytest.raises(ValueError, match="recall curves"):
            clone.load_state_dict(bad)
    # a state of the previous version (keep scales, no curves) loads, and follows the paper's rule
    old = {
        "stage": 2,
        "switch_step": 10,
        "loss_ema": 0.2,
        "shapes": {
            "4x16x16": {
                "sparsity": sparsity.tolist(),
                "rungs": [0.1, 0.0, 0.1],
                "scale": [1.25, 1.0, 1.0],
                "profiles": 3,
            }
        },
    }
    clone.load_state_dict(old)
    np.testing.assert_allclose(clone.keep(shape), 0.03)
    # curves measured at other keep ratios are dropped, not misread
    other = json.loads(json.dumps(ctl.state_dict()))
    other["recall_fractions"] = [0.5] * len(f)
    clone.load_state_dict(other)
    assert clone.shapes["4x16x16"]["recall_curve"] == [None] * 3
