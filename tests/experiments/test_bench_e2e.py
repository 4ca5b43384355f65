"""experiments/bench_e2e.py: what a DSV variant reports (top_k, kept) and what its components select come from
the plans the step runs, at their KV block (`--set dsv.kv_block=16`), not from the layout's 3D tile."""

import argparse
import math

import jax
import numpy as np
import pytest

from experiments import bench_e2e


def quick_bench(*overrides):
    args = argparse.Namespace(
        quick=True,
        budget_s=60.0,
        steps=1,
        profile=None,
        compile_workers=1,
        only="",
        preset="",
        name="x",
        set=list(overrides),
    )
    return bench_e2e.Bench(args, bench_e2e.SETUPS["quick"])


@pytest.mark.parametrize("kv_block", [16, 32, 0])
def test_dsv_variants_report_the_blocks_of_the_plan_they_run(kv_block):
    bench = quick_bench(f"dsv.kv_block={kv_block}")
    layout = bench.layout("64k")  # quick: 16 x 8 x 8 tokens in 4x4x4 tiles, 1024 tokens
    assert layout.seq_len == 1024 and layout.tile_size == 64
    st = bench.attention_setup("64k", "dsv0.9")
    plan = st["attention"][0]
    blocks = layout.seq_len // (kv_block or 64)
    assert plan.kv_block == kv_block
    assert st["top_k"] == math.ceil(plan.keep * blocks - 1e-9) == plan.top_k(blocks)
    # every head keeps 10%: ceil(0.1 x blocks) of its blocks (16-token blocks: 7 of 64, not 2 of 16)
    assert st["kept"] == pytest.approx(math.ceil(0.1 * blocks - 1e-4) / blocks)
    assert st["kept"] == pytest.approx(plan.kept_fraction(layout, np.full(2, 0.1)))
    assert st["kv_block"] == (kv_block or 64) and st["q_tile"] == 64
    jobs = dict(bench.component_jobs("64k", [{"attention": "dsv0.9", "adaln": "xla"}]))
    index, count = jobs["64k/comp/sel/dsv0.9"]().out_info
    assert index.shape == (1, 2, layout.seq_len // 64, st["top_k"]) and count.shape == (1, 2, 16)
    attn = jobs["64k/comp/attn_f/dsv0.9"]()
    assert attn.out_info.shape == (1, layout.seq_len, 2, bench.cfg.model.head_dim)
    jax.clear_caches()
