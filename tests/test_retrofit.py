"""DSV retrofitted onto pretrained weights: `train --init-from` (an export's weights, its config as the default,
the mismatch error, a checkpoint's precedence), `dsv.freeze_model_stage1` (stage 1 trains the predictors alone,
bitwise), the per-block recall and keep ratios of the end-of-run summary, and every command of wan.md's
"DSV on a pretrained Wan model" run at tiny sizes."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from tests.conftest import small_config

FREEZE_RUN = [
    "attention=dsv",
    "dsv.rank=4",
    "dsv.freeze_model_stage1=true",
    "dsv.stage1_steps=3",
    "dsv.profile_every=2",
    "data.buckets=[[4,16,16]]",
    "data.bucket_weights=[1]",
    "train.ema_decay=0.9",
    "train.steps=5",
    "train.ckpt_every=100",
]


def _leaves(params) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def test_stage_one_trains_the_predictors_alone_bitwise(tmp_path):
    """Three stage-1 steps leave every parameter but the predictors' (and their EMA) bitwise as they were,
    weight decay and all; the predictors move; stage 2 then trains the model."""
    from dsv_jax.train.trainer import Trainer

    trainer = Trainer(small_config(*FREEZE_RUN), str(tmp_path / "run"), progress=False)
    try:
        start, start_ema = _leaves(trainer.state.params), _leaves(trainer.state.ema)
        records = trainer.run(stop_at=3)
        assert [r["dsv/stage"] for r in records if "loss" in r] == [1, 1, 1]
        after, after_ema = _leaves(trainer.state.params), _leaves(trainer.state.ema)
        predictor = {k for k in start if "predictor" in k}
        assert predictor and len(predictor) < len(start)
        for k in start:
            if k in predictor:
                assert not np.array_equal(after[k], start[k]), k
            else:
                assert after[k].tobytes() == start[k].tobytes(), k
                assert after_ema[k].tobytes() == start_ema[k].tobytes(), k
        assert all(r["grad_norm"] == 0 for r in records if "loss" in r)  # no gradient reached the model
        records = trainer.run()
        assert [r["dsv/stage"] for r in records if "loss" in r] == [2, 2]
        moved = _leaves(trainer.state.params)
        changed = [k for k in start if k not in predictor and not np.array_equal(moved[k], start[k])]
        assert len(changed) > (len(start) - len(predictor)) // 2  # (AdaLN-Zero's gated paths wait for their gates)
    finally:
        trainer.close()


def write_export(out, cfg, dtype="bfloat16", shift=0.25) -> str:
    """An export folder of cfg's model (its random init moved by `shift`, so that a run's own init of the same
    seed never equals it), as `dsv-jax export` writes one; no training."""
    from flax import nnx

    from dsv_jax.export import write_export as write
    from dsv_jax.train.step import init_state

    params = jax.tree.map(lambda a: (a + shift).astype(dtype), nnx.to_pure_dict(init_state(cfg).params))
    meta = {"step": 0, "dtype": dtype, "weights": "raw", "source": "test", "text_encoder": None, "attention": {}}
    write(str(out), cfg, params, meta)
    return str(out)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A dense model's export (bf16) and a DSV model's (fp32, with predictors of rank 4)."""
    root = tmp_path_factory.mktemp("exports")
    dense = write_export(root / "dense", small_config())
    dsv = write_export(root / "dsv", small_config("attention=dsv", "dsv.rank=4"), dtype="float32", shift=-0.5)
    return {"dense": dense, "dsv": dsv}


