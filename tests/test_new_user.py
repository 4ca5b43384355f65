"""What a new user hit (issue 50, item 3): bad input is one line naming the problem, exit status 2, and nothing
written; loading a model is silent; `--version`; every option has help; the end of a run says where things are."""

import argparse
import asyncio
import logging
import os
import re
import subprocess
import sys
import threading
import tomllib

import numpy as np
import pytest

from dsv_jax import cli
from tests.conftest import SMALL
from tests.data_helpers import prepared_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, cwd=None, timeout=600):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "dsv_jax", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


def one_error(r) -> str:
    """The failure's message: the only line on stderr that is not a log line."""
    lines = [line for line in r.stderr.splitlines() if not re.match(r"\d{4}-\d\d-\d\d ", line)]
    assert len(lines) == 1 and lines[0].startswith("dsv-jax "), r.stderr[-3000:]
    return lines[0]


def tree(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, ds, fs in os.walk(path) for f in ds + fs)


def test_a_checkpoint_that_is_not_there_is_a_bad_argument_and_makes_nothing(tmp_path):
    """--checkpoint 5 where DIR holds no step 5: exit 2, one line, no DIR, DIR/checkpoints or DIR/error.log,
    whether DIR is new or a folder that is not a run."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for workdir in (tmp_path / "new", mine):
        before = tree(tmp_path)
        r = run_cli(
            "train", "--workdir", str(workdir), "--checkpoint", "5", "--no-progress", *SMALL, cwd=tmp_path, timeout=120
        )
        assert r.returncode == 2, r.stderr[-3000:]
        assert "no checkpoint at step 5" in one_error(r) and str(workdir) in one_error(r)
        assert tree(tmp_path) == before


def test_a_dataset_the_model_does_not_fit_stops_before_the_workdir_is_made(tmp_path):
    data = prepared_dataset(str(tmp_path / "ds"), images=2, videos=1)
    workdir = tmp_path / "run"
    r = run_cli(
        "train",
        "--workdir",
        str(workdir),
        "--no-progress",
        *SMALL,
        f"data.path={data}",
        "model.in_channels=3",
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "latent channels" in one_error(r) and "model.in_channels=12" in one_error(r)
    assert not workdir.exists()  # not even an error.log


@pytest.mark.parametrize(
    "name, content, needle",
    [
        ("empty.yaml", b"", "is empty"),
        ("comments.yaml", b"# nothing yet\n", "is empty"),
        ("empty.json", b"", "is empty"),
    ]
    + [("logo.yaml", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is not a text file")],
)
def test_an_empty_or_binary_config_file_is_named_and_nothing_runs(tmp_path, name, content, needle):
    (tmp_path / name).write_bytes(content)
    r = run_cli("train", "--config", name, "--no-progress", cwd=tmp_path, timeout=60)  # not an 800-step run
    assert r.returncode == 2, r.stderr[-3000:]
    assert name in one_error(r) and needle in one_error(r), one_error(r)
    assert tree(tmp_path) == [name]  # no runs/tiny


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run trained from the CLI to its end-of-run sample: (workdir, the CLI's result)."""
    workdir = str(tmp_path_factory.mktemp("trained") / "run")
    r = run_cli(
        "train",
        "--workdir",
        workdir,
        "--steps",
        "2",
        "--no-progress",
        *SMALL,
        "train.sample_at_end=true",
        "train.sample_steps=2",
        "train.ema_decay=0.5",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return workdir, r


def test_the_end_of_a_run_names_the_held_out_loss_and_the_sample(trained):
    workdir, r = trained
    sample = os.path.join(workdir, "samples", "step_000002.gif")
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout
    assert re.fullmatch(
        rf"trained to step 2 in {re.escape(workdir)}: loss \d\.\d{{4}} -> \d\.\d{{4}}, held-out loss \d\.\d{{4}} "
        rf"\(EMA of the weights \d\.\d{{4}}\), sample {re.escape(sample)}",
        lines[0],
    ), lines[0]


def test_the_end_of_run_sample_is_large_enough_to_see_and_labelled(trained):
    import imageio.v3 as iio

    from dsv_jax.sample import DEFAULT_PROMPTS

    frames = iio.imread(os.path.join(trained[0], "samples", "step_000002.gif"), index=None)
    n = len(DEFAULT_PROMPTS)
    t, height, width, _ = frames.shape
    assert width == n * 129 - 1 and height > 128  # 16-pixel frames drawn 8 times larger, a caption below
    strips = [frames[0, 128:, i * 129 : i * 129 + 128] for i in range(n)]
    assert all(s.max() > 200 for s in strips)  # white text on black
    assert len({s.tobytes() for s in strips}) == n  # each its own caption


def test_labels_scale_frames_up_and_write_each_caption_under_its_video():
    from dsv_jax.labels import labelled, wrap

    videos = np.random.default_rng(0).integers(0, 256, (2, 3, 32, 48, 3), dtype=np.uint8)
    out = labelled(videos, ["a large red circle moving right", "a ring"])
    assert out.shape[:2] == (2, 3) and out.shape[3:] == (4 * 48, 3) and out.shape[2] > 4 * 32
    np.testing.assert_array_equal(out[:, :, :128], videos.repeat(4, axis=2).repeat(4, axis=3))
    assert out[0, :, 128:].max() > 200 and (out[0, 0, 128:] == out[0, 2, 128:]).all()  # the same caption each frame
    assert wrap("a large red circle moving right", 10, len) == ["a large", "red circle", "moving", "right"]
    with pytest.raises(ValueError, match="1 captions for 2 videos"):
        labelled(videos, ["one"])


def test_load_model_says_nothing(trained, caplog, capfd):
    """orbax's notices that a read-only manager is read only (through absl's logger) are dropped, and only those."""
    import dsv_jax

    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="absl"), caplog.at_level(logging.WARNING):
        model = dsv_jax.load_model(trained[0])
    assert model.step == 2
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    out, err = capfd.readouterr()
    assert "read only" not in out + err and "WARNING" not in err, err
    assert not logging.getLogger("absl").filters  # the filter lived for the load alone
    from dsv_jax.train.orbax_quirks import ReadOnlyNotices

    record = logging.LogRecord("absl", logging.WARNING, __file__, 1, "Given directory is read only=%s", ("x",), None)
    other = logging.LogRecord("absl", logging.WARNING, __file__, 1, "something else is wrong", (), None)
    assert not ReadOnlyNotices().filter(record) and ReadOnlyNotices().filter(other)


