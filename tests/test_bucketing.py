"""The batch-size rules and the cost model (no jax, no grain: fast)."""

import json
import math

import numpy as np
import pytest

from dsv_jax.config import ConfigError
from dsv_jax.data.bucketing import BatchRule, batch_rule, dual_constraint_batch_size, equal_token_batch_size
from dsv_jax.data.cost_model import CostModel, fit_cost_model, step_time_cv
from dsv_jax.data.feed import SyntheticFeed
from tests.conftest import small_config


def test_dual_constraint_matches_its_definition_on_random_inputs():
    rng = np.random.default_rng(7)
    for _ in range(500):
        s = int(rng.integers(1, 200_000))
        m_mem = float(rng.uniform(1, 1e6))
        m_comp = float(rng.uniform(1, 1e9))
        p = float(rng.uniform(1.0, 2.0))
        b = dual_constraint_batch_size(s, m_mem, m_comp, p)
        # the largest B >= 1 within both budgets, or 1 when even one sample exceeds them
        assert b >= 1
        if b > 1:
            assert b * s <= m_mem and b * s**p <= m_comp * (1 + 1e-12)
        assert (b + 1) * s > m_mem or (b + 1) * s**p > m_comp


def test_dual_constraint_regimes():
    # memory binds for short sequences, compute for long ones (p > 1)
    assert dual_constraint_batch_size(100, 10_000, 1e9, 1.5) == 100
    assert dual_constraint_batch_size(10_000, 1e6, 1e7, 1.5) == 10  # 1e7 / 1e6
    assert dual_constraint_batch_size(10_000, 1e6, 1e3, 1.5) == 1  # never zero


@pytest.mark.parametrize(
    "args, needle",
    [
        ((0, 10, 10, 1.5), "seq_len=0"),
        ((-3, 10, 10, 1.5), "seq_len=-3"),
        ((5, 0, 10, 1.5), "m_mem=0"),
        ((5, 10, -1, 1.5), "m_comp=-1"),
        ((5, 10, 10, 0), "p=0"),
    ],
)
def test_dual_constraint_rejects_bad_input(args, needle):
    with pytest.raises(ValueError, match=needle):
        dual_constraint_batch_size(*args)


