"""Attention plans: one registered class per mode answering its own geometry, FLOPs and context-parallel
costs; a variant that does not define them is refused; nothing outside dsv/plan.py asks a plan its mode."""

import dataclasses
import os
import re

import numpy as np
import pytest

from dsv_jax.attention.context import ContextBackend
from dsv_jax.config import ConfigError
from dsv_jax.dsv.plan import (
    PLANS,
    AttentionPlan,
    ContextLoad,
    DensePlan,
    DSVPlan,
    Selection,
    as_plan,
    plan_class,
    register_plan,
    sparse_modes,
    static_plans,
    unregister_plan,
)
from dsv_jax.dsv.window import WindowPlan
from dsv_jax.model.tokens import token_layout
from tests.conftest import small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_attention_plan_builds_the_class_of_its_mode_and_keeps_equality_and_hashing():
    dsv = AttentionPlan(mode="dsv", sparse=True, keep=0.5)
    assert type(dsv) is DSVPlan and dsv == DSVPlan(sparse=True, keep=0.5) and dsv.mode == "dsv"
    assert hash(dsv) == hash(DSVPlan(sparse=True, keep=0.5))  # compile-cache keys
    assert type(AttentionPlan()) is DensePlan and type(AttentionPlan(mode="window")) is WindowPlan
    assert dataclasses.replace(dsv, keep=0.25) == DSVPlan(sparse=True, keep=0.25)
    assert {dsv: 1}[AttentionPlan(mode="dsv", sparse=True, keep=0.5)] == 1
    # different modes never compare equal, even with equal shared fields
    assert DensePlan(sparse=True) != WindowPlan(sparse=True)
    with pytest.raises(ValueError, match="unknown attention plan mode 'nope'; registered: dense, dsv, window"):
        AttentionPlan(mode="nope")
    with pytest.raises(ValueError, match="DSVPlan is mode 'dsv', got mode='window'"):
        DSVPlan(mode="window")
    with pytest.raises(dataclasses.FrozenInstanceError):
        dsv.keep = 1.0


def test_names_and_configs_become_the_registered_plans():
    assert as_plan("xla") == "xla" and as_plan("dsv") == DSVPlan() and as_plan("window") == WindowPlan(sparse=True)
    assert set(sparse_modes()) == {"dsv", "window"} and plan_class("dense") is DensePlan
    cfg = small_config("attention=window", "dsv.window=0.5", "dsv.dense_backend=xla")
    assert static_plans(cfg) == WindowPlan(sparse=True, window=0.5, backend="xla")
    assert static_plans(small_config("attention=dsv", "dsv.dense_backend=xla")) == DSVPlan(backend="xla")
    assert static_plans(small_config("attention=xla")) == "xla"


