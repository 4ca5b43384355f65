import dataclasses
import os

import jax
import pytest
from flax import nnx

from dsv_jax.config import PRESETS, Config, ConfigError, architecture_diff, config_yaml, get_config, load_config
from dsv_jax.model import VideoDiT

PAPER = {"0.8b": (0.8e9, 28, 12, 96), "2.7b": (2.7e9, 32, 16, 128), "30b": (30e9, 42, 24, 256)}


@pytest.mark.parametrize("name", [f"{size}{arch}" for size in PAPER for arch in ("", "-mmdit")])
def test_preset_parameter_count_matches_name(name):
    target, depth, heads, head_dim = PAPER[name.split("-")[0]]
    cfg = get_config(name)
    assert (cfg.model.depth, cfg.model.heads, cfg.model.head_dim) == (depth, heads, head_dim)
    assert cfg.model.arch == ("mmdit" if name.endswith("mmdit") else "dit")
    model = nnx.eval_shape(lambda: VideoDiT(cfg.model, rngs=nnx.Rngs(0)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert abs(count / target - 1) < 0.10, f"{name}: {count / 1e9:.3f}B params"


def test_dit_alias_and_every_preset_builds():
    assert get_config("2.7b-dit").model == get_config("2.7b").model
    for name in PRESETS:
        assert isinstance(get_config(name), Config)


def test_tiny_motion_preset_is_the_measured_w50_run():
    """`tiny-motion` is the tiny MMDiT with the overrides of the run whose scores the docs quote (its record in
    tiny_first_run.json; experiments/results/RESULTS.md, "Tiny first run", run "w50") and the guidance it samples
    at: a preset edit that drifts from it fails here."""
    import json

    results = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "results")
    with open(os.path.join(results, "tiny_first_run.json")) as f:
        run = json.load(f)["runs"]["mmdit_absolute_position_2000_images50"]
    measured = get_config(run["config"], run["overrides"] + ["train.guidance=1.5"]).to_dict()
    preset = get_config("tiny-motion").to_dict()
    assert preset.pop("name") == "tiny-motion"
    measured.pop("name")
    assert preset == measured


def test_overrides_are_typed():
    cfg = get_config("tiny", ["model.depth=7", "train.lr=3e-4", "model.patch=[1,2,2]", "attention=xla"])
    assert cfg.model.depth == 7 and cfg.train.lr == 3e-4 and cfg.model.patch == (1, 2, 2)
    assert cfg.attention == "xla"
    assert isinstance(cfg.model.patch, tuple)


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("model.depthh=3", "did you mean model.depth?"),
        ("trian.lr=1", "did you mean train.lr?"),
        ("data.lr=1", "did you mean train.lr?"),
        ("nosuch=1", "top-level keys: attention, data, dsv"),
    ],
)
def test_unknown_key_suggests_close_keys_in_one_line(override, suggestion):
    with pytest.raises(ConfigError) as e:
        get_config("tiny", [override])
    msg = str(e.value)
    assert f"unknown config key {override.split('=')[0]!r}" in msg and suggestion in msg
    assert "\n" not in msg and len(msg) < 160 and "model.heads" not in msg  # close matches, not every key


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=abc", "train.lr=abc: expected a number (e.g. 0.5)"),
        ("model.depth=1.5", "model.depth=1.5: expected an integer (e.g. 8)"),
        ("train.sample_at_end=maybe", "train.sample_at_end=maybe: expected true or false"),
        ("model.patch=[1,2]", "model.patch=[1,2]: expected a list of 3 values, e.g. [8,8,8]"),
        ("attention=bogus", "attention='bogus' is not one of ['auto', 'xla', 'cudnn', 'dsv', 'window']"),
    ],
)
def test_bad_value_names_the_key_and_expected_type(override, message):
    with pytest.raises(ConfigError) as e:
        get_config("tiny", [override])
    assert str(e.value) == message


def test_attention_choices_match_the_registered_backends():
    from dsv_jax.attention import available_backends
    from dsv_jax.config import ATTENTION_BACKENDS, known_attention_backends
    from dsv_jax.dsv.plan import sparse_modes

    assert set(ATTENTION_BACKENDS) == {"auto", *available_backends(), *sparse_modes()}
    assert set(ATTENTION_BACKENDS) == set(known_attention_backends())