def test_version(monkeypatch):
    from importlib import metadata

    import dsv_jax

    r = run_cli("--version")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    try:
        installed = metadata.version("dsv-jax")
    except metadata.PackageNotFoundError:
        installed = dsv_jax.__version__
    assert r.stdout.startswith(f"dsv-jax {installed}; jax "), r.stdout

    real = metadata.version

    def not_installed(name):
        if name == "dsv-jax":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert cli.version_line().startswith(f"dsv-jax {dsv_jax.__version__} (source checkout, not installed); jax ")


def parsers(parser: argparse.ArgumentParser, prog: str = "dsv-jax"):
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{prog} {name}")


def test_every_option_says_what_it_does_and_its_default():
    missing, no_default = [], []
    for prog, parser in parsers(cli.build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = f"{prog} {'/'.join(action.option_strings) or action.dest}"
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(name)
            elif action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
                if "default" not in action.help:
                    no_default.append(name)
    assert not missing, f"options without help: {missing}"
    assert not no_default, f"options whose help hides the default: {no_default}"
    assert "--out FILE.gif|FILE.mp4" in cli.__doc__


def test_a_closed_loop_drops_what_a_late_read_hands_it():
    """orbax closes its restore's event loop while tensorstore reads of a failed restore are in flight; each
    then hands its result to the closed loop from a thread of its own: dropped, not an unraisable error."""
    from dsv_jax.train.orbax_quirks import late_reads_dropped

    with late_reads_dropped():
        loop = asyncio.new_event_loop()
    plain = asyncio.new_event_loop()
    assert type(plain) is not type(loop)  # the process's own policy is back
    loop.close()
    errors = []

    def late_read():
        try:
            loop.call_soon_threadsafe(print, "never runs")
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=late_read)
    thread.start()
    thread.join()
    assert errors == []
    plain.close()
    with pytest.raises(RuntimeError, match="Event loop is closed"):
        plain.call_soon_threadsafe(print)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        warnings = tomllib.load(f)["tool"]["pytest"]["ini_options"]["filterwarnings"]
    assert "error::pytest.PytestUnraisableExceptionWarning" in warnings
    assert "error::pytest.PytestUnhandledThreadExceptionWarning" in warnings


def test_overlapping_restores_put_the_process_policy_back():
    """Two restores in two threads overlap (the first ends before the second): the process's event-loop policy
    is the original once both have ended, not the first one's temporary policy."""
    from dsv_jax.train.orbax_quirks import late_reads_dropped

    original = asyncio.get_event_loop_policy()
    first, second = late_reads_dropped(), late_reads_dropped()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    loop = asyncio.new_event_loop()  # the second restore is still running: its loops drop late reads
    loop.close()
    loop.call_soon_threadsafe(print)
    second.__exit__(None, None, None)
    assert asyncio.get_event_loop_policy() is original


def test_the_readme_says_how_fast_the_first_run_is_on_busy_cores_too():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        install = f.read().split("## Install", 1)[1].split("```", 1)[0]
    rates = re.findall(r"(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))? steps/s", install)
    assert len(rates) >= 2, install  # idle cores, and a range for shared ones
    assert any(high for _, high in rates) and "shares the cores" in install