def test_each_plan_answers_its_geometry():
    layout = token_layout((8, 16, 16), (2, 8, 8))  # 128-token tiles
    assert DSVPlan(kv_block=64).geometry(layout, 1).sparse_options() == {"q_tile": 128, "kv_block": 64}
    assert DSVPlan().kv_block_for(layout) == 128  # 0: the tile
    assert WindowPlan(kv_block=64).kv_block_for(layout) == 128  # window lists are of whole tiles
    assert DSVPlan(kv_block=96).geometry(layout, 1) is None  # does not divide the tile: dense
    padded = token_layout((3, 4, 5), (2, 4, 4))
    geometry = DSVPlan(kv_block=16).geometry(padded, batch=2)
    assert geometry.kv_valid.shape == (2, padded.seq_len // 16)
    np.testing.assert_array_equal(geometry.kv_valid[0], padded.kv_valid(16))


def test_each_plan_answers_its_flops_and_context_parallel_costs():
    layout = token_layout((8, 4, 4), (2, 4, 4))  # 4 tiles of 32 tokens
    assert DensePlan().kept_fraction(layout) == 1.0
    assert DSVPlan(sparse=False, keep=0.5).kept_fraction(layout) == 1.0  # measures, attends densely
    half = DSVPlan(sparse=True, keep=0.5)
    assert half.kept_fraction(layout) == 0.5
    assert half.kept_fraction(layout, keep_heads=[0.1, 0.9]) == pytest.approx((1 + 2) / 2 / 4)  # capped at top_k 2
    load = half.cp_workload(layout, heads=2, keep_heads=[0.1, 0.9])
    assert (load.q_tile, load.kv_block, load.top_k) == (32, 32, 2)
    np.testing.assert_allclose(load.keep, [0.25, 0.5])  # clipped to one block, capped at the plan's keep
    window = WindowPlan(sparse=True, window=0.5)
    assert window.kept_fraction(layout) == 0.5  # 2 of the 4 tiles along t
    load = window.cp_workload(layout, heads=3)
    assert load.top_k == 2 and load.keep.tolist() == [0.5] * 3
    assert DensePlan().cp_workload(layout, heads=2).top_k == 4
    # the names an export and the CP placements use (placement keys are checkpointed: this format stays)
    assert half.describe() == "dsv keep<=0.5" and window.describe() == "window 0.5"
    assert DSVPlan(keep=0.5).describe() == "dense"
    assert half.placement_tag() == "dsv:0.5:0.333333" and window.placement_tag() == "window:0:0.5"


def _variant(**methods):
    """A sparse variant class with only `methods` defined (mode "test_variant")."""
    ns = {"__annotations__": {"mode": str}, "mode": "test_variant", **methods}
    return dataclasses.dataclass(frozen=True)(type("HalfPlan", (AttentionPlan,), ns))


def _selection(self, q, x, layout, geometry, **kw):
    return Selection()


def _kept(self, layout, keep_heads=None):
    return 0.5


def _cp(self, layout, heads, keep_heads=None):
    return ContextLoad(layout.tile_size, layout.tile_size, np.full(heads, 0.5), 1)


@pytest.mark.parametrize(
    "methods, missing",
    [
        ({"selection": _selection, "cp_workload": _cp}, "kept_fraction"),
        ({"selection": _selection, "kept_fraction": _kept}, "cp_workload"),
        ({"kept_fraction": _kept, "cp_workload": _cp}, "selection"),
    ],
)
def test_a_variant_without_its_flops_or_context_costs_is_refused(methods, missing):
    cls = _variant(**methods)
    with pytest.raises(TypeError, match=rf"HalfPlan \(mode 'test_variant'\) does not define {missing}"):
        register_plan(cls)
    assert "test_variant" not in PLANS
    # used without registering, it fails on first use, naming the class and the method
    layout = token_layout((8, 4, 4), (2, 4, 4))
    calls = {
        "kept_fraction": lambda p: p.kept_fraction(layout),
        "cp_workload": lambda p: p.cp_workload(layout, 2),
        "selection": lambda p: p.selection(None, None, layout, None),
    }
    with pytest.raises(NotImplementedError, match=f"HalfPlan does not define {missing}"):
        calls[missing](cls(sparse=True))


def test_a_complete_variant_registers_and_is_costed_everywhere():
    from dsv_jax.model.flops import kept_fractions

    cls = _variant(selection=_selection, kept_fraction=_kept, cp_workload=_cp)
    try:
        register_plan(cls)
        plan = AttentionPlan(mode="test_variant", sparse=True)
        assert type(plan) is cls and "test_variant" in sparse_modes()
        cfg = small_config("model.depth=2", "attention=test_variant", "dsv.dense_backend=xla")  # a valid choice now
        assert static_plans(cfg) == cls(sparse=True, backend="xla")
        assert kept_fractions(cfg, (4, 16, 16), plan) == [0.5, 0.5]
        assert plan.placement_tag() == "test_variant"
        with pytest.raises(ValueError, match="already HalfPlan's"):
            register_plan(_variant(selection=_selection, kept_fraction=_kept, cp_workload=_cp))
    finally:
        unregister_plan("test_variant")
    with pytest.raises(ConfigError, match="attention='test_variant' is not one of"):
        small_config("attention=test_variant")
    with pytest.raises(ValueError, match="mode 'dense' is already DensePlan's; give Nameless its own"):
        register_plan(dataclasses.dataclass(frozen=True)(type("Nameless", (AttentionPlan,), {})))
    with pytest.raises(TypeError, match="frozen"):
        register_plan(type("Loose", (DSVPlan,), {}))


def test_context_attention_is_a_context_backend():
    import jax

    from dsv_jax.model.attention import context_backend
    from dsv_jax.parallel.context import ContextAttention

    mesh = jax.make_mesh((1,), ("context",))
    cp = ContextAttention(mesh)
    assert isinstance(cp, ContextBackend) and cp.token_multiple == 1
    assert context_backend(DSVPlan(backend=cp)) is cp and context_backend(cp) is cp
    assert context_backend(DSVPlan()) is None and context_backend("xla") is None

    class Partial(ContextBackend):  # an implementation missing members cannot be built
        def __call__(self, q, k, v, **kw):
            return q

    with pytest.raises(TypeError, match="abstract"):
        Partial()


# `plan.mode`, `p.mode`, `self.plan.mode`, `plans[0].mode` ... compared to anything (bucketing's and the
# AdaLN layer's `self.mode` are other things and do not match)
MODE_COMPARISON = re.compile(r"\b(?:\w*plan\w*|p)(?:\[[^\]]*\])?\.mode\s*(?:==|!=|\bin\b|\bnot in\b)")


def test_no_code_outside_the_plan_asks_a_plan_its_mode():
    assert MODE_COMPARISON.search('if plan.mode == "window":') and MODE_COMPARISON.search("p.mode in ('dsv',)")
    assert MODE_COMPARISON.search("plans[0].mode != 'dsv'") and not MODE_COMPARISON.search("self.mode == 'dual'")
    hits = []
    for package in ("dsv_jax", "experiments"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                path = os.path.join(folder, name)
                if not name.endswith(".py") or path.endswith(os.path.join("dsv", "plan.py")):
                    continue
                with open(path, encoding="utf-8") as f:
                    for i, line in enumerate(f, 1):
                        if MODE_COMPARISON.search(line):
                            hits.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not hits, "ask the plan (dsv_jax/dsv/plan.py) instead:\n" + "\n".join(hits)
