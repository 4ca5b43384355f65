"""DSV's back-off while every block is dense (dsv.backoff_max_every; dsv_jax/dsv/controller.py): the schedule,
its checkpointed state, the end-of-run summary, and what a backed-off step runs."""

import collections
import json
import re

import jax
import numpy as np
import pytest

from dsv_jax.config import ConfigError
from dsv_jax.dsv.controller import DSVController
from dsv_jax.train.step_costs import StepCosts, step_kind
from tests.conftest import small_config

SHAPE = (4, 16, 16)
SCHEDULE = (
    "attention=dsv",
    "model.depth=3",
    "model.heads=2",
    "dsv.stage1_steps=1",
    "dsv.profile_every=10",
    "dsv.stage2_predictor_every=2",
    "dsv.backoff_max_every=80",
    "dsv.ema=0",
    "dsv.threshold=0.5",
)


def controller(*overrides):
    return DSVController(small_config(*SCHEDULE, *overrides))


def sparsity_at(step):
    """Measured head sparsity: dense (0.1) except for the profiles of steps 230-259 (0.9: every block sparse)."""
    return 0.9 if 230 <= step < 260 else 0.1


def drive(ctl, steps):
    """The trainer's calls for `steps` on one bucket; -> (profile steps, predictor steps, events)."""
    profiles, predictor, events = [], [], []
    for step in steps:
        events += ctl.before_step(step)
        profile = ctl.profile_due(step, SHAPE)
        plans = ctl.plans(SHAPE, profile=profile, step=step)
        assert len({p.predictor for p in plans}) == 1  # one flag for every block
        profiles += [step] if profile else []
        predictor += [step] if plans[0].predictor else []
        ctl.record(SHAPE, step=step, profile=profile)
        if profile:
            metrics = {"dsv/predictor_loss": np.ones(3), "dsv/sparsity": np.full((3, 2), sparsity_at(step))}
            events += ctl.observe(step, SHAPE, metrics)
    return profiles, predictor, events


def test_backoff_doubles_while_dense_and_resets_when_a_block_goes_sparse():
    ctl = controller()
    profiles, predictor, events = drive(ctl, range(300))
    # stage 1: step 0 (the bucket's first); stage 2 from step 1, every block dense: each profile doubles
    # both intervals (10 -> 20 -> 40 -> 80 = backoff_max_every; predictor 2 -> 4 -> 8 -> 16) and they stay
    # there; the profile of step 230 makes the blocks sparse: every 10th and every 2nd step again; the one of
    # 260 dense again (EMA 0): the back-off starts over
    assert profiles == [0, 10, 30, 70, 150, 230, 240, 250, 260, 280]
    # the predictor: every profile step, and the multiples of the interval in force
    phases = [(1, 10, 2), (11, 30, 4), (31, 70, 8), (71, 230, 16), (231, 260, 2), (261, 280, 4), (281, 300, 8)]
    assert predictor == sorted({*profiles, *(s for a, b, q in phases for s in range(a, b) if s % q == 0)})
    assert any("every block dense: profiles every 80 steps, the predictor every 16" in e for e in events)
    assert any("a block is sparse: profiles every 10 steps, the predictor every 2" in e for e in events)
    assert ctl.intervals(SHAPE) == (40, 8)
    summary = ctl.run_summary()
    assert summary["dsv/steps"] == 300 and summary["dsv/stage2_steps"] == 299
    assert summary["dsv/predictor_steps"] == len(predictor) and summary["dsv/profile_steps"] == len(profiles)
    assert summary["dsv/backoff_every"] == 80 and summary["dsv/first_sparse_step"] == 231
    assert "every block dense at the end (blocks were sparse from step 231)" in summary["dsv/summary"]
    assert f"the predictor trained on {len(predictor)} of 300 steps, 10 profiled" in summary["dsv/summary"]


def test_a_resumed_controller_makes_the_same_decisions():
    """The back-off is part of the JSON state: a controller restored mid-run (backed off, and again while
    blocks are sparse) continues exactly as the uninterrupted one, counts included."""
    whole = controller()
    expected = drive(whole, range(300))
    for split in (100, 245):
        first = controller()
        a = drive(first, range(split))
        resumed = controller()
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        b = drive(resumed, range(split, 300))
        assert tuple(x + y for x, y in zip(a, b)) == expected
        assert resumed.state_dict() == whole.state_dict()