def test_rule_rounds_to_the_data_parallel_size_and_caps():
    rule = BatchRule("dual", max_batch=48, multiple=8, m_mem=4096, m_comp=2e5, p=1.3)
    for s in (16, 64, 256, 1024, 4096):
        b = rule(s)
        assert b % 8 == 0 and 8 <= b <= 48
        raw = dual_constraint_batch_size(s, 4096, 2e5, 1.3)
        assert b == max(8, min(raw, 48) // 8 * 8)
    equal = BatchRule("equal_tokens", max_batch=64, tokens_per_batch=2048)
    assert equal(256) == equal_token_batch_size(256, 2048, 64, 1)


def test_dual_gives_long_sequences_fewer_samples_than_equal_tokens():
    eq = BatchRule("equal_tokens", max_batch=10_000, tokens_per_batch=65536)
    dual = BatchRule("dual", max_batch=10_000, m_mem=65536, m_comp=65536 * 1024**0.4, p=1.4)
    lens = [256, 1024, 4096, 16384]
    assert [dual(s) for s in lens][:2] == [eq(s) for s in lens][:2]  # memory-bound: the same
    assert all(dual(s) < eq(s) for s in lens[2:])  # compute-bound: fewer
    work = [dual(s) * s**1.4 for s in lens]
    assert max(work) / min(work) < (eq(16384) * 16384**1.4) / (eq(256) * 256**1.4)


def test_batch_rule_reads_the_cost_model(tmp_path):
    path = str(tmp_path / "cost.json")
    CostModel(a=0.01, b=1e-9, p=1.37, m_mem=5000.0, m_comp=3e6).save(path)
    cfg = small_config("data.batching=dual", f"data.cost_model={path}")
    rule = batch_rule(cfg.data, multiple=2)
    assert (rule.m_mem, rule.m_comp, rule.p) == (5000.0, 3e6, 1.37)
    # explicit settings win over the file
    rule = batch_rule(small_config("data.batching=dual", f"data.cost_model={path}", "data.cost_p=1.2").data)
    assert rule.p == 1.2 and rule.m_mem == 5000.0
    # a cost model without budgets is a clear error
    CostModel(a=0.01, b=1e-9, p=1.37).save(path)
    with pytest.raises(ValueError, match="data.m_mem, data.m_comp"):
        batch_rule(small_config("data.batching=dual", f"data.cost_model={path}").data)
    with pytest.raises(FileNotFoundError, match="fit-cost"):
        batch_rule(small_config("data.batching=dual", f"data.cost_model={tmp_path}/none.json").data)
    with pytest.raises(ConfigError, match="data.cost_model"):
        small_config("data.batching=dual")


def test_synthetic_feed_uses_the_dual_rule():
    cfg = small_config(
        "data.batching=dual", "data.m_mem=512", "data.m_comp=600", "data.cost_p=1.5", "data.max_batch=64"
    )
    feed = SyntheticFeed(cfg, batch_multiple=2)
    for shape in feed.shapes:  # (1,16,16): S=16, (4,16,16): S=64 with patch (1,4,4)
        s = int(np.prod(shape)) // 16
        assert feed.batch_size(shape) == max(2, min(dual_constraint_batch_size(s, 512, 600, 1.5), 64) // 2 * 2)
    assert feed.batch_size((1, 16, 16)) == 8 and feed.batch_size((4, 16, 16)) == 2
    batch = feed.batch_at(0, (1, 16, 16))
    assert batch["latents"].shape[0] == 8


def test_fit_recovers_parameters_from_noisy_steps():
    rng = np.random.default_rng(11)
    a, b, p = 0.0123, 2.7e-9, 1.41
    B = rng.integers(1, 33, 40)
    S = rng.choice([257, 1031, 4099, 16411, 32771], 40)
    t = (a + b * B * S**p) * (1 + 0.01 * rng.standard_normal(40))
    model = fit_cost_model(B, S, t)
    assert abs(model.p - p) < 0.03
    assert model.r2 > 0.99 and model.max_rel_error < 0.05
    pred = model.predict(B, S)
    np.testing.assert_allclose(pred, a + b * B * S**p, rtol=0.06)
    # the budget for a target step time inverts the model
    m_comp = model.compute_budget_for(0.5)
    assert model.predict(1, m_comp ** (1 / model.p)) == pytest.approx(0.5, rel=1e-9)


def test_fit_rejects_unidentifiable_or_bad_data():
    with pytest.raises(ValueError, match="at least 3"):
        fit_cost_model([1, 2], [10, 20], [0.1, 0.2])
    with pytest.raises(ValueError, match="two sequence lengths"):
        fit_cost_model([1, 2, 4], [64, 64, 64], [0.1, 0.2, 0.4])
    with pytest.raises(ValueError, match="step_times must be finite and > 0"):
        fit_cost_model([1, 2, 4], [64, 128, 256], [0.1, -0.2, 0.4])
    with pytest.raises(ValueError, match="differ in length"):
        fit_cost_model([1, 2, 4], [64, 128], [0.1, 0.2, 0.4])


def test_cost_model_json_roundtrip(tmp_path):
    m = CostModel(
        a=0.5,
        b=3e-7,
        p=1.33,
        r2=0.998,
        max_rel_error=0.02,
        m_mem=123.0,
        m_comp=4.5e6,
        info={"points": [{"batch": np.int64(2), "time_s": np.float32(0.25)}]},
    )
    path = m.save(str(tmp_path / "sub" / "cost.json"))
    back = CostModel.load(path)
    assert (back.a, back.b, back.p, back.m_mem, back.m_comp) == (0.5, 3e-7, 1.33, 123.0, 4.5e6)
    assert back.info["points"][0] == {"batch": 2, "time_s": 0.25}
    assert back.predict(4, 100) == pytest.approx(0.5 + 3e-7 * 4 * 100**1.33)
    (tmp_path / "bad.json").write_text(json.dumps({"a": 1, "b": 2}))
    with pytest.raises(ValueError, match=r"lacks field\(s\) \['p'\]"):
        CostModel.load(str(tmp_path / "bad.json"))


def test_step_time_cv():
    assert step_time_cv([1.0, 1.0, 1.0]) == 0.0
    assert step_time_cv([1.0, 3.0]) == pytest.approx(0.5)
    assert math.isnan(step_time_cv([1.0]))


def test_everything_but_the_dataset_path_works_without_grain():
    """The GPU machine has no grain: importing dsv_jax, the trainer and fit-cost, and
    feeding the embedded dataset, must not import grain or array_record."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        "import sys; sys.modules['grain'] = None; sys.modules['array_record'] = None\n"
        "import dsv_jax.cli, dsv_jax.train.trainer, dsv_jax.train.shape_bench\n"
        "from dsv_jax.data.feed import make_feed\n"
        "from tests.conftest import small_config\n"
        "feed = make_feed(small_config('data.batching=dual', 'data.m_mem=512', 'data.m_comp=600', 'data.cost_p=1.5'),"
        " batch_multiple=1, process_index=0, process_count=1)\n"
        "print(next(feed)['latents'].shape)\n"
        "try:\n"
        "    make_feed(small_config('data.path=/nowhere'), batch_multiple=1, process_index=0, process_count=1)\n"
        "except ImportError as e:\n"
        "    print('needs grain:', e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=dict(os.environ, PYTHONPATH=root),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "needs grain: data.path needs grain and array_record" in r.stdout
    assert r.stdout.splitlines()[0].startswith("(")


def test_predicted_schedule_and_balanced_target():
    from dsv_jax.data.cost_model import balance_target, predict_schedule

    model = CostModel(a=1e-4, b=2e-9, p=1.4)  # per-sample work dominates the fixed cost of a step
    seq = np.array([256, 1792, 7168, 14336])
    shares = np.array([0.3, 0.1, 0.3, 0.3])
    m_mem = 8 * 14336
    equal = [BatchRule("equal_tokens", max_batch=10_000, tokens_per_batch=m_mem)(s) for s in seq]
    pred = predict_schedule(model, seq, shares, equal)
    freq = shares / np.array(equal) / np.sum(shares / np.array(equal))  # steps per bucket ~ samples / B
    t = model.predict(equal, seq)
    assert pred["mean_step_s"] == pytest.approx(np.sum(freq * t))
    assert pred["cv"] == pytest.approx(np.sqrt(np.sum(freq * (t - np.sum(freq * t)) ** 2)) / np.sum(freq * t))
    assert pred["tokens_per_s"] == pytest.approx(np.sum(freq * np.array(equal) * seq) / np.sum(freq * t))

    def dual(target):
        rule = BatchRule("dual", max_batch=10_000, m_mem=m_mem, m_comp=model.compute_budget_for(target), p=model.p)
        return [rule(s) for s in seq]

    target, sweep = balance_target(model, seq, shares, dual, equal, max_loss=0.03)
    chosen = next(s for s in sweep if s["target_s"] == target)
    ok = [s for s in sweep if s["tokens_per_s_ratio"] >= 0.97]
    assert chosen in ok and chosen["cv"] <= min(s["cv"] for s in ok) + 1e-4
    assert chosen["cv"] < 0.25 * pred["cv"]  # much more even than equal tokens (0.03 vs 0.17)
    assert all(d <= e for d, e in zip(chosen["batch"], equal))  # never above the memory cap
