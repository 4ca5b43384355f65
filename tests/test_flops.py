"""Model FLOPs and MFU (dsv_jax/model/flops.py): a hand count, the matmuls of the traced forward, kept
fractions of sparse plans, device peaks, and the trainer's logged values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv_jax.config import PRESETS, get_config
from dsv_jax.dsv.controller import DSVController, shape_key
from dsv_jax.dsv.plan import AttentionPlan
from dsv_jax.dsv.selection import window_selection
from dsv_jax.model.flops import (
    PEAK_ENV,
    forward_flops,
    kept_fractions,
    layout_of,
    mfu_metrics,
    parameter_count,
    peak_flops,
    train_step_flops,
)
from dsv_jax.model.t2v import TextToVideo
from dsv_jax.parallel.comm import _subjaxprs
from tests.conftest import small_config


def test_tiny_forward_and_train_step_against_a_hand_count():
    # tiny: hidden 128, 4 blocks of 4 heads, MLP 512, patch 1x4x4 of 3 channels (P = 48), text 16 x 64.
    # Bucket 8x32x32 -> 8 x 8 x 8 = 512 tokens; batch 2.
    cfg = get_config("tiny")
    b, s, lt, c, f, p, dt, depth = 2, 512, 16, 128, 512, 48, 64, 4
    timestep = 2 * b * (256 * c + c * c)
    text = 2 * b * lt * (dt * c + c * c)
    modulation = depth * 2 * b * c * 6 * c + 2 * b * c * 2 * c  # AdaLN-Zero per block + final
    embed_head = 2 * (2 * b * s * p * c)
    per_block = (
        2 * b * s * c * 3 * c
        + 2 * b * s * c * c  # self-attention q, k, v, out
        + 2 * b * s * c * c
        + 2 * b * lt * c * 2 * c
        + 2 * b * s * c * c  # cross q; k, v on text; out
        + 2 * 2 * b * s * c * f
    )  # MLP
    linear = timestep + text + modulation + embed_head + depth * per_block
    assert linear == 1_916_076_032  # 0.2M conditioning + 25.2M embed/head + 4 x 471.9M blocks
    attention = depth * 4 * b * s * s * c  # q k^T and p v
    cross = depth * 4 * b * s * lt * c
    fwd = forward_flops(cfg, (8, 32, 32), b)
    assert fwd["linear"] == linear and fwd["video_attention"] == attention == fwd["video_attention_dense"]
    assert fwd["text_attention"] == cross and fwd["predictor"] == fwd["selection"] == 0
    step = train_step_flops(cfg, (8, 32, 32), b)
    assert step["dense_equiv"] == 3 * (linear + attention + cross)
    assert step["work"] == 4 * (linear + cross) + 4.5 * attention  # remat: one more forward
    # the remat keeping video attention's outputs: its forward is not run a second time (cross attention is)
    kept = train_step_flops(get_config("tiny", ["model.remat_keep_attention=true"]), (8, 32, 32), b)
    assert kept["work"] == 4 * (linear + cross) + 3.5 * attention and kept["dense_equiv"] == step["dense_equiv"]
    # half the keys in every block: attention work halves, the dense-equivalent count does not move
    half = train_step_flops(cfg, (8, 32, 32), b, kept=0.5, predictor=False, selection=False)
    assert half["dense_equiv"] == step["dense_equiv"] and half["work"] == step["work"] - 4.5 * attention / 2
    # MFU against a 100 TFLOP/s device over 8 devices and 0.25 s
    m = mfu_metrics(step["dense_equiv"], step["work"], 0.25, 8, 100e12)
    assert m["tflops_per_device"] == pytest.approx(step["dense_equiv"] / 2 / 1e12)
    assert m["mfu/dense_equiv"] == pytest.approx(step["dense_equiv"] / 2 / 100e12)
    assert m["mfu/work"] == pytest.approx(step["work"] / 2 / 100e12)
    assert "mfu/work" not in mfu_metrics(1e12, 1e12, 1.0, 1, None)  # unknown peak: no MFU


def matmul_flops(fn, *args) -> float:
    """2 x multiply-adds of every dot_general in fn's jaxpr (scans counted length times)."""

    def walk(jaxpr, mult):
        total = 0.0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (contract, _), _ = eqn.params["dimension_numbers"]
                lhs = eqn.invars[0].aval.shape
                total += mult * 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
            elif eqn.primitive.name == "scan":
                total += walk(eqn.params["jaxpr"].jaxpr, mult * eqn.params["length"])
            else:
                for _, sub in _subjaxprs(eqn):
                    total += walk(sub, mult)
        return total

    return walk(jax.make_jaxpr(fn)(*args).jaxpr, 1)


