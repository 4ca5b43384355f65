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
