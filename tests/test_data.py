import numpy as np
import pytest

from dsv_jax.data.feed import SyntheticFeed, equal_token_batch_size
from dsv_jax.data.synthetic import COLOURS, SHAPES, render
from dsv_jax.data.text import START, tokenize, vocab_size


def test_render_is_deterministic_and_captioned():
    a, cap = render(0, (5, 1), (8, 32, 48))
    b, cap2 = render(0, (5, 1), (8, 32, 48))
    np.testing.assert_array_equal(a, b)
    assert cap == cap2 and a.shape == (8, 32, 48, 3) and a.dtype == np.float32
    assert -1.0 <= a.min() and a.max() <= 1.0
    words = cap.split()
    assert words[2] in COLOURS and words[3] in SHAPES and "moving" in words
    c, _ = render(0, (5, 2), (8, 32, 48))
    assert not np.array_equal(a, c)


def test_motion_follows_caption():
    """The object's centre of mass moves in the captioned direction."""
    checked = 0
    for j in range(40):
        frames, cap = render(3, (0, j), (8, 32, 32))
        direction = cap.split()[-1]
        colour = np.array(COLOURS[cap.split()[2]]) / 127.5 - 1
        weight = np.exp(-np.sum((frames - colour) ** 2, axis=-1) * 20)
        yy, xx = np.mgrid[:32, :32]
        com = [(np.sum(w * yy) / w.sum(), np.sum(w * xx) / w.sum()) for w in weight[[0, -1]]]
        dy, dx = np.subtract(com[1], com[0])
        expect = {"left": dx < -2, "right": dx > 2, "up": dy < -2, "down": dy > 2}[direction]
        checked += 1
        assert expect, (cap, dy, dx)
    assert checked == 40


def test_images_are_still():
    frames, cap = render(0, (1, 1), (1, 16, 16))
    assert frames.shape == (1, 16, 16, 3) and "moving" not in cap


def test_tokenizer_prefix_mask_and_hashing():
    ids, mask = tokenize("A red circle moving LEFT zebra", max_len=10, hash_buckets=8)
    assert ids[0] == START and mask.tolist() == [True] * 7 + [False] * 3
    assert np.all(ids[7:] == 0) and ids[6] >= vocab_size(0)
    empty, m = tokenize("", 4, 8)
    assert empty.tolist() == [START, 0, 0, 0] and m.tolist() == [True, False, False, False]


def test_equal_token_batch_size():
    assert equal_token_batch_size(256, 2048, 64, 1) == 8
    assert equal_token_batch_size(4096, 2048, 64, 1) == 1
    assert equal_token_batch_size(256, 2048, 64, 8) == 8
    assert equal_token_batch_size(1024, 2048, 64, 8) == 8  # at least one row per data-parallel device
    assert equal_token_batch_size(16, 2048, 64, 1) == 64


def test_feed_schedule_is_shared_and_hosts_disjoint(small_cfg):
    cfg = small_cfg("data.tokens_per_batch=128")
    hosts = [SyntheticFeed(cfg, process_index=i, process_count=2) for i in range(2)]
    whole = SyntheticFeed(cfg)
    for _ in range(6):
        parts = [next(h) for h in hosts]
        full = next(whole)
        assert parts[0]["latents"].shape[1:] == parts[1]["latents"].shape[1:]
        np.testing.assert_array_equal(np.concatenate([p["latents"] for p in parts]), full["latents"])
    assert {tuple(whole.bucket_at(i)) for i in range(50)} == {(1, 16, 16), (4, 16, 16)}


def test_feed_state_resumes():
    from tests.conftest import small_config

    feed = SyntheticFeed(small_config())
    for _ in range(3):
        next(feed)
    state = feed.get_state()
    expected = [next(feed)["latents"] for _ in range(3)]
    again = SyntheticFeed(small_config())
    again.set_state(state)
    for e in expected:
        np.testing.assert_array_equal(next(again)["latents"], e)


