"""Wan 2.1: our model against diffusers' WanTransformer3DModel on the same random weights, weights in (both
layouts) and out, and the errors of a bad checkpoint folder. Tiny random models built from configs; nothing is
downloaded. Needs torch's CPU build and diffusers (the test extra on Python 3.11)."""

import copy
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch (CPU build) + diffusers are the parity oracle; the test extra installs them on Python 3.11"
)
diffusers = pytest.importorskip(
    "diffusers", reason="diffusers 0.42 is the parity oracle; the test extra installs it on Python < 3.12 (main leg)"
)

from dsv_jax.config import get_config  # noqa: E402
from dsv_jax.model.size import parameter_count  # noqa: E402
from dsv_jax.wan import WanCheckpointError, diffusers_forward, export_diffusers, import_weights  # noqa: E402
from dsv_jax.wan.layout import expected_shapes, original_name  # noqa: E402

# Two configs: head dims 24 (RoPE parts 8 / 8 / 8) and 32 (12 / 10 / 10), two and one blocks.
CONFIGS = {
    "a": dict(num_attention_heads=2, attention_head_dim=24, ffn_dim=80, num_layers=2, text_dim=32),
    "b": dict(num_attention_heads=3, attention_head_dim=32, ffn_dim=64, num_layers=1, text_dim=48),
}
CASES = [
    ((3, 6, 10), 7),
    ((5, 8, 8), 512),
]  # latent T x H x W (odd grids: padded tiles), text length  # latent T x H x W (odd grids: padded tiles), text length
FP32_TOL = 1e-5  # of max |output| (the bound)
# bf16 (parameters and compute): measured 0.85-0.91% of max |output| on config a, diffusers' own bf16
# forward 0.79-0.80% against its fp32 one on the same inputs; both are bf16 rounding
BF16_TOL = 2e-2


def random_wan(seed: int, **config):
    """diffusers' Wan transformer with every parameter random (norm scales around 1)."""
    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(in_channels=16, out_channels=16, **config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(centre + torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.2))
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def wan(request, tmp_path_factory):
    """(diffusers model, its folder in several shards, our fp32 import of it)."""
    root = tmp_path_factory.mktemp(f"wan_{request.param}")
    model = random_wan(0, **CONFIGS[request.param])
    model.save_pretrained(root / "diffusers", max_shard_size="60KB")
    import_weights(str(root / "diffusers"), str(root / "ours"), dtype="fp32")
    return model, root


def _inputs(seed, shape, text_len, text_dim):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, *shape, generator=g)
    return x, torch.tensor([502.0, 123.4]), torch.randn(2, text_len, text_dim, generator=g)


def _reference(model, x, t, text):
    with torch.no_grad():
        return model(x, t, text).sample.numpy()


def test_presets_have_wans_parameter_counts():
    with torch.device("meta"):
        for name, (heads, depth, ffn) in {"wan2.1-t2v-1.3b": (12, 30, 8960), "wan2.1-t2v-14b": (40, 40, 13824)}.items():
            theirs = diffusers.WanTransformer3DModel(
                num_attention_heads=heads, attention_head_dim=128, ffn_dim=ffn, num_layers=depth
            )
            assert parameter_count(get_config(name)) == sum(p.numel() for p in theirs.parameters()), name


@pytest.mark.parametrize("shape,text_len", CASES)
def test_fp32_forward_equals_diffusers(wan, shape, text_len):
    import dsv_jax

    model, root = wan
    assert len([f for f in os.listdir(root / "diffusers") if f.endswith(".safetensors")]) > 1  # really sharded
    ours = dsv_jax.load_model(str(root / "ours"))
    x, t, text = _inputs(1, shape, text_len, model.config.text_dim)
    ref = _reference(model, x, t, text)
    out = np.asarray(diffusers_forward(ours, x, t, text))
    assert out.shape == ref.shape == (2, 16, *shape)
    assert np.abs(out - ref).max() <= FP32_TOL * np.abs(ref).max()


def test_bf16_forward_within_the_measured_tolerance(wan):
    from flax import nnx

    from dsv_jax.export import LoadedModel, load_params
    from dsv_jax.train.step import abstract_model

    model, root = wan
    cfg, _, params, _, _ = load_params(str(root / "ours"), "bf16")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"))
    ours = LoadedModel(model=nnx.merge(abstract_model(cfg)[0], params), config=cfg, step=0)
    for shape, text_len in CASES:
        x, t, text = _inputs(2, shape, text_len, model.config.text_dim)
        ref = _reference(model, x, t, text)
        err = np.abs(np.asarray(diffusers_forward(ours, x, t, text), np.float32) - ref).max() / np.abs(ref).max()
        assert 1e-4 < err <= BF16_TOL  # really bf16 (not silently fp32), and close