def test_a_state_saved_before_the_backoff_loads_and_backs_off():
    """A checkpoint's controller state of the previous version (no back-off levels, profile steps or counts)
    loads as one that never backed off: the usual schedule, until its next profile leaves every block dense."""
    ctl = controller()
    drive(ctl, range(15))  # stage 2, backed off once
    old = json.loads(json.dumps(ctl.state_dict()))
    for key in ("counts", "first_sparse_step", "backoff_every"):
        del old[key]
    for entry in old["shapes"].values():
        for key in ("backoff", "last_profile", "sparse_since"):
            del entry[key]
    restored = controller()
    restored.load_state_dict(old)
    assert restored.intervals(SHAPE) == (10, 2) and restored.run_summary()["dsv/steps"] == 0
    profiles, predictor, _ = drive(restored, range(15, 90))
    assert profiles == [20, 40, 80] and predictor[:4] == [16, 18, 20, 24]


def test_backoff_off_and_its_config():
    profiles, predictor, _ = drive(controller("dsv.backoff_max_every=0"), range(100))
    assert profiles == list(range(0, 100, 10)) and predictor == [0, *range(2, 100, 2)]
    # no back-off either where the cap is not above profile_every
    assert drive(controller("dsv.backoff_max_every=10"), range(100))[0] == list(range(0, 100, 10))
    # a cap between doublings: 10, 20, 40, then 50
    ctl = controller("dsv.backoff_max_every=50")
    drive(ctl, range(200))
    assert ctl.max_backoff == 3 and ctl.intervals(SHAPE) == (50, 16)
    with pytest.raises(ConfigError, match="dsv.backoff_max_every=-1"):
        small_config("dsv.backoff_max_every=-1")


def test_step_costs_and_the_summary_words():
    costs = StepCosts()
    assert costs.estimate() is None
    times = {"plain": [1.0, 1.02, 0.98, 1.0, 5.0], "predictor": [1.3, 1.3], "profile": [3.0], "stage1": [1.5, 1.5]}
    for kind, seconds in times.items():
        for s in seconds:
            costs.add(SHAPE, kind, s)
    costs.add((1, 16, 16), "predictor", 9.0)  # a bucket without a plain step: not estimated
    est = costs.estimate()
    # the plain median (1.0) is the reference: 2 x 0.3 + 1 x 2.0 over the 8 stage-2 steps' 8.0 s
    assert est["overhead"] == pytest.approx(2.6 / 8.0) and est["plain_step_s"] == pytest.approx(1.0)
    assert est["predictor_extra"] == pytest.approx(0.3) and est["profile_extra"] == pytest.approx(2.0)
    assert est["stage1_extra"] == pytest.approx(0.5) and est["plain_steps"] == 5
    ctl = controller()
    drive(ctl, range(3))
    words = ctl.run_summary(est)["dsv/summary"]
    assert "cost ~32.5% of the stage-2 steps (a plain step 1000.0 ms, predictor steps +30%, profile steps" in words
    kinds = [step_kind(ctl.record(SHAPE, step=s, profile=p)) for s, p in ((3, False), (4, False), (10, True))]
    assert kinds == ["plain", "predictor", "profile"] and step_kind({"loss": 1.0}) is None


def _op_counts(compiled) -> collections.Counter:
    return collections.Counter(re.findall(r"= \S+ ([a-z][\w-]*)\(", compiled.as_text()))


def test_a_backed_off_step_runs_the_program_of_full_attention():
    """A stage-2 step that neither trains the predictor nor profiles compiles to full attention's program:
    the same operations (the predictor's weights and AdamW state only pass through) and the same FLOPs."""
    from dsv_jax.parallel.mesh import make_mesh
    from dsv_jax.train.step import abstract_model, state_layout
    from dsv_jax.train.trainer import batch_spec, lower_train_step

    common = ("model.patch=[1,2,2]", "data.buckets=[[4,16,16]]", "data.bucket_weights=[1]")
    dsv = small_config("attention=dsv", "dsv.rank=4", "dsv.stage1_steps=1", "dsv.profile_every=2", *common)
    ctl = DSVController(dsv)
    ctl.before_step(1)
    for step in (2, 4):
        ctl.observe(step, SHAPE, {"dsv/predictor_loss": np.ones(2), "dsv/sparsity": np.zeros((2, 2))})
    step = next(s for s in range(5, 99) if not ctl.trains_predictor(s, False, SHAPE) and not ctl.profile_due(s, SHAPE))
    assert ctl.intervals(SHAPE)[1] > dsv.dsv.stage2_predictor_every  # backed off

    def lowered(cfg, attention, inputs=None):
        mesh = make_mesh(cfg.parallel, jax.devices()[:1])
        graphdef = abstract_model(cfg)[0]
        state, sharding = state_layout(cfg, mesh)
        batch = batch_spec(cfg, mesh, 1, SHAPE)
        if inputs is not None:
            inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), inputs)
        return lower_train_step(cfg, graphdef, attention, state, sharding, batch, inputs)

    full = lowered(small_config(*common), "auto")
    backed_off = lowered(dsv, ctl.plans(SHAPE, step=step), ctl.inputs(SHAPE, step=step))
    dots = lambda low: low.as_text().count("dot_general")
    # the predictor's step computes more (the program before XLA's optimisations)
    predictor = lowered(dsv, ctl.plans(SHAPE, step=0), ctl.inputs(SHAPE, step=0))
    assert dots(predictor) > dots(backed_off) == dots(full)
    full, backed_off = full.compile(), backed_off.compile()
    ops_full, ops_dsv = _op_counts(full), _op_counts(backed_off)
    assert ops_full["dot"] > 0
    assert {k for k in ops_full.keys() | ops_dsv.keys() if ops_full[k] != ops_dsv[k]} == {"parameter"}
    assert backed_off.cost_analysis()["flops"] == full.cost_analysis()["flops"]