def test_bucket_not_divisible_by_patch():
    from tests.conftest import small_config

    with pytest.raises(ValueError, match=r"data.buckets entry \(1, 15, 16\)"):
        SyntheticFeed(small_config("data.buckets=[[1,15,16]]", "data.bucket_weights=[1]"))


def test_sources_route_each_data_source_and_name_the_valid_ones(small_cfg, monkeypatch, tmp_path):
    import dataclasses

    from dsv_jax import config
    from dsv_jax.data import feed as feeds
    from dsv_jax.data import photos

    assert tuple(feeds.SOURCES) == config.DATA_SOURCES  # the config's choices are the routed sources
    cfg = small_cfg()
    assert cfg.data.source == "auto" and cfg.data.resolved_source == "synthetic"
    assert small_cfg(f"data.path={tmp_path}").data.resolved_source == "arrayrecord"
    assert feeds.source_of(cfg) is feeds.SOURCES["synthetic"]
    assert isinstance(feeds.make_feed(cfg), SyntheticFeed) and feeds.make_feed(cfg).render is render
    # photos: a SyntheticFeed drawing the photos (without them on disk: a stand-in renderer)
    monkeypatch.setattr(photos, "renderer", lambda cfg, split: ("photos", split))
    feed = feeds.make_feed(small_cfg("data.source=photos"), split="eval")
    assert isinstance(feed, SyntheticFeed) and feed.render == ("photos", "eval") and feed.heldout
    assert feeds.source_of(small_cfg("data.source=photos")).real_clips
    # arrayrecord: the Grain feed, opened with the caller's arguments
    opened = {}
    grain = lambda cfg, **kw: opened.update(kw) or SyntheticFeed(small_cfg())
    monkeypatch.setitem(feeds.SOURCES, "arrayrecord", dataclasses.replace(feeds.SOURCES["arrayrecord"], open=grain))
    feeds.make_feed(small_cfg(f"data.path={tmp_path}"), batch_multiple=4, process_index=1, process_count=2)
    assert opened == {"batch_multiple": 4, "process_index": 1, "process_count": 2, "split": "train"}
    assert [s.embedded for s in feeds.SOURCES.values()] == [True, True, False]
    valid = "the sources are synthetic, photos, arrayrecord"
    with pytest.raises(ValueError, match=f"unknown data source 'webdataset'; {valid}"):
        feeds.source_named("webdataset")
    with pytest.raises(config.ConfigError, match=r"data.source='webdataset' is not one of \['auto', 'synthetic'"):
        small_cfg("data.source=webdataset")
    with pytest.raises(config.ConfigError, match="data.source=arrayrecord needs data.path"):
        small_cfg("data.source=arrayrecord")
    with pytest.raises(config.ConfigError, match="is set but data.source=photos"):
        small_cfg("data.source=photos", f"data.path={tmp_path}")
    # a SyntheticFeed built directly for another source says how to open it instead of drawing shapes
    with pytest.raises(ValueError, match="data.source=photos opens with dsv_jax.data.feed.make_feed"):
        SyntheticFeed(small_cfg("data.source=photos"))


def test_the_feed_interface_is_declared_and_checked(small_cfg, monkeypatch):
    import dataclasses

    from dsv_jax.data import feed as feeds

    feed = SyntheticFeed(small_cfg())
    assert isinstance(feed, feeds.Feed)
    assert set(feeds.FEED_MEMBERS) >= {"shapes", "heldout", "get_state", "set_state", "close", "__next__"}
    feed.close()  # nothing in the background: a no-op, as the trainer calls it on every feed

    class Endless:  # an iterator that forgot the rest of the interface
        def __iter__(self):
            return self

        def __next__(self):
            return {}

    bad = dataclasses.replace(feeds.SOURCES["synthetic"], open=lambda cfg, **kw: Endless())
    monkeypatch.setitem(feeds.SOURCES, "synthetic", bad)
    with pytest.raises(TypeError, match="opened a Endless without shapes, heldout, batch_size, batch_at, get_state"):
        feeds.make_feed(small_cfg())
