"""The EMA of the weights (train.ema_decay): its update in the train step, what a checkpoint holds, resuming
across a change of ema_decay, and that everything which samples or evaluates a run uses it."""

import json
import logging
import os

import jax
import numpy as np
import pytest
from flax import nnx

from dsv_jax.evaluate import evaluate_workdir
from dsv_jax.export import export, load_model
from dsv_jax.sample import sample_from_workdir
from dsv_jax.train.checkpoint import NoEMA, load_trained
from dsv_jax.train.metrics import read_metrics
from dsv_jax.train.step import ema_decay_at, init_state, state_layout
from dsv_jax.train.trainer import Trainer, train
from tests.conftest import small_config
from tests.test_cli import run_cli

ONE_BUCKET = ("data.buckets=[[4,16,16]]", "data.bucket_weights=[1]")  # one compile per run


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def assert_same(a, b):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb) > 10
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(leaves(a), leaves(b)))


def test_decay_schedule():
    warm = small_config("train.ema_decay=0.999").train
    assert float(ema_decay_at(warm, 0)) == pytest.approx(0.1)
    assert float(ema_decay_at(warm, 80)) == pytest.approx(0.9)
    assert float(ema_decay_at(warm, 10**6)) == pytest.approx(0.999)
    flat = small_config("train.ema_decay=0.999", "train.ema_warmup=false").train
    assert float(ema_decay_at(flat, 0)) == pytest.approx(0.999)


def test_the_step_updates_the_ema_and_without_it_there_is_no_copy(tmp_path):
    cfg = small_config("train.steps=2", "train.ema_decay=0.9", "train.lr=3e-3", *ONE_BUCKET)
    trainer = Trainer(cfg, str(tmp_path), progress=False)
    ema0 = jax.device_get(trainer.state.ema)
    assert_same(ema0, trainer.state.params)  # it starts as the initial weights
    batch = trainer.to_global(trainer.feed.batch_at(0, (4, 16, 16)))
    state, metrics = trainer.compiled_step((4, 16, 16))(trainer.state, batch, np.float32(3e-3))
    trainer.state = state
    decay = 0.1  # the warmup's first decay, min(0.9, 1 / 10)
    assert float(metrics["ema_decay"]) == pytest.approx(decay)
    for e0, p1, e1 in zip(jax.tree.leaves(ema0), leaves(state.params), leaves(state.ema)):
        np.testing.assert_allclose(e1, decay * e0 + (1 - decay) * p1, rtol=1e-6, atol=1e-7)
    assert max_diff(state.ema, state.params) > 1e-4
    trainer.close()
    # ema_decay=0: no EMA and no second copy of the weights, in the state or its checkpoint layout
    plain = small_config(*ONE_BUCKET)
    assert init_state(plain).ema is None
    with_ema, _ = state_layout(cfg, trainer.mesh)
    without, _ = state_layout(plain, trainer.mesh)
    assert without.ema is None
    assert len(jax.tree.leaves(with_ema)) == len(jax.tree.leaves(without)) + len(jax.tree.leaves(without.params))


def forget_ema_fields(workdir, step):
    """Make a checkpoint look as if written before train.ema_decay existed (its saved config lacks the fields)."""
    path = os.path.join(workdir, "checkpoints", str(step), "config", "metadata")
    with open(path) as f:
        saved = json.load(f)
    del saved["train"]["ema_decay"], saved["train"]["ema_warmup"]
    with open(path, "w") as f:
        json.dump(saved, f)


def test_resume_across_a_change_of_ema_decay(tmp_path, caplog):
    wd = str(tmp_path)
    train(small_config("train.steps=2", *ONE_BUCKET), wd, progress=False)
    forget_ema_fields(wd, 2)
    with pytest.raises(NoEMA, match=r"has no EMA of the weights \(the run trained with train.ema_decay=0\)"):
        load_trained(wd, weights="ema")
    r = run_cli("eval", "--workdir", wd, "--clips", "0", "--weights", "ema", timeout=300)
    assert r.returncode == 2 and "has no EMA of the weights" in r.stderr and len(r.stderr.strip().splitlines()) <= 2, (
        r.stderr[-2000:]
    )

    # an (old) checkpoint without an EMA, resumed with one: it starts from the restored weights
    caplog.set_level(logging.INFO, logger="dsv_jax")
    with_ema = small_config("train.steps=3", "train.ema_decay=0.9", *ONE_BUCKET)
    trainer = Trainer(with_ema, wd, progress=False)
    assert int(trainer.state.step) == 2
    assert any(
        "checkpoint step 2 has no EMA of the weights" in r.getMessage()
        and "starts from its parameters" in r.getMessage()
        for r in caplog.records
    )
    assert_same(trainer.state.ema, trainer.state.params)
    trainer.run()
    ema, params = jax.device_get((trainer.state.ema, trainer.state.params))
    trainer.close()
    assert max_diff(ema, params) > 0
    _, _, loaded, _, step = load_trained(wd)
    assert step == 3
    assert_same(loaded, ema)
    assert_same(load_trained(wd, weights="raw")[2], params)

    # turned off again: the EMA is dropped (said so), and the run trains on
    caplog.clear()
    trainer = Trainer(small_config("train.steps=4", *ONE_BUCKET), wd, progress=False)
    assert trainer.state.ema is None
    assert any(
        "checkpoint step 3 has an EMA of the weights; train.ema_decay=0 drops it" in r.getMessage()
        for r in caplog.records
    )
    trainer.run()
    trainer.close()
    assert_same(load_trained(wd)[2], load_trained(wd, weights="raw")[2])  # step 4 has only the weights


