"""The photo dataset (data.source=photos) and the semantic score of clips against their captions."""

import collections
import dataclasses
import time

import numpy as np
import pytest

from dsv_jax.data import photos, semantic, synthetic
from dsv_jax.data.feed import make_feed
from dsv_jax.data.text import WORDS, tokenize


def test_render_is_deterministic_shaped_and_captioned():
    for shape in [(8, 32, 48), (1, 32, 32), (4, 16, 16)]:
        a, cap = photos.render(0, (5, 1), shape)
        b, cap2 = photos.render(0, (5, 1), shape)
        np.testing.assert_array_equal(a, b)
        assert cap == cap2 and a.shape == (*shape, 3) and a.dtype == np.float32
        assert -1.0 <= a.min() and a.max() <= 1.0 and a.std() > 0.05  # a textured picture, not a flat field
        assert not np.array_equal(a, photos.render(0, (5, 2), shape)[0])
        facts = photos.parse_caption(cap)
        assert facts["scene"] in photos.SCENES and facts["objects"][0][0] in photos.OBJECTS
        assert (facts["camera"] is None) == (shape[0] == 1)  # stills say nothing of a camera
        assert all((d is None) == (shape[0] == 1) for _, d in facts["objects"])


def test_captions_round_trip_use_known_words_and_hold_out_combinations():
    seen = {"train": set(), "eval": set()}
    for split in seen:
        for j in range(60):
            clip = photos.plan(1, (0, j), (4, 16, 16), split)
            cap = photos.caption_of(clip)
            facts = photos.parse_caption(cap)
            assert facts["objects"] == [(m.name, m.direction) for m in clip.movers]
            assert facts["scene"] == clip.scene and facts["camera"] == clip.camera
            first = clip.movers[0]
            assert photos.held_out(first.name, first.direction, clip.scene) == (split == "eval")
            seen[split].add((first.name, first.direction, clip.scene))
            ids, mask = tokenize(cap, 32, 0)  # no hash buckets: an unknown word would be dropped
            assert mask.sum() == len(cap.replace(",", "").split()) + 1 <= photos.MAX_CAPTION_WORDS + 1, cap
    assert not seen["train"] & seen["eval"] and len(seen["eval"]) > 10
    assert set(photos.WORDS) <= set(WORDS)


def test_motion_matches_the_plan():
    """Objects move the captioned way in frame coordinates; a panning window moves the captioned way."""
    for j in range(30):
        clip = photos.plan(2, (1, j), (8, 32, 32))
        for m in clip.movers:
            unit = np.array(photos.DIRECTIONS[m.direction])
            assert np.dot(unit, m.velocity) > 0 and np.allclose(np.abs(unit) * m.velocity, m.velocity)
        if clip.camera.startswith("pans"):
            unit = np.array(photos.DIRECTIONS[clip.camera.split()[1]])
            assert np.dot(unit, clip.pan) > 0
        else:
            assert clip.pan == (0.0, 0.0)
        assert (clip.zoom[1] < clip.zoom[0]) == (clip.camera == "zooms in")


def test_the_first_object_is_in_front():
    base = photos.plan(3, (2, 0), (1, 32, 32))
    cat, cup = photos.Mover("cat", None, (4.0, 6.0), (0.0, 0.0)), photos.Mover("cup", None, (8.0, 10.0), (0.0, 0.0))
    both = photos.draw(dataclasses.replace(base, movers=(cat, cup)), (1, 32, 32))[0]
    cat_only = photos.draw(dataclasses.replace(base, movers=(cat,)), (1, 32, 32))[0]
    cup_only = photos.draw(dataclasses.replace(base, movers=(cup,)), (1, 32, 32))[0]
    _, alpha = photos.cutout("cat", 32, 32)
    opaque = np.zeros((32, 32), bool)
    opaque[4 : 4 + alpha.shape[0], 6 : 6 + alpha.shape[1]] = alpha[:28, :26] > 0.999
    overlap = opaque & (np.abs(cup_only - cat_only).max(-1) > 0.05)
    assert overlap.sum() > 30
    np.testing.assert_allclose(both[overlap], cat_only[overlap], atol=2e-3)  # the cat covers the cup