def test_original_layout_imports_to_the_same_parameters(wan, tmp_path):
    """The original release's names (checked against diffusers' own converter) import bitwise like diffusers'."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from safetensors.torch import save_file

    model, root = wan
    state = {original_name(k): v.contiguous() for k, v in model.state_dict().items()}
    assert set(convert_wan_transformer_to_diffusers(dict(state))) == set(model.state_dict())
    src = tmp_path / "original"
    src.mkdir()
    half = len(state) // 2
    names = sorted(state)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[:half]}
    shards["diffusion_pytorch_model-00002-of-00002.safetensors"] = names[half:]
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(src / fname))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (src / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    c = model.config
    original_config = {
        "_class_name": "WanModel",
        "model_type": "t2v",
        "dim": c.num_attention_heads * c.attention_head_dim,
        "num_heads": c.num_attention_heads,
        "num_layers": c.num_layers,
        "ffn_dim": c.ffn_dim,
        "freq_dim": 256,
        "in_dim": 16,
        "out_dim": 16,
        "text_dim": c.text_dim,
        "text_len": 512,
        "eps": 1e-6,
    }
    (src / "config.json").write_text(json.dumps(original_config))
    import_weights(str(src), str(tmp_path / "ours"), dtype="fp32")
    a, b = _params(root / "ours"), _params(tmp_path / "ours")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _params(path):
    import jax
    from flax import nnx

    from dsv_jax.export import load_params

    _, _, params, _, _ = load_params(str(path))
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def test_export_to_diffusers_round_trips(wan, tmp_path):
    """import -> export --format diffusers -> WanTransformer3DModel.from_pretrained: the same tensors bitwise
    (fp32) and so the same outputs; the export's shards come with diffusers' index."""
    model, root = wan
    out = tmp_path / "back"
    export_diffusers(str(root / "ours"), str(out), dtype="fp32", max_shard_bytes=40_000)
    assert (out / "diffusion_pytorch_model.safetensors.index.json").exists()
    back = diffusers.WanTransformer3DModel.from_pretrained(str(out)).eval()
    theirs, ours = model.state_dict(), back.state_dict()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    x, t, text = _inputs(3, (3, 6, 10), 7, model.config.text_dim)
    np.testing.assert_array_equal(_reference(model, x, t, text), _reference(back, x, t, text))


def test_time_features_are_diffusers_timestep_embedding():
    """[cos | sin] of timesteps in [0, 1000] times the frequencies; float32 exp differs from torch's by an ulp
    in some frequencies, worth < 5e-5 at t = 1000. The timesteps go in unrounded (time_scale 1): 502 / 1000
    in float32 times 1000 is not 502 (the model tests run at 502)."""
    import jax.numpy as jnp
    from diffusers.models.embeddings import get_timestep_embedding

    from dsv_jax.model.layers import timestep_features

    ts = torch.tensor([502.0, 999.0, 123.4, 0.0])
    ref = get_timestep_embedding(ts, 256, flip_sin_to_cos=True, downscale_freq_shift=0).numpy()
    assert np.abs(np.asarray(timestep_features(jnp.asarray(ts.numpy()), scale=1.0)) - ref).max() < 5e-5
    assert np.float32(1000) * np.float32(502 / 1000) != 502


# ----------------------------------------------------------------------------------------- bad folders


@pytest.fixture
def folder(wan, tmp_path):
    """A writable copy of the sharded diffusers folder of config a or b."""
    import shutil

    _, root = wan
    shutil.copytree(root / "diffusers", tmp_path / "src")
    return tmp_path / "src"


def _shards(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))


def _fails(folder, tmp_path, *needles):
    out = tmp_path / "out"
    with pytest.raises(WanCheckpointError) as e:
        import_weights(str(folder), str(out))
    message = str(e.value)
    assert "\n" not in message and all(n in message for n in needles), message
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".out")]  # nothing written
    return message


def test_missing_shard(folder, tmp_path):
    gone = _shards(folder)[1]
    os.remove(folder / gone)
    _fails(folder, tmp_path, gone, "missing")


def test_truncated_shard(folder, tmp_path):
    name = _shards(folder)[0]
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[: len(data) - 100])
    _fails(folder, tmp_path, name, "truncated")


def test_wrong_shape_names_the_tensor_and_both_shapes(folder, tmp_path):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["ffn_dim"] += 8
    (folder / "config.json").write_text(json.dumps(cfg))
    _fails(folder, tmp_path, "blocks.0.ffn.net.0.proj.weight", f"[{cfg['ffn_dim'] - 8}, ", f"[{cfg['ffn_dim']}, ")


def test_not_wan_and_image_to_video(folder, tmp_path):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "_class_name": "UNet2DConditionModel"}))
    _fails(folder, tmp_path, "not a Wan transformer")
    (folder / "config.json").write_text(json.dumps({**cfg, "image_dim": 1280}))
    _fails(folder, tmp_path, "image-to-video")
    os.remove(folder / "config.json")
    _fails(folder, tmp_path, "no config.json")


def test_cli_import_and_its_one_line_error(wan, tmp_path):
    _, root = wan
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = [sys.executable, "-m", "dsv_jax", "import-weights", "--from"]
    ok = subprocess.run(
        [*run, str(root / "diffusers"), "--out", str(tmp_path / "m")], capture_output=True, text=True, env=env
    )
    assert ok.returncode == 0, ok.stderr
    assert "dsv_jax.load_model" in ok.stdout and (tmp_path / "m" / "export.json").exists()
    info = json.loads((tmp_path / "m" / "export.json").read_text())
    assert info["imported"]["layout"] == "diffusers" and info["dtype"] == "bfloat16"
    bad = subprocess.run([*run, str(tmp_path), "--out", str(tmp_path / "n")], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "config.json" in bad.stderr
    assert not (tmp_path / "n").exists()


def test_expected_shapes_cover_diffusers_state_dict(wan):
    model, root = wan
    cfg = json.loads((root / "ours" / "config.json").read_text())
    from dsv_jax.config import Config

    shapes = expected_shapes(Config.from_dict(cfg).model)
    assert shapes == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert copy.deepcopy(shapes) == shapes