def test_sampling_evaluation_and_export_use_the_ema(tmp_path, monkeypatch):
    import dsv_jax.sample

    wd = str(tmp_path / "run")
    cfg = small_config(
        "train.steps=4",
        "train.ema_decay=0.9",
        "train.lr=3e-3",
        "train.sample_at_end=true",
        "train.sample_steps=2",
        *ONE_BUCKET,
    )
    given = {}
    real = dsv_jax.sample.sample_from_state

    def recording(cfg, graphdef, params, path, **kw):
        given["params"] = params
        return real(cfg, graphdef, params, path, **kw)

    monkeypatch.setattr(dsv_jax.sample, "sample_from_state", recording)
    train(cfg, wd, progress=False)
    monkeypatch.undo()
    ema = load_trained(wd, weights="ema")[2]
    raw = load_trained(wd, weights="raw")[2]
    assert max_diff(ema, raw) > 1e-4
    assert_same(load_trained(wd)[2], ema)  # the default
    assert_same(given["params"], ema)  # the end-of-run GIF

    # dsv-jax sample: the default is the EMA, whose videos differ from the raw weights'
    def clip(name, weights):
        path = str(tmp_path / name)
        sample_from_workdir(wd, path, prompts=["a red circle moving left"], steps=2, weights=weights)
        with open(path, "rb") as f:
            return f.read()

    auto, from_ema, from_raw = clip("auto.gif", "auto"), clip("ema.gif", "ema"), clip("raw.gif", "raw")
    assert auto == from_ema != from_raw

    # held-out loss: the trainer logs both; dsv-jax eval reports the EMA's, or the raw weights' when asked
    logged = [r for r in read_metrics(wd) if "eval_loss" in r][-1]
    assert logged["eval_loss_ema"] != logged["eval_loss"]
    assert {k for k in logged if k.startswith("eval_loss_ema/")} == {
        k.replace("eval_loss/", "eval_loss_ema/") for k in logged if k.startswith("eval_loss/")
    }
    _, _, results = evaluate_workdir(wd, clips=0)
    assert results["weights"] == "ema"
    assert results["held_out"]["eval_loss"] == pytest.approx(logged["eval_loss_ema"], rel=1e-5)
    _, _, results = evaluate_workdir(wd, clips=0, weights="raw")
    assert results["weights"] == "raw"
    assert results["held_out"]["eval_loss"] == pytest.approx(logged["eval_loss"], rel=1e-5)

    # export / load_model: the EMA, named in export.json
    out = export(wd, str(tmp_path / "model"), dtype="fp32")
    with open(os.path.join(out, "export.json")) as f:
        assert json.load(f)["weights"] == "ema"
    assert_same(nnx.state(load_model(out).model, nnx.Param), ema)
    out = export(wd, str(tmp_path / "model-raw"), dtype="fp32", weights="raw")
    with open(os.path.join(out, "export.json")) as f:
        assert json.load(f)["weights"] == "raw"
    assert_same(nnx.state(load_model(out).model, nnx.Param), raw)


def test_a_checkpoint_saved_before_the_ema_existed_resumes(tmp_path, monkeypatch):
    """Checkpoints written before TrainState had an `ema` field hold the state dataclass's other five fields.
    Such a checkpoint (written here through that old dataclass) resumes, with or without an EMA asked for,
    and continues exactly like a checkpoint of today's layout."""
    import flax

    import dsv_jax.train.checkpoint as checkpoint

    @flax.struct.dataclass
    class OldTrainState:  # the train state as saved before train.ema_decay
        step: jax.Array
        params: object
        opt_state: object
        rng: jax.Array
        skipped: jax.Array

    cfg = small_config(*ONE_BUCKET, "train.steps=2", "train.ckpt_every=1")
    train(cfg, str(tmp_path / "new"), progress=False)
    new_layout = checkpoint._on_disk
    monkeypatch.setattr(
        checkpoint, "_on_disk", lambda s: OldTrainState(s.step, s.params, s.opt_state, s.rng, s.skipped)
    )
    train(cfg, str(tmp_path / "old"), progress=False)
    monkeypatch.setattr(checkpoint, "_on_disk", new_layout)
    meta = open(tmp_path / "old" / "checkpoints" / "2" / "state" / "_METADATA").read()
    assert "OldTrainState" in meta or "ema" not in meta  # written in the old layout
    for ema in ("0", "0.9"):
        longer = small_config(*ONE_BUCKET, "train.steps=3", "train.ckpt_every=1", f"train.ema_decay={ema}")
        states = []
        for run in ("old", "new"):
            trainer = Trainer(longer, str(tmp_path / run), progress=False)
            assert trainer.resumed_step == 2
            states.append(trainer.state)
            trainer.close()
        assert_same(states[0].params, states[1].params)
        assert (states[0].ema is None) == (ema == "0")