def test_feed_serves_the_buckets_and_eval_split(small_cfg):
    cfg = small_cfg("data.source=photos", "data.buckets=[[1,16,16],[4,16,24]]", "text.max_len=20")
    feed = make_feed(cfg)
    shapes = {next(feed)["latents"].shape[1:4] for _ in range(12)}
    assert shapes == {(1, 16, 16), (4, 16, 24)}
    batch = make_feed(cfg, split="eval").batch_at(0, (4, 16, 24))
    again = make_feed(cfg, split="eval").batch_at(0, (4, 16, 24))
    np.testing.assert_array_equal(batch["latents"], again["latents"])
    assert batch["text_ids"].shape == (batch["latents"].shape[0], 20)


def test_render_cost_is_small():
    photos.render(0, (0, 0), (16, 64, 64))  # photos decoded and resized once per process
    times = []
    for j in range(1, 16):
        t0 = time.perf_counter()
        photos.render(0, (0, j), (16, 64, 64))
        times.append(time.perf_counter() - t0)
    # 16 x 64 x 64 pixels (16k tokens at patch 1x2x2): ~7-13 ms on one core, generous for a shared CI box
    assert np.median(times) < 0.06, times


def test_missing_scikit_image_is_a_clear_error(monkeypatch, small_cfg):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "skimage" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'dsv-jax\[photos\]'"):
        make_feed(small_cfg("data.source=photos"))


def test_real_clips_are_a_held_out_feed(small_cfg):
    from dsv_jax.data.real_clips import RealClips
    from dsv_jax.data.text import START

    cfg = small_cfg("data.source=photos", "data.buckets=[[1,16,16],[4,16,24]]", "data.bucket_weights=[1,1]")
    clips = RealClips(cfg, lambda shape: 3)
    assert clips.shapes == [(4, 16, 24)] and len(clips.paths) == 4
    first = clips.batch_at(0, (4, 16, 24))
    assert first["latents"].shape == (3, 4, 16, 24, 3) and first["latents"].dtype == np.float32
    assert -1 <= first["latents"].min() and first["latents"].max() <= 1 and first["latents"].std() > 0.1
    assert not np.allclose(first["latents"][0], first["latents"][1])  # rows come from different clips
    assert (first["text_ids"][:, 0] == START).all() and first["text_mask"].sum() == 3  # the empty caption
    np.testing.assert_array_equal(clips.batch_at(0, (4, 16, 24))["latents"], first["latents"])
    assert not np.allclose(clips.batch_at(1, (4, 16, 24))["latents"], first["latents"])


# -- the semantic score --------------------------------------------------------------------------------


def _clips(source: str, n: int, shape=(8, 32, 32)):
    if source == "synthetic":
        return [synthetic.render(1, (0, j), shape) for j in range(n)]
    return [photos.render(1, (0, j), shape, split="eval") for j in range(n)]


@pytest.mark.parametrize(
    "source, questions", [("synthetic", {"colour", "shape", "motion"}), ("photos", {"object", "motion", "camera"})]
)
def test_score_is_near_perfect_on_truth_and_chance_on_noise(source, questions):
    clips = _clips(source, 36)
    frames, captions = [c[0] for c in clips], [c[1] for c in clips]
    truth = semantic.score_clips(frames, captions)
    assert set(truth["questions"]) == questions and truth["unscored"] == 0
    assert truth["accuracy"] >= 0.95 and min(q["accuracy"] for q in truth["questions"].values()) >= 0.9, truth
    rng = np.random.default_rng(0)
    noise = semantic.score_clips([rng.uniform(-1, 1, f.shape).astype(np.float32) for f in frames], captions)
    assert abs(noise["accuracy"] - noise["chance"]) < 0.1, noise  # pooled over ~100 questions
    assert noise["chance"] == pytest.approx(truth["chance"]) and 0.1 < noise["chance"] < 0.35


