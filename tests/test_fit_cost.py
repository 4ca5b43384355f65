"""The user's path end to end: prepare-data -> fit-cost -> train with dual batching -> sample."""

import json
import os
import subprocess
import sys

import numpy as np

from dsv_jax.data.bucketing import dual_constraint_batch_size
from dsv_jax.data.cost_model import CostModel
from tests.data_helpers import CHANNELS, prepared_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = [
    "model.hidden=16",
    "model.heads=2",
    "model.depth=1",
    "model.text_dim=8",
    "model.patch=[1,4,4]",
    "text.max_len=6",
    "text.hash_buckets=4",
    f"model.in_channels={CHANNELS}",
    "parallel.fsdp=2",
]


def cli(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "dsv_jax", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def test_prepare_fit_cost_train_dual_and_sample(tmp_path):
    data = prepared_dataset(str(tmp_path), images=9, videos=7, seed=2)
    cost = str(tmp_path / "cost.json")
    r = cli(
        "fit-cost",
        "--config",
        "tiny",
        "--data",
        data,
        "--out",
        cost,
        "--batch-sizes",
        "1,3",
        "--repeats",
        "3",
        "--memory-gb",
        "0.25",
        "--mem-fraction",
        "0.5",
        "--no-progress",
        *MODEL,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train with: data.batching=dual" in r.stdout
    model = CostModel.load(cost)
    info = model.info
    assert info["mesh"] == {"data": 1, "fsdp": 2, "context": 1}
    assert sorted({p["batch"] for p in info["points"]}) == [2, 6]  # per device x data-parallel size
    assert {tuple(p["shape"]) for p in info["points"]} == {(1, 16, 16), (4, 16, 16)}
    assert all(p["time_s"] > 0 and p["temp_bytes"] > 0 for p in info["points"])
    assert 0.5 <= model.p <= 3.0 and model.b > 0 and model.a >= 0
    # M_mem: the memory left under the cap, divided by the measured bytes per token
    expect = (0.25 * 2**30 * 0.5 - info["resident_bytes"] - info["temp_bytes_fixed"]) / info["temp_bytes_per_token"]
    assert model.m_mem == max(1, int(expect))
    # M_comp: a batch at the compute budget is predicted to take the target step time
    assert abs(model.predict(1, model.m_comp ** (1 / model.p)) - info["target_step_s"]) < 1e-9

    wd = str(tmp_path / "run")
    r = cli(
        "train",
        "--config",
        "tiny",
        "--workdir",
        wd,
        "--steps",
        "3",
        "--no-progress",
        *MODEL,
        f"data.path={data}",
        "data.batching=dual",
        f"data.cost_model={cost}",
        "data.workers=1",
        "train.log_every=1",
        "train.eval_batches=1",
        "train.sample_at_end=true",
        "train.sample_steps=2",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        steps = [json.loads(x) for x in f if '"loss"' in x]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:  # every step's batch is the dual rule's, rounded to the 2 data-parallel devices
        seq = int(np.prod([int(v) for v in s["bucket"].split("x")])) // 16
        b = min(dual_constraint_batch_size(seq, model.m_mem, model.m_comp, model.p), 64)
        assert s["batch"] == max(2, b // 2 * 2), s
    saved = json.load(open(os.path.join(wd, "config.json")))["data"]
    assert saved["codec"] == "pixel:1x2x2" and saved["buckets"] == [[1, 16, 16], [4, 16, 16]]
    # the sampler decodes with the dataset's codec: 12-channel latents of 16x16 -> 32x32 RGB frames
    import imageio.v3 as iio

    frames = iio.imread(os.path.join(wd, "samples", "step_000003.gif"), index=None)
    # the end-of-run GIF draws each frame scaled up to 128 pixels, its caption below (dsv_jax/labels.py): 32-pixel
    # frames in 4x4 blocks, where 16-pixel ones would be in 8x8 blocks
    panel = frames[:, :128, :128]
    assert frames.shape[0] == 4 and frames.shape[1] > 128
    np.testing.assert_array_equal(panel, panel[:, ::4, ::4].repeat(4, axis=1).repeat(4, axis=2))
    assert not np.array_equal(panel, panel[:, ::8, ::8].repeat(8, axis=1).repeat(8, axis=2))