@pytest.mark.parametrize(
    "arch, adaln, shape",
    [
        ("dit", "per_block", (4, 16, 16)),
        ("dit", "single", (3, 16, 20)),  # a padded token grid (3 x 4 x 5 in tiles of 2 x 4 x 4)
        ("mmdit", "single", (4, 16, 16)),
        ("mmdit", "per_block", (3, 16, 20)),
    ],
)
def test_forward_count_equals_the_matmuls_of_the_traced_model(arch, adaln, shape):
    cfg = small_config(f"model.arch={arch}", f"model.adaln={adaln}", "model.mlp_ratio=3", "text.max_len=5")
    model = nnx.eval_shape(lambda: TextToVideo(cfg, rngs=nnx.Rngs(0)))
    b = 3
    latents = jax.ShapeDtypeStruct((b, *shape, cfg.model.in_channels), jnp.float32)
    text = jax.ShapeDtypeStruct((b, cfg.text.max_len, cfg.model.text_dim), jnp.float32)
    mask = jax.ShapeDtypeStruct((b, cfg.text.max_len), jnp.bool_)
    t = jax.ShapeDtypeStruct((b,), jnp.float32)
    graphdef, state = nnx.split(model)
    traced = matmul_flops(lambda st, *a: nnx.merge(graphdef, st)(*a, attention="xla"), state, latents, t, text, mask)
    fwd = forward_flops(cfg, shape, b)
    assert traced == fwd["linear"] + fwd["video_attention"] + fwd["text_attention"]


def test_predictor_count_equals_the_matmuls_of_a_dsv_training_forward():
    cfg = small_config("attention=dsv", "dsv.rank=4", "dsv.query_stride=8")
    model = nnx.eval_shape(lambda: TextToVideo(cfg, rngs=nnx.Rngs(0)))
    b, shape = 2, (4, 16, 16)
    plan = AttentionPlan(mode="dsv", predictor=True, query_stride=8, max_queries=cfg.dsv.max_queries)
    args = (
        jax.ShapeDtypeStruct((b, *shape, cfg.model.in_channels), jnp.float32),
        jax.ShapeDtypeStruct((b,), jnp.float32),
        jax.ShapeDtypeStruct((b, cfg.text.max_len, cfg.model.text_dim), jnp.float32),
        jax.ShapeDtypeStruct((b, cfg.text.max_len), jnp.bool_),
    )
    graphdef, state = nnx.split(model)
    traced = matmul_flops(lambda st, *a: nnx.merge(graphdef, st)(*a, attention=plan, return_aux=True), state, *args)
    fwd = forward_flops(cfg, shape, b, predictor=True)
    assert fwd["predictor"] > 0
    assert traced == fwd["linear"] + fwd["video_attention"] + fwd["text_attention"] + fwd["predictor"]


