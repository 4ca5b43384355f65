"""The user's path: the CLI in a subprocess, as the README runs it."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import SMALL


def run_cli(*args, timeout=600, **kw):
    return subprocess.run(
        [sys.executable, "-m", "dsv_jax", *args], capture_output=True, text=True, timeout=timeout, **kw
    )


def metrics(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def run_cli_free_space(free_bytes, *args, timeout=600):
    """The CLI with the file system reporting `free_bytes` free (shutil.disk_usage patched): a full disk
    without filling one."""
    code = (
        "import shutil, sys; real = shutil.disk_usage; "
        f"shutil.disk_usage = lambda p: real(p)._replace(free={int(free_bytes)}); "
        "from dsv_jax.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)


def test_train_then_sample_gif(tmp_path):
    wd = str(tmp_path / "run")
    # options and key=value overrides in any order
    r = run_cli(
        "train",
        SMALL[0],
        "--config",
        "tiny",
        *SMALL[1:4],
        "--workdir",
        wd,
        *SMALL[4:],
        "--steps",
        "3",
        "train.sample_at_end=true",
        "--no-progress",
        "train.sample_steps=2",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trained to step 3" in r.stdout
    assert os.path.exists(os.path.join(wd, "samples", "step_000003.gif"))
    out = str(tmp_path / "clip.gif")
    before = set(os.listdir(tmp_path))
    r = run_cli(
        "sample",
        "--workdir",
        wd,
        "--out",
        out,
        "--prompt",
        "a red circle moving left",
        "--prompt",
        "a blue square",
        "--steps",
        "2",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert set(os.listdir(tmp_path)) - before == {"clip.gif"}  # exactly what was asked for (no clip.mp4)
    import imageio.v3 as iio

    frames = iio.imread(out, index=None)
    assert frames.shape[0] == 4 and frames.shape[1] == 16 and frames.shape[2] == 2 * 16 + 1  # 4 frames, 2 clips
    # the CLI writes what dsv_jax.generate returns for the same prompts and seed (one code path)
    import dsv_jax
    from dsv_jax.sample import save_video

    videos = dsv_jax.generate(dsv_jax.load_model(wd), ["a red circle moving left", "a blue square"], steps=2, seed=0)
    assert videos.dtype == np.uint8 and videos.shape == (2, 4, 16, 16, 3)
    np.testing.assert_array_equal(iio.imread(save_video(videos, str(tmp_path / "py.gif")), index=None), frames)
    # eval: the held-out loss the trainer logged at the end, and the semantic score of generated clips
    report = str(tmp_path / "eval.json")
    r = run_cli("eval", "--workdir", wd, "--clips", "3", "--steps", "2", "--shift", "2.5", "--json", report)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out loss" in r.stdout and "semantic score" in r.stdout and "ground-truth clips" in r.stdout
    assert f"{wd} at step 3 (data.source=synthetic, attention=xla)" in r.stdout, r.stdout  # resolved, not auto
    with open(report) as f:
        result = json.load(f)
    logged = [m for m in metrics(wd) if "eval_loss" in m][-1]
    assert result["step"] == 3 and result["held_out"]["eval_loss"] == pytest.approx(logged["eval_loss"], rel=1e-4)
    semantic = result["semantic"]
    assert len(semantic["captions"]) == 3 and semantic["truth"]["accuracy"] >= 0.9
    assert set(semantic["score"]["questions"]) == {"colour", "shape", "motion"}
    shapes = semantic["score"]["questions"]["shape"]["confusion"]  # {caption's shape: {clip's shape: count}}
    assert sum(n for said in shapes.values() for n in said.values()) == 3
    assert ("misses: " in r.stdout) == (semantic["score"]["accuracy"] < 1.0)
    assert result["sampler"] == {"clips": 3, "steps": 2, "seed": 0, "guidance": 3.0, "shift": 2.5}

    # a full disk: one line naming the folder, the space needed and the space free; the traceback goes to
    # the workdir's error.log; the checkpoint of step 3 stays the newest
    r = run_cli_free_space(2**16, "train", "--config", "tiny", "--workdir", wd, "--steps", "5", "--no-progress", *SMALL)
    errors = [line for line in r.stderr.splitlines() if "dsv-jax train: error" in line]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert [line for line in r.stderr.splitlines() if " INFO " not in line] == errors, r.stderr  # progress, the error
    assert (
        len(errors) == 1
        and "needs about" in errors[0]
        and os.path.join(wd, "checkpoints") in errors[0]
        and "0.1 MiB free" in errors[0]
    ), r.stderr
    assert "DiskFull" in open(os.path.join(wd, "error.log")).read()
    assert sorted(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit()) == [3]


def test_sigterm_saves_and_rerun_resumes(tmp_path):
    """A batch job's run (stderr not a terminal: no progress bar): the compile phase names each bucket it
    compiles, a status line (step, loss, tokens/s, ETA) comes at least every --status-every seconds,
    and SIGTERM saves a checkpoint and exits 143 (stopped early, resumable), which a rerun resumes."""
    wd = str(tmp_path / "run")
    args = [
        "train",
        "--config",
        "tiny",
        "--workdir",
        wd,
        "--steps",
        "100000",
        "--status-every",
        "0.2",
        *SMALL,
        "train.ckpt_every=100000",
        "train.log_every=1000",  # no metrics record while it runs: the status lines are all there is
    ]
    status = re.compile(r"step (\d+)/100000: loss \d+\.\d+, [\d,]+ tokens/s, ETA \d")
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dsv_jax", *args], stdout=subprocess.PIPE, stderr=err_file, text=True
        )
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and len(status.findall(err_path.read_text())) < 3:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    err = err_path.read_text()
    assert proc.returncode == 143, err[-3000:]
    for bucket in ("1x16x16", "4x16x16"):
        assert f"compiling the train step for bucket {bucket}" in err, err[-3000:]
    assert "\r" not in err and len(status.findall(err)) >= 3, err[-3000:]  # lines, not a bar
    saved = sorted(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit())
    last = max(m["step"] for m in metrics(wd) if "loss" in m)
    assert saved and saved[-1] == last, (saved, last)
    assert f"stopped by SIGTERM at step {last} (checkpoint saved): run the same command to resume" in err, err[-2000:]
    assert "trained to step" not in out
    # the same command picks up where it stopped
    r = run_cli("train", "--config", "tiny", "--workdir", wd, "--steps", str(last + 2), "--no-progress", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from step {last}" in r.stderr
    steps = [m["step"] for m in metrics(wd) if "loss" in m]
    assert steps[-2:] == [last + 1, last + 2]


def test_a_stop_on_a_signal_exits_128_plus_the_signal():
    from dsv_jax.train.trainer import TrainingStopped

    term, ctrl_c = TrainingStopped(signal.SIGTERM, 7), TrainingStopped(signal.SIGINT, 7)
    assert (term.exit_status, ctrl_c.exit_status) == (143, 130)
    assert str(ctrl_c).startswith("stopped by SIGINT at step 7 (checkpoint saved): run the same command to resume")


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--config", "huge"], "unknown preset 'huge'"),
        (["train", "--config", "tiny", "model.nope=1"], "unknown config key 'model.nope'"),
        (["train", "--steps", "5", "train.lr=abc"], "train.lr=abc: expected a number (e.g. 0.5)"),
        (["train", "--workdir", "{tmp}/run", "attention=bogus"], "attention='bogus' is not one of"),
        (["sample", "--workdir", "{tmp}/typo", "--out", "{tmp}/x.gif"], "'{tmp}/typo' is neither an exported model"),
        (["train", "--config", "{tmp}/nowhere/run.yaml"], "config file '{tmp}/nowhere/run.yaml' does not exist"),
        (
            ["sample", "--workdir", "{tmp}/run", "--out", "{tmp}/x.gif", "--shift", "0"],
            "--shift 0 must be a finite number > 0",
        ),
        (["eval", "--workdir", "{tmp}/run", "--shift", "inf"], "--shift inf must be a finite number > 0"),
        (["train", "--workdir", "", "--steps", "1"], "--workdir is empty ('')"),
        (["train", "--workdir", " "], "--workdir is empty (' ')"),
        (["eval", "--workdir", ""], "--workdir is empty ('')"),
        (["sample", "--model", "", "--out", "{tmp}/x.gif"], "--model is empty ('')"),
        (["sample", "--model", "{tmp}/run", "--out", ""], "--out is empty ('')"),
        (["export", "--workdir", "{tmp}/run", "--out", ""], "--out is empty ('')"),
        (["prepare-data", "--input", "{tmp}", "--output", ""], "--output is empty ('')"),
    ],
)
def test_errors_are_one_line_and_create_nothing(tmp_path, args, message):
    r = run_cli(*[a.format(tmp=tmp_path) for a in args], timeout=120, cwd=tmp_path)  # runs/<config> would be here
    assert r.returncode == 2 and r.stderr.splitlines() == [r.stderr.strip()], r.stderr[-2000:]
    assert r.stderr.startswith(f"dsv-jax {args[0]}: error: {message.format(tmp=tmp_path)}"), r.stderr
    assert os.listdir(tmp_path) == []  # rejected before any folder or file is made


def test_a_workdir_that_cannot_be_a_directory_is_one_line(tmp_path):
    """A file named as --workdir (or a folder under a file) stops in one line before anything is made."""
    (tmp_path / "notes.txt").write_text("mine")
    for workdir, message in [
        (tmp_path / "notes.txt", f"--workdir {str(tmp_path / 'notes.txt')!r} is a file, not a directory"),
        (
            tmp_path / "notes.txt" / "run",
            f"--workdir {str(tmp_path / 'notes.txt' / 'run')!r}: {str(tmp_path / 'notes.txt')!r} is a file, not a "
            "directory",
        ),
    ]:
        r = run_cli("train", "--workdir", str(workdir), "--steps", "1", timeout=120)
        assert r.returncode == 2 and r.stderr.splitlines() == [f"dsv-jax train: error: {message}"], r.stderr[-2000:]
    assert os.listdir(tmp_path) == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "mine"


def test_a_workdir_without_write_permission_is_named(tmp_path, monkeypatch):
    """A --workdir in a folder the user cannot write to is named (os.access faked: root writes anywhere)."""
    from dsv_jax import cli
    from dsv_jax.config import ConfigError

    monkeypatch.setattr(cli.os, "access", lambda path, mode: path != str(tmp_path))
    with pytest.raises(ConfigError, match=rf"--workdir '{tmp_path}/run' \('{tmp_path}'\) is not writable"):
        cli.check_workdir(str(tmp_path / "run"))
    monkeypatch.undo()
    cli.check_workdir(str(tmp_path / "run"))  # a folder it may make
    assert os.listdir(tmp_path) == []  # checked, not made


def test_a_failed_command_writes_no_error_log_into_a_folder_it_does_not_own(tmp_path):
    """`sample --model <a source folder>` fails in one line and leaves the folder as it was (no error.log)."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "module.py").write_text("x = 1\n")
    r = run_cli("sample", "--model", str(source), "--out", str(tmp_path / "x.gif"), timeout=120)
    assert r.returncode == 2 and "is neither an exported model" in r.stderr, r.stderr[-2000:]
    assert os.listdir(source) == ["module.py"] and os.listdir(tmp_path) == ["src"]


