"""experiments/step_time.py: a CPU step of a preset with overrides, its batch and XLA's cost analysis recorded."""

import json

import pytest

from experiments import step_time


def test_step_time_records_the_batch_overrides_and_cost(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    args = [
        "--preset",
        "tiny-motion",
        "--latents",
        "1,16,16",
        "--batch",
        "3",
        "--attention",
        "full",
        "--dtype",
        "float32",
        "--steps",
        "1",
        "--out",
        str(out),
        "attention=auto",
        "model.depth=1",
    ]
    step_time.main(args)
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec == json.loads(capsys.readouterr().out.splitlines()[-1])
    assert rec["batch"] == 3 and rec["tokens"] == 3 * 4 * 4  # patch 1x4x4 on 1x16x16
    assert rec["overrides"] == ["attention=auto", "model.depth=1"] and rec["finite"]
    assert rec["cost"]["flops"] > 0 and rec["cost"]["bytes_accessed"] > 0
    with pytest.raises(SystemExit):  # a DSV variant on a config without DSV
        step_time.main(["--preset", "tiny", "--attention", "dsv0.5", "attention=auto"])
