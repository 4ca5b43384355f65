import glob
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv_jax.config import ConfigError
from dsv_jax.data.feed import tokens_per_sample
from dsv_jax.model.flops import PEAK_ENV, train_step_flops
from dsv_jax.train.checkpoint import Checkpointer, CheckpointError, IncompatibleCheckpoint, load_trained
from dsv_jax.train.guard import TrainingDiverged
from dsv_jax.train.metrics import read_metrics
from dsv_jax.train.trainer import Trainer, train
from tests.conftest import small_config


def losses(records):
    return [(r["step"], r["bucket"], r["loss"]) for r in records if "loss" in r]


def params_of(workdir, cfg):
    trainer = Trainer(cfg, workdir, progress=False)
    try:
        return jax.device_get(trainer.state.params)
    finally:
        trainer.close()


def test_resume_gives_the_same_run(tmp_path):
    # with an EMA of the weights: a resume that did not restore it (e.g. started it from the restored
    # parameters) would end with another EMA
    cfg = small_config("train.steps=20", "train.ckpt_every=5", "train.ema_decay=0.9")
    straight = train(cfg, str(tmp_path / "straight"), progress=False)
    first = train(cfg, str(tmp_path / "split"), stop_at=10, progress=False)
    second = train(cfg, str(tmp_path / "split"), progress=False)
    assert [s for s, *_ in losses(first)] == list(range(1, 11))
    assert [s for s, *_ in losses(second)] == list(range(11, 21))
    a, b = losses(straight), losses(first) + losses(second)
    assert [x[:2] for x in a] == [x[:2] for x in b]  # same steps, same bucket per step
    assert len({x[1] for x in a}) == 2
    np.testing.assert_allclose([x[2] for x in a], [x[2] for x in b], rtol=1e-5)
    # read from the checkpoints as sampling reads them (a Trainer would restore, i.e. could rebuild, the EMA)
    split = {}
    for weights in ("raw", "ema"):
        pa, pb = (
            jax.tree.leaves(jax.device_get(load_trained(str(tmp_path / run), weights=weights)[2]))
            for run in ("straight", "split")
        )
        assert len(pa) == len(pb) > 10
        for x, y in zip(pa, pb):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
        split[weights] = pb
    # the EMA lags the weights by far more than the tolerance above (it is not a copy of them)
    assert max(float(np.max(np.abs(e - p))) for e, p in zip(split["ema"], split["raw"])) > 1e-4
    # everything a user expects in the workdir
    names = set(os.listdir(tmp_path / "split"))
    assert {"checkpoints", "metrics.jsonl", "tensorboard", "config.json"} <= names
    assert any(r.get("eval_loss") for r in read_metrics(str(tmp_path / "split")))
    # one Trainer run in rounds (as experiments/sparsity_emergence.py does) continues where it stopped
    rounds = Trainer(cfg, str(tmp_path / "rounds"), progress=False)
    c = losses(rounds.run(stop_at=7)) + losses(rounds.run(stop_at=13)) + losses(rounds.run())
    rounds.close()
    assert [x[:2] for x in c] == [x[:2] for x in a]
    np.testing.assert_allclose([x[2] for x in c], [x[2] for x in a], rtol=1e-5)


def test_loss_decreases_on_eight_devices_with_fsdp(tmp_path):
    cfg = small_config(
        "train.steps=40", "train.lr=3e-3", "model.hidden=64", "data.buckets=[[4,16,16]]", "data.bucket_weights=[1]"
    )
    trainer = Trainer(cfg, str(tmp_path), progress=False)
    assert trainer.mesh.shape == {"data": 1, "fsdp": 8, "context": 1}
    sharded = [x for x in jax.tree.leaves(trainer.state.params) if "fsdp" in str(x.sharding.spec)]
    assert sharded, "no parameter is sharded over fsdp"
    records = trainer.run()
    trainer.close()
    first, last = np.mean([r["loss"] for r in records[:5]]), np.mean([r["loss"] for r in records[-5:]])
    assert last < 0.8 * first, (first, last)
    assert all(r["batch"] % 8 == 0 for r in records if "batch" in r)


def test_restore_onto_fewer_devices(tmp_path):
    cfg = small_config("train.steps=4")
    train(cfg, str(tmp_path), progress=False)
    saved = params_of(str(tmp_path), cfg)
    more = small_config("train.steps=6")
    trainer = Trainer(more, str(tmp_path), devices=jax.devices()[:4], progress=False)
    assert trainer.mesh.devices.size == 4 and int(trainer.state.step) == 4
    for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(jax.device_get(trainer.state.params))):
        np.testing.assert_array_equal(x, y)
    records = trainer.run()
    trainer.close()
    assert [r["step"] for r in records if "loss" in r] == [5, 6]


