import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv_jax.train.checkpoint import Checkpointer, IncompatibleCheckpoint
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
    cfg = small_config("train.steps=20", "train.ckpt_every=5")
    straight = train(cfg, str(tmp_path / "straight"), progress=False)
    first = train(cfg, str(tmp_path / "split"), stop_at=10, progress=False)
    second = train(cfg, str(tmp_path / "split"), progress=False)
    assert [s for s, *_ in losses(first)] == list(range(1, 11))
    assert [s for s, *_ in losses(second)] == list(range(11, 21))
    a, b = losses(straight), losses(first) + losses(second)
    assert [x[:2] for x in a] == [x[:2] for x in b]  # same steps, same bucket per step
    assert len({x[1] for x in a}) == 2
    np.testing.assert_allclose([x[2] for x in a], [x[2] for x in b], rtol=1e-5)
    pa, pb = params_of(str(tmp_path / "straight"), cfg), params_of(str(tmp_path / "split"), cfg)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
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
    cfg = small_config("train.steps=40", "train.lr=3e-3", "model.hidden=64", "data.buckets=[[4,16,16]]", "data.bucket_weights=[1]")
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


def test_single_device_mesh(tmp_path):
    cfg = small_config("train.steps=2", "parallel.fsdp=1")
    trainer = Trainer(cfg, str(tmp_path), progress=False)
    assert trainer.mesh.devices.size == 1
    assert len(trainer.run()) >= 2
    trainer.close()


def test_non_finite_step_is_skipped_and_never_saved(tmp_path):
    cfg = small_config("train.steps=3")
    trainer = Trainer(cfg, str(tmp_path), progress=False)
    batch = trainer.feed.batch_at(0, (1, 16, 16))
    before = jax.device_get(trainer.state.params)
    bad = dict(batch, latents=np.full_like(batch["latents"], np.nan))
    state, metrics = trainer.compiled_step((1, 16, 16))(trainer.state, trainer.to_global(bad), np.float32(1e-3))
    assert not bool(metrics["finite"]) and int(state.skipped) == 1 and int(state.step) == 1
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_array_equal(x, y)
    trainer.state = state
    trainer.save({"position": 0})
    trainer.checkpointer.wait()
    assert trainer.checkpointer.latest_step() == 1
    # a NaN parameter is refused, and the good checkpoint stays the latest
    poisoned = state.replace(step=state.step + 1, params=jax.tree.map(lambda p: p * jnp.nan, state.params))
    assert trainer.checkpointer.save(2, poisoned, {"position": 1}, cfg) is False
    trainer.checkpointer.wait()
    assert trainer.checkpointer.latest_step() == 1
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
