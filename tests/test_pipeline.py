"""The Grain feed of a prepared dataset, alone and inside the Trainer."""

import json
import subprocess
import sys

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from dsv_jax.data.feed import Feed, make_feed, resolve_data_config
from dsv_jax.data.manifest import Manifest
from dsv_jax.data.pipeline import GrainFeed
from dsv_jax.data.records import unpack
from dsv_jax.data.text import tokenize
from dsv_jax.train.compiles import CompileCounter
from dsv_jax.train.trainer import Trainer
from tests.conftest import small_config
from tests.data_helpers import CHANNELS, prepared_dataset

# Budgets small enough for the tiny dataset: S=16 images -> min(160/16, 700/16^1.5) = 10, S=64 videos -> 1.
DUAL = ["data.batching=dual", "data.m_mem=160", "data.m_comp=700", "data.cost_p=1.5"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return prepared_dataset(str(tmp_path_factory.mktemp("ds")), images=17, videos=11)


def data_cfg(path, *extra):
    return resolve_data_config(
        small_config(f"data.path={path}", f"model.in_channels={CHANNELS}", "data.workers=0", *extra)
    )


def test_config_takes_buckets_and_codec_from_the_manifest(dataset):
    cfg = data_cfg(dataset)
    m = Manifest.load(dataset)
    assert cfg.data.buckets == ((1, 16, 16), (4, 16, 16)) and cfg.data.codec == "pixel:1x2x2"
    assert cfg.data.bucket_weights == tuple(float(b["count"]) for b in m.buckets) and m.records == 28


def test_a_prepared_dataset_opens_as_a_grain_feed(dataset):
    feed = make_feed(data_cfg(dataset), split="eval")
    assert isinstance(feed, GrainFeed) and isinstance(feed, Feed) and not feed.heldout  # no held-out split
    feed.close()


@pytest.mark.parametrize("mode", [[], DUAL])
def test_hosts_share_the_schedule_and_split_the_rows(dataset, mode):
    cfg = data_cfg(dataset, *mode)
    whole = GrainFeed(cfg, batch_multiple=4, with_ids=True)
    hosts = [GrainFeed(cfg, batch_multiple=4, process_index=i, process_count=2, with_ids=True) for i in range(2)]
    seen = set()
    for _ in range(12):
        full, parts = next(whole), [next(h) for h in hosts]
        shape = full["latents"].shape[1:4]
        assert all(p["latents"].shape[1:4] == shape for p in parts)  # one bucket per step on every host
        assert len(full["latents"]) == whole.batch_size(shape) and len(parts[0]["latents"]) == len(full["latents"]) // 2
        assert not set(parts[0]["record_id"]) & set(parts[1]["record_id"])  # disjoint samples
        np.testing.assert_array_equal(np.concatenate([p["record_id"] for p in parts]), full["record_id"])
        np.testing.assert_array_equal(np.concatenate([p["latents"] for p in parts]), full["latents"])
        assert full["latents"].dtype == np.float32 and full["latents"].shape[-1] == CHANNELS
        assert -1 <= full["latents"].min() and full["latents"].max() <= 1
        seen.add(shape)
    assert seen == {(1, 16, 16), (4, 16, 16)}
    sizes = (whole.batch_size((1, 16, 16)), whole.batch_size((4, 16, 16)))
    assert sizes == ((8, 4) if mode else (4, 4))  # rounded to multiples of 4 (equal tokens: 64 // S)


def test_no_sample_is_lost_or_repeated(dataset):
    """Emitted ids + ids waiting in bucket buffers = exactly the shuffled stream read so far; no batch
    holds a record twice (each bucket has more records than its batch)."""
    cfg = data_cfg(dataset)
    feed = GrainFeed(cfg, batch_multiple=2, with_ids=True)
    out = [next(feed)["record_id"] for _ in range(15)]
    assert all(len(set(ids)) == len(ids) for ids in out)
    emitted = np.concatenate(out)
    state = feed.get_state()["grain"]
    buffered = [i for b in state["buffers"] + state["deferred"] for i in b]
    read = state["parent"]["next_index"]
    stream = grain.MapDataset.range(28).shuffle(seed=feed.seed).repeat()
    assert sorted(emitted.tolist() + buffered) == sorted(int(stream[i]) for i in range(read))
    assert read > 28  # crossed an epoch boundary


def test_samples_carry_their_latents_and_captions(dataset):
    cfg = data_cfg(dataset)
    feed = GrainFeed(cfg, batch_multiple=1, with_ids=True)
    batch = next(feed)
    source = grain.sources.ArrayRecordDataSource(feed.manifest.shard_paths())
    for row, rid in enumerate(batch["record_id"]):
        arrays, meta = unpack(source[int(rid)])
        np.testing.assert_allclose(batch["latents"][row], arrays["latent"] / 127.5 - 1, atol=1e-6)
        ids, mask = tokenize(meta["caption"], cfg.text.max_len, cfg.text.hash_buckets)
        np.testing.assert_array_equal(batch["text_ids"][row], ids)
        np.testing.assert_array_equal(batch["text_mask"][row], mask)
        assert meta["caption"].startswith("a ")


@pytest.mark.parametrize("workers", [0, 2])
def test_state_is_json_and_resumes_exactly(dataset, workers):
    cfg = data_cfg(dataset, f"data.workers={workers}", *DUAL)
    feed = make_feed(cfg, batch_multiple=2, process_index=0, process_count=1)
    for _ in range(3):
        next(feed)
    state = json.loads(json.dumps(feed.get_state()))
    expected = [next(feed) for _ in range(5)]
    feed.close()
    again = make_feed(cfg, batch_multiple=2, process_index=0, process_count=1)
    again.set_state(state)
    got = [next(again) for _ in range(5)]
    again.close()
    for e, g in zip(expected, got):
        assert e.keys() == g.keys()
        for k in e:
            np.testing.assert_array_equal(e[k], g[k])
    assert len({e["latents"].shape for e in expected}) == 2
    if workers:
        bad = make_feed(
            small_config(f"data.path={dataset}", f"model.in_channels={CHANNELS}", "data.workers=0", *DUAL),
            batch_multiple=2,
            process_index=0,
            process_count=1,
        )
        with pytest.raises(ValueError, match="data.workers=2"):
            bad.set_state(state)
        with pytest.raises(ValueError, match="not from a data.path dataset"):
            bad.set_state({"position": 3})


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.in_channels=3"], "has 12 latent channels .* add model.in_channels=12"),
        (["model.patch=[1,3,4]"], r"bucket \(1, 16, 16\) is not divisible by model.patch"),
        (["text.encoder=precomputed"], "stores captions, not embeddings"),
        (["data.codec=pixel"], "prepared with codec 'pixel:1x2x2'"),
    ],
)
def test_dataset_and_config_must_agree(dataset, overrides, needle):
    with pytest.raises(ValueError, match=needle):
        cfg = resolve_data_config(small_config(f"data.path={dataset}", f"model.in_channels={CHANNELS}", *overrides))
        GrainFeed(cfg)


