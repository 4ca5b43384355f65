"""DSV end to end: the CLI reaches stage 2 on a padded bucket, an export carries its plans, and a
restore mid stage 2 continues identically."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import SMALL, small_config

DSV_RUN = [
    "attention=dsv",
    "dsv.rank=4",
    "dsv.stage1_steps=3",
    "dsv.profile_every=2",
    "dsv.threshold=0.2",
    "dsv.ladder=[0.5,1.0]",
    "data.buckets=[[4,16,20]]",
    "data.bucket_weights=[1]",
    "model.patch=[1,2,2]",
    "model.arch=mmdit",
    "model.adaln=single",
    "train.ckpt_every=5",
    "train.steps=7",
]


def test_cli_run_reaches_stage_two_and_resume_mid_stage_two_is_identical(tmp_path):
    """`dsv-jax train attention=dsv` (MMDiT: sparse video-video, dense text) switches after the configured
    stage-1 steps and logs it; a run stopped at step 5 (stage 2) and resumed gives the same steps. The
    bucket's token grid (4, 8, 10) does not divide into 2x4x4 tiles: stage 2 runs sparse on padded tiles."""
    from dsv_jax.train.metrics import read_metrics
    from dsv_jax.train.trainer import Trainer, train

    wd = str(tmp_path / "cli")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv_jax",
            "train",
            "--config",
            "tiny",
            "--workdir",
            wd,
            "--no-progress",
            *SMALL,
            *DSV_RUN,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "DSV stage 2 from step 3 (after 3 stage-1 steps)" in r.stderr
    recs = read_metrics(wd)
    steps = [x for x in recs if "loss" in x]
    assert [x["dsv/stage"] for x in steps] == [1, 1, 1, 2, 2, 2, 2]
    assert all(x["dsv/sparse_blocks"] == 2 for x in steps[3:])  # every block sparse in stage 2
    assert "dsv/predictor_loss/block1" in steps[0] and "dsv/sparsity/block0/head1" in steps[0]
    assert 0 < steps[4]["dsv/recall"] <= 1 and "dsv/recall/block1" in steps[4]
    # stage 2 trains the predictor on every 4th step (dsv.stage2_predictor_every) and on profile steps
    profiled = ["dsv/recall" in x for x in steps]
    assert [("dsv/predictor_loss" in x) for x in steps[3:]] == [
        p or (x["step"] - 1) % 4 == 0 for p, x in zip(profiled[3:], steps[3:])
    ]
    assert not all("dsv/predictor_loss" in x for x in steps[3:])
    assert any("stage 2" in x.get("dsv/event", "") for x in recs) and any("eval_loss" in x for x in recs)
    # an export carries the stage-2 decisions: the loaded model runs the trained sparse plans
    from dsv_jax.export import export, load_model

    loaded = load_model(export(wd, str(tmp_path / "model")))
    plans = loaded.attention_for((4, 16, 20))[0]
    assert loaded.dsv_state["stage"] == 2 and len(plans) == 2 and all(p.sparse for p in plans)
    with open(tmp_path / "model" / "export.json") as f:
        assert json.load(f)["attention"] == {"4x16x20": [f"dsv keep<={p.keep:g}" for p in plans]}

    cfg = small_config(*DSV_RUN)
    train(cfg, str(tmp_path / "split"), stop_at=5, progress=False)
    trainer = Trainer(cfg, str(tmp_path / "split"), progress=False)
    assert trainer.policy.stage == 2 and trainer.policy.switch_step == 3 and int(trainer.state.step) == 5
    curves = trainer.policy.state_dict()["shapes"]["4x16x20"]["recall_curve"]  # profiled in training
    assert all(c is not None and np.isfinite(c).all() for c in curves), curves
    trainer.close()
    train(cfg, str(tmp_path / "split"), progress=False)
    keys = ("loss", "grad_norm", "dsv/predictor_loss", "dsv/sparse_blocks", "dsv/stage")
    resumed = [x for x in read_metrics(str(tmp_path / "split")) if "loss" in x]
    assert [x["step"] for x in resumed] == list(range(1, 8))
    np.testing.assert_allclose(
        [[x.get(k, np.nan) for k in keys] for x in resumed],
        [[x.get(k, np.nan) for k in keys] for x in steps],
        rtol=1e-5,
    )
    assert resumed[4]["dsv/recall"] == pytest.approx(steps[4]["dsv/recall"], rel=1e-5)