@pytest.mark.parametrize(
    "override, needle",
    [
        ("model.depth=abc", "abc"),
        ("model.patch=[1,2]", "3 values"),
        ("model.arch=transformer", "model.arch"),
        ("model.heads=5", "divisible"),
        ("train.caption_dropout=1.5", "caption_dropout"),
        ("train.ema_decay=1", r"train.ema_decay=1.0 must be in \[0, 1\)"),
        ("train.ema_decay=-0.1", r"train.ema_decay=-0.1 must be in \[0, 1\)"),
        ("train.ema_decay=nan", r"train.ema_decay=nan must be in \[0, 1\)"),
        ("model.depth", "key=value"),
    ],
)
def test_bad_values_are_clear_errors(override, needle):
    with pytest.raises(ConfigError, match=needle):
        get_config("tiny", [override])


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'huge'.*tiny"):
        get_config("huge")


def test_roundtrip_and_architecture_diff():
    cfg = get_config("tiny", ["model.depth=3"])
    assert Config.from_dict(cfg.to_dict()) == cfg
    other = get_config("tiny", ["model.depth=5", "model.dtype=float32", "train.lr=1"])
    assert architecture_diff(cfg, other) == [("model.depth", 3, 5)]


# -- config files (load_config) -----------------------------------------------------------------------


def test_yaml_file_extends_its_named_preset_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "name: tiny-mmdit\nattention: window\nmodel:\n  depth: 3\n  patch: [1, 2, 2]\ntrain:\n  lr: 1e-4\n  steps: 7\n"
    )
    cfg = load_config(str(path), ["model.depth=5", "train.steps=9"])
    preset = get_config("tiny-mmdit")
    assert cfg.name == "tiny-mmdit" and cfg.model.arch == "mmdit" and cfg.model.adaln == "single"  # from the preset
    assert cfg.attention == "window" and cfg.train.lr == 1e-4 and cfg.model.patch == (1, 2, 2)  # from the file
    assert cfg.model.depth == 5 and cfg.train.steps == 9  # the overrides win over the file
    assert cfg.model.hidden == preset.model.hidden and cfg.dsv == preset.dsv


def test_file_without_name_extends_tiny_and_says_so(tmp_path, caplog):
    path = tmp_path / "x.yml"
    path.write_text("model:\n  depth: 2\n")
    with caplog.at_level("INFO", logger="dsv_jax.config"):
        cfg = load_config(str(path))
    assert cfg == get_config("tiny", ["model.depth=2"])
    assert "extending the tiny preset" in caplog.text and "x.yml" in caplog.text


def test_a_runs_config_json_and_a_shown_preset_load_back_identically(tmp_path):
    cfg = get_config(
        "tiny-mmdit",
        [
            "model.depth=3",
            "train.lr=1e-05",
            "data.buckets=[[1,16,16],[4,16,24]]",
            "data.bucket_weights=[1,2]",
            "attention=dsv",
            "dsv.ladder=[0.1,1.0]",
        ],
    )
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())  # what the trainer writes
    assert load_config(str(path)) == cfg
    assert load_config(str(path), ["train.steps=11"]) == dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, steps=11)
    )
    for name in ("tiny", "2.7b-mmdit"):
        shown = tmp_path / f"{name}.yaml"
        shown.write_text(config_yaml(get_config(name)))
        assert load_config(str(shown)) == get_config(name)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("model:\n  depthh: 3\n", r"bad\.yaml: unknown config key .model\.depthh.; did you mean model\.depth\?"),
        ("model:\n  depth: abc\n", r"bad\.yaml: model\.depth: expected an integer"),
        ("model:\n  heads: 5\n", r"bad\.yaml.*divisible"),
        ("name: huge\n", r"bad\.yaml: name='huge' must name the preset"),
        ("model: [1\n  x: : y", r"bad\.yaml' is not valid YAML.*line"),
        ("- 1\n- 2\n", "must hold a mapping"),
    ],
)
def test_config_file_errors_name_the_file(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_config(str(path))


def test_missing_file_and_unknown_preset():
    with pytest.raises(ConfigError, match="config file 'nope/run.yaml' does not exist"):
        load_config("nope/run.yaml")
    with pytest.raises(ConfigError, match="unknown preset 'huge'.*or a config file"):
        load_config("huge")


def test_guide_preset_table_is_what_the_model_code_counts():
    from dsv_jax.cli import preset_table

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    guide = os.path.join(root, "docs", "guide", "training.md")
    lines = [line for line in open(guide, encoding="utf-8") if line.startswith("| preset |") or line.startswith("| `")]
    header = [c.strip() for c in lines[0].strip().strip("|").split("|")]
    shown = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(header) and cells[0].strip("`") in PRESETS:
            shown[cells[0].strip("`")] = dict(zip(header, cells))
    names = [n for n in PRESETS if not n.endswith("-dit")]
    assert sorted(shown) == sorted(names)
    for row in preset_table(names):
        assert shown[row["preset"]] == {**row, "preset": f"`{row['preset']}`"}