def test_single_device_mesh_logs_tflops_and_mfu(tmp_path, monkeypatch):
    monkeypatch.setenv(PEAK_ENV, "0.5")  # a CPU has no peak in the table: pretend 0.5 TFLOP/s
    cfg = small_config("train.steps=2", "parallel.fsdp=1")
    trainer = Trainer(cfg, str(tmp_path), progress=False)
    assert trainer.mesh.devices.size == 1
    records = [r for r in trainer.run() if "loss" in r]
    trainer.close()
    assert len(records) == 2
    logged = read_metrics(str(tmp_path))
    for rec in records:  # log_every=1: each record's window is its own step
        shape = tuple(int(v) for v in rec["bucket"].split("x"))
        flops = train_step_flops(cfg, shape, rec["batch"])
        assert rec["tflops_per_device"] * 1e12 * rec["step_time"] == pytest.approx(flops["dense_equiv"], rel=1e-6)
        assert rec["tflops_per_device/work"] * 1e12 * rec["step_time"] == pytest.approx(flops["work"], rel=1e-6)
        assert rec["mfu/dense_equiv"] == pytest.approx(rec["tflops_per_device"] / 0.5)
        assert rec["mfu/work"] == pytest.approx(rec["tflops_per_device/work"] / 0.5)
        assert any(m["step"] == rec["step"] and m.get("mfu/work") == rec["mfu/work"] for m in logged)


def test_step_time_leaves_out_evaluation_and_saving(tmp_path, monkeypatch):
    import time

    pause = 4.0
    cfg = small_config("train.steps=4", "train.log_every=2", "train.eval_every=2", "train.ckpt_every=2", *ONE_BUCKET)
    trainer = Trainer(cfg, str(tmp_path), progress=False)
    slow = lambda *a, **kw: time.sleep(pause) or {}
    monkeypatch.setattr(trainer, "evaluate", slow)
    monkeypatch.setattr(trainer, "save", lambda *a, **kw: time.sleep(pause))
    start = time.perf_counter()
    records = [r for r in trainer.run() if "loss" in r]
    wall = time.perf_counter() - start
    trainer.close()
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # steps 3-4 share a window with the evaluation and the save at step 2 (8 s beside two steps): counted,
    # they would give >= 4 s a step
    steps_s = sum(r["step_time"] for r in records)
    assert records[-1]["step_time"] < pause / 2 and steps_s < wall - 2 * pause
    tokens = records[-1]["batch"] * tokens_per_sample((4, 16, 16), cfg.model.patch)
    assert records[-1]["tokens_per_s"] == pytest.approx(tokens / records[-1]["step_time"], rel=1e-6)


def test_non_finite_step_is_skipped_and_never_saved(tmp_path):
    cfg = small_config("train.steps=3", "train.ema_decay=0.5")
    trainer = Trainer(cfg, str(tmp_path), progress=False)
    batch = trainer.feed.batch_at(0, (1, 16, 16))
    # a good step first, so that the EMA and the weights differ
    trainer.state, metrics = trainer.compiled_step((1, 16, 16))(
        trainer.state, trainer.to_global(batch), np.float32(1e-3)
    )
    assert bool(metrics["finite"])
    before, ema_before = jax.device_get((trainer.state.params, trainer.state.ema))
    bad = dict(batch, latents=np.full_like(batch["latents"], np.nan))
    state, metrics = trainer.compiled_step((1, 16, 16))(trainer.state, trainer.to_global(bad), np.float32(1e-3))
    assert not bool(metrics["finite"]) and int(state.skipped) == 1 and int(state.step) == 2
    for x, y in zip(jax.tree.leaves((before, ema_before)), jax.tree.leaves(jax.device_get((state.params, state.ema)))):
        np.testing.assert_array_equal(x, y)
    trainer.state = state
    trainer.save({"position": 0})
    trainer.checkpointer.wait()
    assert trainer.checkpointer.latest_step() == 2
    # a NaN parameter is refused, and the good checkpoint stays the latest
    poisoned = state.replace(step=state.step + 1, params=jax.tree.map(lambda p: p * jnp.nan, state.params))
    assert trainer.checkpointer.save(3, poisoned, {"position": 1}, cfg) is False
    trainer.checkpointer.wait()
    assert trainer.checkpointer.latest_step() == 2
    trainer.close()


def test_incompatible_checkpoint_names_the_fields(tmp_path):
    train(small_config("train.steps=1"), str(tmp_path), progress=False)
    with pytest.raises(IncompatibleCheckpoint, match=r"model.depth: checkpoint 2 != requested 3"):
        Trainer(small_config("train.steps=2", "model.depth=3"), str(tmp_path), progress=False)
    # the checkpoint is still there and still loads with the right config
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step() == 1
    assert params_of(str(tmp_path), small_config("train.steps=1")) is not None


def test_unwritable_workdir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PermissionError, match="not writable"):
        Trainer(small_config(), str(blocker / "run"), progress=False)


ONE_BUCKET = ("data.buckets=[[4,16,16]]", "data.bucket_weights=[1]")  # one compile per run