@pytest.mark.parametrize("source", ["dense", "dsv"])
def test_init_from_loads_the_exports_weights_into_a_fresh_state(exports, source, tmp_path):
    """A DSV run from a dense export: its weights (bf16, as float32 master weights), fresh predictors; from a
    DSV export: the predictors too. Step, optimizer moments and EMA start afresh (the EMA: the loaded weights)."""
    from dsv_jax.export import load_params
    from dsv_jax.train.step import init_state
    from dsv_jax.train.trainer import Trainer

    cfg = small_config("attention=dsv", "dsv.rank=4", "train.ema_decay=0.9", f"train.init_from={exports[source]}")
    trainer = Trainer(cfg, str(tmp_path / "run"), progress=False)
    try:
        got, ema = _leaves(trainer.state.params), _leaves(trainer.state.ema)
        saved = _leaves(load_params(exports[source])[2])
        fresh = _leaves(jax.jit(lambda: init_state(cfg))().params)  # what create_state gives the predictors
        for k, v in got.items():
            assert v.dtype == np.float32 and ema[k].tobytes() == v.tobytes(), k
            if k in saved:
                assert v.tobytes() == np.asarray(saved[k], np.float32).tobytes(), k
            else:
                np.testing.assert_allclose(v, fresh[k], rtol=1e-6, atol=1e-7, err_msg=k)
        assert any("predictor" in k for k in got) and (source == "dsv") == all(k in saved for k in got)
        assert int(trainer.state.step) == 0
        assert all(not np.any(np.asarray(m)) for m in jax.tree.leaves(trainer.state.opt_state) if np.ndim(m) > 0)
    finally:
        trainer.close()


def run_cli(*argv) -> tuple[int, str]:
    """`dsv-jax ARGV` in this process: (exit status, stderr)."""
    import contextlib
    import io

    from dsv_jax.cli import main

    err, malloc = io.StringIO(), os.environ.get("DSV_JAX_HOST_MALLOC")
    os.environ["DSV_JAX_HOST_MALLOC"] = "system"  # the CLI's malloc settings are for a process of its own
    try:
        with contextlib.redirect_stderr(err):
            code = main(list(argv))
    finally:
        if malloc is None:
            del os.environ["DSV_JAX_HOST_MALLOC"]
        else:
            os.environ["DSV_JAX_HOST_MALLOC"] = malloc
    return code, err.getvalue()


def test_init_from_config_mismatch_and_non_export_stop_in_one_line_before_writing(exports, tmp_path):
    wd = tmp_path / "run"
    code, err = run_cli("train", "--config", "tiny", "--init-from", exports["dense"], "--workdir", str(wd))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "model.hidden=128" in err and "model.hidden=32" in err and "config.json" in err, err
    code, err = run_cli("train", "--init-from", str(tmp_path), "--workdir", str(wd))  # no export.json there
    assert code == 2 and len(err.strip().splitlines()) == 1 and "export.json" in err, err
    code, err = run_cli("train", "--init-from", exports["dense"], "--workdir", str(wd), "model.depth=3")
    assert code == 2 and "model.depth=3" in err and "model.depth=2" in err, err
    assert not wd.exists()


def test_init_from_takes_the_exports_config_and_a_checkpoint_wins(exports, tmp_path, caplog):
    """Without --config the run is the export's config (its model, data, train sections) with the overrides;
    rerun on its checkpoint it resumes, and --init-from (here an export of another model) is ignored."""
    import logging

    from dsv_jax.config import load_config

    wd = str(tmp_path / "run")
    code, err = run_cli("train", "--init-from", exports["dense"], "--workdir", wd, "--steps", "2", "--no-progress")
    assert code == 0, err
    with open(os.path.join(wd, "config.json")) as f:
        saved = json.load(f)
    assert saved["model"] == json.loads(small_config().to_json())["model"]  # the export's model, not tiny's
    assert saved["train"]["init_from"] == exports["dense"] and saved["train"]["steps"] == 2
    other = write_export(tmp_path / "other", small_config("model.depth=3"))  # would be refused if it were read
    assert load_config(os.path.join(wd, "config.json")).model.depth == 2
    with caplog.at_level(logging.INFO, logger="dsv_jax"):
        code, err = run_cli(
            "train", "--config", os.path.join(wd, "config.json"), "--init-from", other, "--workdir", wd, "--steps", "3"
        )
    assert code == 0, err
    assert f"train.init_from={other} is ignored" in caplog.text and "resumed from step 2" in caplog.text
