"""Failures as the user sees them, and the rules that decide what is kept or stopped (no jax here)."""

import errno
import os
import types

import pytest

from dsv_jax.config import get_config
from dsv_jax.errors import DiskFull, explain, is_disk_full, report
from dsv_jax.train.checkpoint import KeepLatestAndGood
from dsv_jax.train.guard import DivergenceGuard


def test_disk_full_anywhere_in_the_chain_names_the_path_and_free_space(tmp_path):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.jsonl"))
        except OSError as inner:
            raise ValueError("RESOURCE_EXHAUSTED: Error writing chunk") from inner
    except ValueError as e:
        assert is_disk_full(e)
        message, code, expected = explain(e)
    assert code == 1 and expected and "\n" not in message
    assert message.startswith(f"disk full writing {tmp_path / 'metrics.jsonl'} (") and message.endswith(" free)")
    assert explain(DiskFull("disk full: checkpoint step 3 needs about 2.0 MiB in /x, 0.1 MiB free"))[:2] == (
        "disk full: checkpoint step 3 needs about 2.0 MiB in /x, 0.1 MiB free",
        1,
    )
    assert not is_disk_full(ValueError("shape mismatch"))


def test_report_is_two_lines_at_most_and_the_traceback_goes_to_the_workdir(tmp_path, capsys):
    def bug():
        raise KeyError("a\nmulti-line\nmessage")

    try:
        bug()
    except KeyError as e:
        code = report("train", e, workdir=str(tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 2 and err[0].startswith("dsv-jax train: error: KeyError: ")
    assert str(tmp_path / "error.log") in err[1]
    assert "in bug" in (tmp_path / "error.log").read_text()  # the full traceback, for a bug report


def test_a_bug_outside_a_folder_of_its_own_logs_to_a_named_temporary_file(tmp_path, capsys, monkeypatch):
    """Without a directory the command owns, the traceback of a bug goes to a temporary file that the
    message names; an expected failure (the user's input) writes no log at all."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def bug():
        raise KeyError("oops")

    try:
        bug()
    except KeyError as e:
        code = report("sample", e)
    err = capsys.readouterr().err.strip().splitlines()
    logs = os.listdir(tmp_path)
    assert code == 1 and len(err) == 2 and len(logs) == 1 and logs[0].startswith("dsv-jax-sample-"), (err, logs)
    assert str(tmp_path / logs[0]) in err[1] and "in bug" in (tmp_path / logs[0]).read_text()
    assert report("sample", FileNotFoundError("'x' is neither an exported model nor a training workdir")) == 2
    assert os.listdir(tmp_path) == logs  # the message says it all: no second log


def test_guard_flags_divergence_and_non_finite_steps_and_stops_after_a_streak():
    train = get_config(
        "tiny", ["train.max_bad_steps=3", "train.divergence_factor=10", "train.divergence_window=4"]
    ).train
    guard = DivergenceGuard(train, history=[1.0, 1.2, 0.9])
    assert guard.observe(1, 1.1, True).bad is None and guard.healthy
    v = guard.observe(2, 5e21, True)  # finite garbage
    assert v.bad == "diverged" and "5e+21 > 10 x the running median" in v.reason and not guard.healthy
    assert guard.observe(3, 11.9, True).bad == "diverged"  # the garbage did not raise the median
    assert not guard.should_stop
    assert guard.observe(4, float("nan"), False).bad == "skipped" and guard.should_stop
    assert "the last good checkpoint is step 100" in str(guard.error(100))
    assert guard.observe(5, 1.0, True).bad is None and guard.healthy and guard.streak == 0
    off = DivergenceGuard(get_config("tiny", ["train.divergence_factor=0", "train.max_bad_steps=0"]).train, [1.0])
    assert off.observe(1, 1e9, True).bad is None
    for _ in range(50):
        off.observe(2, float("inf"), False)
    assert not off.should_stop


def test_guard_names_a_finite_loss_finite_and_says_what_was_not():
    """A loss of 3.9e27 is finite: a step whose gradient overflowed is called diverged (with the ratio to
    the median) when the loss is that far off, and never "non-finite loss"; a NaN loss is non-finite."""
    train = get_config("tiny", ["train.divergence_factor=10", "train.divergence_window=4"]).train
    guard = DivergenceGuard(train, history=[1.0, 1.2, 0.9])
    huge = guard.observe(1, 3.9e27, False, grad_norm=float("inf"))  # the step skipped its update
    assert huge.bad == "skipped", huge
    assert huge.reason.startswith("diverged: loss 3.9e+27 > 10 x the running median 1"), huge.reason
    assert huge.reason.endswith("with a non-finite gradient, update skipped"), huge.reason
    assert guard.observe(2, 5e21, True).reason.startswith("diverged: loss 5e+21 > 10 x the running median")
    grad = guard.observe(3, 1.1, False, grad_norm=float("nan")).reason
    assert grad.startswith("non-finite gradient (the loss 1.1 is finite)") and "update skipped" in grad, grad
    nan = guard.observe(4, float("nan"), False, grad_norm=float("nan")).reason
    assert nan.startswith("non-finite loss (nan)"), nan
    predictor = guard.observe(5, 1.0, False, grad_norm=0.5).reason
    assert predictor.startswith("non-finite DSV predictor loss or gradient"), predictor
    stopped = DivergenceGuard(train, history=[1.0])
    stopped.observe(1, 3.9e27, False, grad_norm=float("inf"))
    assert "last diverged: loss 3.9e+27" in str(stopped.error(None))


@pytest.mark.parametrize("good, keep", [({2}, {2, 8, 9}), (set(), {8, 9}), ({9, 2}, {8, 9}), ({8}, {8, 9})])
def test_rotation_keeps_the_newest_good_checkpoint(good, keep):
    infos = [types.SimpleNamespace(step=s, metrics=None) for s in (2, 4, 6, 8, 9)]
    policy = KeepLatestAndGood(2, lambda s: s in good)
    assert {i.step for i, k in zip(infos, policy.should_preserve(infos, context=None)) if k} == keep