def truncate(path, size=None):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2 if size is None else size)


def test_corrupt_newest_checkpoint_falls_back_and_the_log_follows(tmp_path, caplog):
    """A truncated file in the newest checkpoint: one line names it and why, the newest readable step is
    restored, the unreadable one is moved aside (not deleted). metrics.jsonl, which had records past the
    restored step and a line torn by a kill, holds every step once after the resumed run. And the host
    waits for each step before dispatching the next, so SIGTERM meets at most the step running."""
    wd = str(tmp_path)
    train(small_config("train.steps=4", "train.ckpt_every=2", *ONE_BUCKET), wd, progress=False)
    for chunk in glob.glob(os.path.join(wd, "checkpoints", "4", "state", "**", "d", "*"), recursive=True):
        truncate(chunk)
    with open(os.path.join(wd, "metrics.jsonl"), "a") as f:
        f.write('{"step": 5, "loss": 0.')  # torn by kill -9

    caplog.set_level(logging.INFO, logger="dsv_jax")
    trainer = Trainer(
        small_config("train.steps=6", "train.ckpt_every=2", "train.log_every=10", *ONE_BUCKET), wd, progress=False
    )
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert (
        len(errors) == 1
        and errors[0].startswith("checkpoint step 4 cannot be read: ")
        and os.path.join(wd, "checkpoints", "4", "state") in errors[0]
        and "byte range" in errors[0]
    ), errors
    assert int(trainer.state.step) == 2 and trainer.checkpointer.all_steps() == [2]
    assert os.path.isdir(os.path.join(wd, "checkpoints-set-aside", "4", "state"))

    compiled, previous = trainer.compiled_step, []

    def checked_step(shape, plans=None):
        fn = compiled(shape, plans)

        def call(*args):
            assert all(x.is_ready() for x in jax.tree.leaves(previous)), "dispatched ahead of a running step"
            out = fn(*args)
            previous[:] = [out[1]["loss"]]
            return out

        return call

    trainer.compiled_step = checked_step
    trainer.run()
    trainer.close()
    steps = [r["step"] for r in read_metrics(wd) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert trainer.checkpointer.all_steps() == [2, 4, 6] and trainer.checkpointer.is_good(4)

    # an empty config/metadata is named; sampling falls back past it, or fails on it when asked for it
    open(os.path.join(wd, "checkpoints", "6", "config", "metadata"), "w").close()
    caplog.clear()
    assert load_trained(wd)[-1] == 4
    assert any(r.getMessage().endswith("6/config/metadata: empty file") for r in caplog.records)
    with pytest.raises(CheckpointError, match=r"checkpoint step 6 cannot be read: .*6/config/metadata: empty file"):
        load_trained(wd, step=6)


def test_garbage_weights_stop_the_run_and_keep_the_last_good_checkpoint(tmp_path):
    """A learning rate far too high: the run stops after train.max_bad_steps bad steps with a message
    naming the last good checkpoint; the checkpoint saved just before (its first loss was bad) is
    rejected, rotation (keep 1) kept the good one, no sample is written, and a rerun resumes from it."""
    wd = str(tmp_path)
    train(small_config("train.steps=2", *ONE_BUCKET), wd, progress=False)
    wild = small_config(
        "train.steps=30",
        "train.lr=1e6",
        "train.ckpt_every=1",
        "train.keep_checkpoints=1",
        "train.max_bad_steps=3",
        "train.sample_at_end=true",
        "train.sample_steps=2",
        *ONE_BUCKET,
    )
    with pytest.raises(
        TrainingDiverged,
        match=r"training stopped at step 6: 3 bad step\(s\) in a row.*"
        r"the last good checkpoint is step 2",
    ):
        train(wild, wd, progress=False)
    ckpt = Checkpointer(os.path.join(wd, "checkpoints"))
    assert ckpt.all_steps() == [2, 3] and ckpt.is_good(2) and ckpt.validation(3)["status"] == "rejected"
    assert not os.path.exists(os.path.join(wd, "samples"))
    ckpt.close()
    trainer = Trainer(small_config("train.steps=3", *ONE_BUCKET), wd, progress=False)  # restores only
    assert int(trainer.state.step) == 2
    assert os.listdir(os.path.join(wd, "checkpoints-set-aside")) == ["3"]
    trainer.close()


def test_eval_batches_zero_trains_without_a_held_out_loss(tmp_path):
    """train.eval_batches=0 turns the held-out loss off, at eval_every and at the end of the run (it crashed)."""
    cfg = small_config("train.steps=2", "train.eval_every=1", "train.eval_batches=0", *ONE_BUCKET)
    records = train(cfg, str(tmp_path), progress=False)
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    logged = read_metrics(str(tmp_path))
    assert not any(k.startswith(("eval_loss", "train_records_loss")) for r in logged for k in r)
    with pytest.raises(ConfigError, match="train.eval_batches=-1 must be >= 0"):
        small_config("train.eval_batches=-1")