def test_eval_names_the_data_and_attention_a_run_used_not_auto(tmp_path):
    from dsv_jax.config import get_config
    from dsv_jax.evaluate import run_description

    assert run_description(get_config("tiny")) == "data.source=synthetic, attention=xla"  # auto, on a CPU
    assert run_description(get_config("tiny", ["data.source=photos", "attention=dsv"])) == (
        "data.source=photos, attention=dsv"
    )
    data = str(tmp_path / "clips")
    assert run_description(get_config("tiny", [f"data.path={data}", "attention=window"])) == (
        f"data.source=arrayrecord ({data}), attention=window"
    )


def test_presets_lists_each_preset_once_without_loading_jax():
    """`dsv-jax presets` counts parameters from the configs (no jax: it took 5-9 s) and lists the NAME-dit
    aliases in one line, not as rows of their own."""
    from dsv_jax.config import PRESETS

    code = "import sys; from dsv_jax.cli import main; main(['presets']); print('jax' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[-1] == "False", r.stdout  # jax was never imported
    rows = [line.split()[0] for line in lines[1:-2]]
    assert rows == sorted(n for n in PRESETS if not n.endswith("-dit")), rows
    assert lines[-2] == "(each DiT preset is also accepted as NAME-dit, e.g. 2.7b-dit)"


def test_broken_pipe_exits_quietly():
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsv_jax", "presets"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()  # like `| head` that has read enough: every write meets a closed pipe
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == b"", err.decode()[-2000:]


def test_presets_show_prints_a_loadable_yaml(tmp_path):
    from dsv_jax.config import get_config, load_config

    r = run_cli("presets", "--show", "2.7b-mmdit", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    path = tmp_path / "run.yaml"
    path.write_text(r.stdout)
    assert r.stdout.startswith("name: 2.7b-mmdit\n")
    assert load_config(str(path)) == get_config("2.7b-mmdit")