def test_missing_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no manifest.json: prepare it with `dsv-jax prepare-data"):
        resolve_data_config(small_config(f"data.path={tmp_path}"))


def batches(records):
    return [(r["step"], r["bucket"], r["batch"], r["loss"]) for r in records if "loss" in r]


def test_trainer_resumes_the_identical_batch_sequence_and_never_compiles_after_warmup(dataset, tmp_path):
    cfg = small_config(
        f"data.path={dataset}",
        f"model.in_channels={CHANNELS}",
        "data.workers=0",
        *DUAL,
        "train.steps=100",
        "train.ckpt_every=1000",
    )
    straight = Trainer(cfg, str(tmp_path / "a"), progress=False)
    assert straight.cfg.data.codec == "pixel:1x2x2"
    ref = batches(straight.run(stop_at=7))
    straight.close()
    first = Trainer(cfg, str(tmp_path / "b"), progress=False)
    part1 = batches(first.run(stop_at=3))
    first.close()
    second = Trainer(cfg, str(tmp_path / "b"), progress=False)
    assert int(second.state.step) == 3
    saved = second.checkpointer.manager.restore(3, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    assert "buffers" in json.dumps(saved)  # the Grain iterator state, partly filled buckets included
    second.precompile()
    with CompileCounter() as compiles:
        part2 = batches(second.run(stop_at=7))
    assert compiles.count == 0, f"{compiles.count} compilations after warm-up"
    # the counter does see a compile (a bucket the feed never announced)
    with CompileCounter() as control:
        second.compiled_step((1, 16, 32))
    assert control.count >= 1
    # this dataset has no held-out split: its evaluation is named for what it measures
    ev = second.evaluate()
    assert ev["train_records_loss"] > 0 and not any(k.startswith("eval_loss") for k in ev)
    second.close()
    got = part1 + part2
    assert [b[:3] for b in got] == [b[:3] for b in ref] and len(ref) == 7
    assert {(b[1], b[2]) for b in ref} == {("1x16x16", 8), ("4x16x16", 8)}  # 10 -> 8 and 1 -> 8 on 8 devices
    np.testing.assert_allclose([b[3] for b in got], [b[3] for b in ref], rtol=1e-5)


def test_batcher_defers_a_record_that_comes_round_again():
    from dsv_jax.data.pipeline import BucketBatcher

    stream = [0, 1, 2, 3, 3, 2, 1, 0, 4, 4]  # two epochs of bucket 0 (ids 0-3), bucket 1 = {4}
    ds = grain.MapDataset.source([(i, int(i == 4)) for i in stream]).to_iter_dataset()
    it = iter(BucketBatcher(ds, batch_sizes=[3, 2], bucket_records=[4, 1]))
    assert next(it)["ids"].tolist() == [0, 1, 2]
    assert next(it)["ids"].tolist() == [3, 2, 1]  # the second 3 waits for the next batch
    state = it.get_state()
    assert state["buffers"] == [[3], []] and state["deferred"] == [[], []]
    assert next(it)["ids"].tolist() == [4, 4]  # bucket 1 has fewer records than its batch: repeats allowed
    assert it.get_state()["buffers"] == [[3, 0], []]


def test_eval_batches_are_fixed_and_split_by_host(dataset):
    cfg = data_cfg(dataset)
    whole = make_feed(cfg, batch_multiple=4, process_index=0, process_count=1, split="eval")
    hosts = [make_feed(cfg, batch_multiple=4, process_index=i, process_count=2, split="eval") for i in range(2)]
    for shape in whole.shapes:
        a, b = whole.batch_at(1, shape), whole.batch_at(1, shape)
        np.testing.assert_array_equal(a["latents"], b["latents"])  # no state, no shuffling
        assert a["latents"].shape == (whole.batch_size(shape), *shape, CHANNELS)
        parts = [h.batch_at(1, shape)["latents"] for h in hosts]
        np.testing.assert_array_equal(np.concatenate(parts), a["latents"])
        assert not np.array_equal(whole.batch_at(0, shape)["latents"], a["latents"])


def test_resuming_with_other_batch_sizes_keeps_batches_well_formed(dataset, caplog):
    feed = GrainFeed(
        data_cfg(dataset, "data.batching=dual", "data.m_mem=400", "data.m_comp=5000", "data.cost_p=1.5"),
        batch_multiple=2,
    )
    for _ in range(4):
        next(feed)
    state = json.loads(json.dumps(feed.get_state()))
    assert any(len(b) > 2 for b in state["grain"]["buffers"])  # partly filled buckets larger than the new B
    smaller = GrainFeed(data_cfg(dataset), batch_multiple=2)  # equal tokens: 4 images, 2 videos per batch
    with caplog.at_level("WARNING"):
        smaller.set_state(state)
    assert "batch sizes per bucket changed" in caplog.text
    for _ in range(6):
        batch = next(smaller)
        assert len(batch["latents"]) == smaller.batch_size(batch["latents"].shape[1:4])
    with pytest.raises(ValueError, match="dataset of 99 samples"):
        smaller.set_state(dict(state, records=99))


def test_batches_handed_to_jax_leave_no_shared_memory_behind(dataset):
    """Grain's prefetch processes hand batches over in shared memory, and jax on a CPU keeps the array it
    is given (no copy) past the run: a run on prepared data ended with resource_tracker's "There appear to
    be 3 leaked shared_memory objects" (one batch: latents, ids, mask). The feed's batches own their memory."""
    code = (
        "import jax\n"
        "from tests.conftest import small_config\n"
        "from dsv_jax.data.pipeline import GrainFeed\n"
        "if __name__ == '__main__':\n"
        f"    feed = GrainFeed(small_config('data.path={dataset}', 'model.in_channels={CHANNELS}', 'data.workers=1'))\n"
        "    kept = [jax.device_put(v) for v in next(feed).values()]  # as the trainer's to_global\n"
        "    feed.close()\n"
        "    print('ran')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ran" in r.stdout, r.stderr[-3000:]
    assert "leaked" not in r.stderr and "shared_memory" not in r.stderr, r.stderr[-3000:]