def test_kept_fractions_of_window_and_dsv_plans():
    cfg = small_config("attention=dsv", "model.depth=3", "dsv.ladder=[0.25,0.5,1.0]")
    shape = (8, 16, 16)  # 8 x 4 x 4 tokens in tiles of 2 x 4 x 4: 4 KV blocks of 32 tokens
    layout = layout_of(cfg, shape)
    assert not layout.padded and layout.seq_len // layout.tile_size == 4
    assert kept_fractions(cfg, shape, "xla") == [1.0, 1.0, 1.0]
    window = AttentionPlan(mode="window", sparse=True, window=0.5)
    k = window_selection((4, 1, 1), 0.5).shape[1]
    assert kept_fractions(cfg, shape, window) == [k / 4] * 3 and k == 2
    ctl = DSVController(cfg)
    rng = np.random.default_rng(0)
    keep = rng.uniform(0.05, 0.45, (3, cfg.model.heads))
    keep[1] = 0.9  # block 1 stays dense
    ctl.load_state_dict(
        {
            "stage": 2,
            "switch_step": 0,
            "loss_ema": 0.0,
            "shapes": {shape_key(shape): {"sparsity": (1 - keep).tolist(), "rungs": [0.5, 0.0, 0.5], "profiles": 1}},
        }
    )
    plans, inputs = ctl.plans(shape), ctl.inputs(shape)
    kept = kept_fractions(cfg, shape, plans, inputs)
    want = [np.mean(np.clip(np.ceil(keep[i] * 4), 1, 2)) / 4 for i in (0, 2)]  # top_k = 0.5 x 4 blocks = 2
    assert kept == pytest.approx([want[0], 1.0, want[1]])
    # a padded grid runs sparse too: grid 3 x 4 x 5 pads to 4 x 4 x 8 tokens, 4 tiles, as many KV blocks
    padded = layout_of(cfg, (3, 16, 20))
    assert padded.padded and padded.seq_len // padded.tile_size == 4
    assert kept_fractions(cfg, (3, 16, 20), plans, inputs) == pytest.approx([want[0], 1.0, want[1]])
    # the work of the train step follows the kept fractions, with the predictor and selection added
    step = train_step_flops(cfg, shape, 4, kept=kept)
    fwd = forward_flops(cfg, shape, 4, kept=kept, predictor=True)
    assert step["work"] == pytest.approx(
        4 * (fwd["linear"] + fwd["text_attention"])
        + 4.5 * fwd["video_attention"]
        + 4 * fwd["predictor"]
        + fwd["selection"]
    )
    # the trainer's meter counts the predictor on the stage-2 steps that train it only
    from dsv_jax.parallel.mesh import make_mesh
    from dsv_jax.train.mfu import StepFlops

    meter = StepFlops(cfg, make_mesh(cfg.parallel, jax.devices()[:1]))
    trains, skips = ctl.plans(shape, step=0), ctl.plans(shape, step=1)
    assert all(p.predictor for p in trains) and not any(p.predictor for p in skips)
    assert meter(shape, 4, trains, inputs)[1] == pytest.approx(step["work"])
    # a step that skips the predictor loss still runs the projections once, for the selection
    m = cfg.model
    projections = m.depth * 2 * 4 * layout.seq_len * m.hidden * 2 * m.heads * cfg.predictor_rank
    skip_fwd = forward_flops(cfg, shape, 4, kept=kept, predictor=False)
    assert skip_fwd["selection"] == pytest.approx(fwd["selection"] + projections)
    assert meter(shape, 4, skips, inputs)[1] == pytest.approx(step["work"] - 4 * fwd["predictor"] + projections)


def test_device_peaks(monkeypatch):
    monkeypatch.delenv(PEAK_ENV, raising=False)
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("cpu", "cpu") is None and peak_flops("Some Future GPU") is None
    monkeypatch.setenv(PEAK_ENV, "123.5")
    assert peak_flops("Some Future GPU") == 123.5e12


def test_parameter_count_counts_the_dsv_predictors():
    dense, dsv = get_config("tiny"), get_config("tiny", ["attention=dsv"])
    m = dense.model
    predictors = m.depth * 2 * m.hidden * m.heads * dsv.dsv.rank  # W_Q^lr, W_K^lr without bias
    assert parameter_count(dsv) - parameter_count(dense) == predictors


def counted_on_the_model(cfg) -> int:
    model = nnx.eval_shape(lambda: TextToVideo(cfg, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize(
    "preset, overrides",
    [(name, []) for name in sorted(PRESETS) if not name.endswith("-dit")]
    + [
        ("tiny", ["attention=dsv", "dsv.rank=8"]),
        ("tiny-mmdit", ["attention=dsv", "model.adaln=per_block", "model.qk_norm=false"]),
        ("tiny", ["model.adaln=single", "text.encoder=precomputed", "model.text_dim=24", "model.mlp_ratio=2.7"]),
        ("tiny", ["model.patch=[2,2,2]", "model.in_channels=12", "text.hash_buckets=0", "text.max_len=20"]),
    ],
)
def test_the_counted_parameters_are_the_models(preset, overrides):
    """`parameter_count` adds the parameters up from the config (no jax, `dsv-jax presets` is instant): the
    same number as the model built abstractly."""
    cfg = get_config(preset, overrides)
    assert parameter_count(cfg) == counted_on_the_model(cfg)