def test_the_trainer_backs_off_leaves_the_predictor_alone_and_says_so(tmp_path):
    """Every block dense (threshold 0.99): stage 2 from step 1, profiles at 0 (stage 1), 2 and 6 (back-off
    to every 4th, then 8th step), the predictor on steps 1, 2, 4, 6, 8, 12; on steps 9-11 the model trains and
    the predictor is untouched; the end-of-run summary counts it all."""
    from dsv_jax.train.metrics import read_metrics
    from dsv_jax.train.optimizer import param_labels
    from dsv_jax.train.trainer import Trainer

    cfg = small_config(
        "attention=dsv",
        "dsv.rank=4",
        "dsv.stage1_steps=1",
        "dsv.profile_every=2",
        "dsv.stage2_predictor_every=1",
        "dsv.backoff_max_every=8",
        "dsv.threshold=0.99",
        "data.buckets=[[4,16,16]]",
        "data.bucket_weights=[1]",
        "train.steps=14",  # not reached: no end-of-run evaluation
        "train.ckpt_every=100",
    )
    trainer = Trainer(cfg, str(tmp_path), progress=False)
    labels = jax.tree.leaves(param_labels(trainer.state.params))

    def params():
        leaves = [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]
        return [x for x, lab in zip(leaves, labels) if lab == "predictor"], [
            x for x, lab in zip(leaves, labels) if lab == "main"
        ]

    trainer.run(stop_at=9)
    predictor9, main9 = params()
    trainer.run(stop_at=12)  # steps 9, 10, 11: neither predictor nor profile
    predictor12, main12 = params()
    assert all(np.array_equal(a, b) for a, b in zip(predictor9, predictor12))
    assert np.mean([not np.array_equal(a, b) for a, b in zip(main9, main12)]) > 0.5
    trainer.run(stop_at=13)  # step 12 trains the predictor
    assert not all(np.array_equal(a, b) for a, b in zip(predictor12, params()[0]))
    trainer.close()
    records = read_metrics(str(tmp_path))
    steps = [r for r in records if "loss" in r]
    trained = [r["step"] - 1 for r in steps if r["dsv/predictor_step"]]
    assert trained == [0, 1, 2, 4, 6, 8, 12]
    assert [r["step"] - 1 for r in steps if "dsv/predictor_loss" in r] == trained
    assert [r["step"] - 1 for r in steps if r["dsv/profile_step"]] == [0, 2, 6]
    assert [r["dsv/profile_every"] for r in steps] == [2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8, 8, 8]
    summary = [r for r in records if "dsv/summary" in r][-1]
    assert summary["dsv/predictor_steps"] == 7 and summary["dsv/profile_steps"] == 3
    assert "the predictor trained on 7 of 13 steps, 3 profiled" in summary["dsv/summary"]
    assert "back-off reached profiles every 8 steps" in summary["dsv/summary"]
    assert "of the stage-2 steps (a plain step" in summary["dsv/summary"]  # measured: plain steps ran


def test_a_run_stopped_by_a_signal_still_writes_the_dsv_summary(tmp_path, monkeypatch):
    """The stop path (SIGTERM / Ctrl-C on any process) saves and then records what DSV did, like a finished run."""
    import dsv_jax.train.trainer as trainer_module
    from dsv_jax.train.metrics import read_metrics
    from dsv_jax.train.trainer import Trainer

    cfg = small_config(
        "attention=dsv",
        "dsv.rank=4",
        "dsv.stage1_steps=1",
        "data.buckets=[[4,16,16]]",
        "data.bucket_weights=[1]",
        "train.steps=10",
        "train.ckpt_every=100",
    )
    polls = iter(range(100))
    monkeypatch.setattr(trainer_module, "any_process", lambda requested: next(polls) >= 3)  # a signal after 3 steps
    trainer = Trainer(cfg, str(tmp_path), progress=False)
    trainer.run()
    trainer.close()
    assert trainer.stop_signal is not None and int(trainer.state.step) == 3
    summary = [r for r in read_metrics(str(tmp_path)) if "dsv/summary" in r]
    assert summary and summary[-1]["dsv/predictor_steps"] >= 1
    assert "of 3 steps" in summary[-1]["dsv/summary"]
