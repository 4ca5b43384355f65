"""Using a trained model: a run of a precomputed-text-encoder dataset with a held-out split, configured by
a YAML file and re-launched from its config.json, exported (CLI), loaded with dsv_jax.load_model and
sampled from the export with the text encoder hook."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import dsv_jax
from dsv_jax.config import load_config
from dsv_jax.data.prepare import prepare
from dsv_jax.export import export, load_model
from dsv_jax.train.checkpoint import load_trained
from dsv_jax.train.trainer import Trainer
from tests.data_helpers import BUCKETS, CHANNELS, CODEC, write_media
from tests.test_cli import metrics, run_cli
from tests.test_prepare import text_encoder_hook

HOOK = "tests.test_prepare:text_encoder_hook"  # [N, 5, 7] embeddings


def test_import_dsv_jax_stays_light_and_exports_load_model():
    r = subprocess.run(
        [sys.executable, "-c", "import sys, dsv_jax; print('jax' in sys.modules, dsv_jax.load_model.__module__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.split() == ["False", "dsv_jax.export"], r.stderr[-2000:]
    assert dsv_jax.load_model is load_model


def test_precomputed_run_from_a_config_file_exports_loads_and_samples(tmp_path):
    media, data = tmp_path / "media", tmp_path / "data"
    write_media(str(media), images=5, videos=3)
    prepare(
        str(media), str(data), BUCKETS, codec=CODEC, workers=1, text_encoder=HOOK, eval_fraction=0.25, progress=False
    )
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(f"""name: tiny
model: {{hidden: 32, heads: 2, depth: 2, text_dim: 7, patch: [1, 4, 4], in_channels: {CHANNELS}}}
text: {{encoder: precomputed, max_len: 5}}
data: {{path: {data}, workers: 0, tokens_per_batch: 64}}
parallel: {{fsdp: 1}}
train: {{steps: 2, log_every: 1, eval_batches: 1, warmup_steps: 1, sample_at_end: true, sample_steps: 2}}
""")
    wd = str(tmp_path / "run")
    r = run_cli("train", "--config", str(run_yaml), "--workdir", wd, "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trained to step 2" in r.stdout
    warnings = [line for line in r.stderr.splitlines() if "no end-of-run sample" in line]
    assert len(warnings) == 1 and "--text-encoder" in warnings[0]  # one line, and training succeeded
    recs = metrics(wd)
    assert any("eval_loss" in m for m in recs) and not any("train_records_loss" in m for m in recs)  # held out
    # the run's config.json re-launches it (`dsv-jax train --config RUN/config.json`): the same config,
    # which resumes from the run's checkpoint
    rerun = load_config(os.path.join(wd, "config.json"), ["train.steps=3"])
    trainer = Trainer(rerun, wd, progress=False)
    try:
        assert trainer.start_step == 2 and trainer.cfg == rerun
        from_yaml = load_config(str(run_yaml))
        assert (
            dataclasses.replace(rerun, data=from_yaml.data, train=dataclasses.replace(rerun.train, steps=2))
            == from_yaml
        )
        assert rerun.data.buckets == ((1, 16, 16), (4, 16, 16)) and rerun.data.codec == CODEC  # as resolved
    finally:
        trainer.close()

    out = str(tmp_path / "model")
    r = run_cli("export", "--workdir", wd, "--out", out, "--dtype", "fp32")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["config.json", "export.json", "params"]  # not a DSV run: no dsv.json
    assert f"to {out}: config.json, export.json, params/ " in r.stdout and "no dsv.json: " in r.stdout, r.stdout
    info = json.loads(open(os.path.join(out, "export.json")).read())
    assert info["step"] == 2 and info["dtype"] == "float32" and info["text_encoder"] == HOOK
    r = run_cli("export", "--workdir", wd, "--out", out)
    assert r.returncode == 2 and "--overwrite" in r.stderr

    # load_model: the NNX model with the trained parameters, bit-equal to the checkpoint's in fp32
    loaded = load_model(out)
    cfg, _, params, _, step = load_trained(wd)
    assert step == loaded.step == 2 and loaded.config == cfg
    got = jax.tree.leaves(nnx.state(loaded.model, nnx.Param))
    assert len(got) == len(jax.tree.leaves(params)) > 10
    for a, b in zip(jax.tree.leaves(params), got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((2, 4, 16, 16, CHANNELS)).astype(np.float32)
    emb, mask = text_encoder_hook()(["a red circle moving left", "a blue square"])
    t = np.array([0.3, 0.8], np.float32)
    v = np.asarray(loaded(latents, t, emb, mask))
    assert v.shape == latents.shape and np.isfinite(v).all() and np.abs(v).max() > 0
    # a bf16 export: half the bytes, the same model to bf16 precision
    half = load_model(export(wd, str(tmp_path / "model16"), dtype="bf16"))
    assert {x.dtype for x in jax.tree.leaves(nnx.state(half.model, nnx.Param))} == {np.dtype("bfloat16")}
    np.testing.assert_allclose(np.asarray(half(latents, t, emb, mask)), v, atol=0.05 * np.abs(v).max())

    # sample from the export: prompts through the run's text encoder hook
    clip = str(tmp_path / "clip.gif")
    r = run_cli(
        "sample",
        "--model",
        out,
        "--out",
        clip,
        "--prompt",
        "a red circle",
        "--prompt",
        "a blue square",
        "--steps",
        "2",
        "--shape",
        "4,16,16",
    )
    assert r.returncode == 2 and f"--text-encoder pkg.module:make (its dataset was prepared with {HOOK})" in r.stderr
    r = run_cli(
        "sample",
        "--model",
        out,
        "--out",
        clip,
        "--prompt",
        "a red circle",
        "--prompt",
        "a blue square",
        "--steps",
        "2",
        "--shape",
        "4,16,16",
        "--text-encoder",
        HOOK,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    import imageio.v3 as iio

    frames = iio.imread(clip, index=None)
    assert frames.shape[:3] == (4, 32, 2 * 32 + 1)  # 4 frames of 32 x 32 pixels (pixel:1x2x2), 2 clips


@pytest.mark.parametrize(
    "args, needle",
    [
        (["export", "--workdir", "/nonexistent/run", "--out", "x"], "has no checkpoints/"),
        (["sample", "--model", "/nonexistent/run", "--out", "x.gif"], "no checkpoint"),
    ],
)
def test_export_and_sample_errors_are_clear(args, needle):
    r = run_cli(*args, timeout=120)
    assert r.returncode == 2 and needle in r.stderr, r.stderr[-2000:]


def test_a_failing_end_of_run_sample_is_one_warning(tmp_path, monkeypatch, caplog):
    import types

    import dsv_jax.sample
    from dsv_jax.train.trainer import sample_at_end
    from tests.conftest import small_config

    def broken(*args, **kwargs):
        raise RuntimeError("no space left on device\nmore detail")

    monkeypatch.setattr(dsv_jax.sample, "sample_from_state", broken)
    trainer = types.SimpleNamespace(
        cfg=small_config(),
        workdir=str(tmp_path),
        is_main=True,
        graphdef=None,
        state=types.SimpleNamespace(step=3, params=None, ema=None),
        inference_params=None,
        policy=types.SimpleNamespace(state_dict=lambda: None),
    )
    with caplog.at_level("WARNING"):
        assert sample_at_end(trainer) is None
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "no end-of-run sample (RuntimeError: no space left on device)" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()