def test_score_notices_a_wrong_direction():
    """Captions with every direction turned around: the clips contradict them."""
    flip = {"left": "right", "right": "left", "up": "down", "down": "up"}
    for source in ("synthetic", "photos"):
        clips = _clips(source, 12)
        wrong = [" ".join(flip.get(w, w) for w in cap.split(" ")) for _, cap in clips]
        score = semantic.score_clips([c[0] for c in clips], wrong)
        assert score["questions"]["motion"]["accuracy"] <= 0.1, (source, score)


def test_score_says_what_the_clips_showed_instead():
    """Captions that name another shape and colour than the clips show: the confusion table holds the
    caption's word against the clip's, and the misses line names the commonest swaps."""
    clips = _clips("synthetic", 12)
    swap = {
        "circle": "cross",
        "square": "cross",
        "triangle": "cross",
        "ring": "cross",
        "diamond": "cross",
        "cross": "ring",
    }
    truths = [semantic.parse(cap) for _, cap in clips]
    wrong = [
        f"a {'large' if t['large'] else 'small'} {t['colour']} {swap[t['shape']]} moving {t['direction']}"
        for t in truths
    ]
    score = semantic.score_clips([c[0] for c in clips], wrong)
    shape = score["questions"]["shape"]
    seen = {t["shape"] for t in truths} - {"cross"}
    assert set(shape["confusion"]["cross"]) == seen, shape  # each clip shows its own shape, not the caption's
    assert sum(n for said in shape["confusion"].values() for n in said.values()) == shape["n"] == 12
    assert score["questions"]["colour"]["confusion"] == {
        c: {c: n} for c, n in sorted(collections.Counter(t["colour"] for t in truths).items())
    }
    line = semantic.format_misses(score)
    assert line.startswith("misses: ") and "cross->" in line and "colour" not in line


def test_measurements():
    rng = np.random.default_rng(0)
    image = rng.normal(size=(40, 40))
    smooth = np.cumsum(np.cumsum(image, 0), 1)  # a textured image
    moved = np.roll(smooth, (3, -5), axis=(0, 1))
    dy, dx = semantic.phase_shift(smooth[8:-8, 8:-8], moved[8:-8, 8:-8])
    assert abs(dy - 3) < 0.5 and abs(dx + 5) < 0.5
    frames = rng.uniform(-1, 1, (2, 32, 32, 3))
    template = rng.uniform(-1, 1, (7, 9, 3))
    frames[1, 10:17, 4:13] = 0.5 * template + 0.1  # an affine copy
    scores = semantic.Matcher(frames)(template, np.ones((7, 9)))
    assert scores.shape == (2, 26, 24) and np.unravel_index(np.argmax(scores[1]), scores[1].shape) == (10, 4)
    assert scores[1].max() == pytest.approx(1.0, abs=1e-6) and scores[0].max() < 0.6
    assert semantic.score_clip(frames[0][None], "a picture of a dog") is None
    assert semantic.direction_of(1.0, -3.0) == "left" and semantic.direction_of(-2.0, 1.0) == "up"


def test_score_reports_its_standard_error_over_clips():
    clips = _clips("synthetic", 6)
    frames, captions = [c[0] for c in clips], [c[1] for c in clips]
    rng = np.random.default_rng(1)
    noise = [rng.uniform(-1, 1, f.shape).astype(np.float32) for f in frames]
    mixed = frames[:3] + noise[3:]  # three true clips, three of noise
    score = semantic.score_clips(mixed, captions)
    per_clip = [np.mean([a.right for a in semantic.score_clip(f, c).values()]) for f, c in zip(mixed, captions)]
    assert score["stderr"] == pytest.approx(np.std(per_clip, ddof=1) / np.sqrt(6)) and score["stderr"] > 0.05
    assert f"+- {score['stderr']:.3f}" in semantic.format_score(score)
    truth = semantic.score_clips(frames, captions)  # every clip fully right: no spread
    assert truth["stderr"] == 0.0 and np.isnan(semantic.score_clips(frames[:1], captions[:1])["stderr"])
