"""experiments/granularity.py: the box grouping of keys, which in-tile orders make boxes contiguous, the keep
ratios of each method on an attention whose mass sits in one box, and the study end to end (--quick, CPU)."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import granularity as g
from tests.conftest import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TILE = (4, 4, 4)


@pytest.mark.parametrize("order", g.ORDERS)
@pytest.mark.parametrize("box", g.BOXES)
def test_boxes_partition_the_tile_by_coordinates_in_any_order(box, order):
    coords = g.in_tile_order(TILE, order)
    assert sorted(map(tuple, coords)) == sorted(map(tuple, np.indices(TILE).reshape(3, -1).T))  # every token once
    shape = g.parse_box(box)
    perm = g.box_permutation(coords, TILE, shape)
    size = int(np.prod(shape))
    groups = coords[perm].reshape(-1, size, 3)
    assert sorted(perm.tolist()) == list(range(64)) and len(groups) == 64 // size
    for members in groups:  # one box each: the same box cell, and spanning exactly the box's extent
        assert (members // shape == members[0] // shape).all()
        assert tuple(members.max(0) - members.min(0) + 1) == shape
    # the grouping is by coordinates: the same boxes (as sets of tokens) whatever the order
    ref = g.in_tile_order(TILE, "raster_thw")
    same = {frozenset(map(tuple, m)) for m in ref[g.box_permutation(ref, TILE, shape)].reshape(-1, size, 3)}
    assert {frozenset(map(tuple, m)) for m in groups} == same


def test_2x2x4_boxes_split_a_4x4x4_tile_in_four_and_bad_boxes_are_refused():
    perm = g.box_permutation(g.in_tile_order(TILE, "raster_thw"), TILE, (2, 2, 4))
    assert perm.reshape(4, 16).shape == (4, 16)
    with pytest.raises(ValueError, match="does not divide the token grid"):
        g.box_permutation(g.in_tile_order(TILE, "raster_thw"), TILE, (3, 1, 1))
    with pytest.raises(ValueError, match="is not '1' or 'TxHxW'"):
        g.parse_box("2x2")
    assert g.parse_box("1") == (1, 1, 1) and g.box_name((2, 2, 4)) == "2x2x4" and g.box_name((1, 1, 1)) == "1"


def test_which_in_tile_order_makes_each_box_a_contiguous_aligned_range():
    aligned = {o: [b for b in g.BOXES if g.contiguity(g.parse_box(b), TILE, o)["aligned"]] for o in g.ORDERS}
    assert aligned == {
        "raster_thw": ["1", "1x1x4", "1x2x4", "1x4x4", "2x4x4", "4x4x4"],
        "morton_thw": ["1", "1x2x2", "2x2x2", "2x2x4", "2x4x4", "4x4x4"],
    }
    assert not g.contiguity((1, 2, 2), TILE, "raster_thw")["contiguous"]
    # today's layout lists a tile's tokens in raster order
    from dsv_jax.model.tokens import token_layout

    layout = token_layout((4, 8, 8), TILE)
    assert np.array_equal(layout.coords[:64], g.in_tile_order(TILE, "raster_thw"))


def test_keep_ratios_count_the_leading_entries_that_reach_theta():
    mass = np.array([[0.5, 0.3, 0.1, 0.1], [0.91, 0.03, 0.03, 0.03]])
    np.testing.assert_allclose(g.keep_ratios(mass, (0.8, 0.9)), [[0.5, 0.25], [0.75, 0.25]])


def test_every_method_keeps_one_box_when_all_attention_mass_sits_in_it():
    """Every query attends (logit ~35 against 0) to the 16 keys of one 2x2x4 box of a 4 x 8 x 8 grid of 4x4x4
    tiles: the oracle, DSV's rule and the predictor (here q, k's first dims) keep 1 of the 16 such boxes; finer
    boxes keep the pieces the box splits into, coarser ones the box holding it, single tokens 15 or 16."""
    from dsv_jax.model.tokens import token_layout

    grid = (4, 8, 8)
    layout = token_layout(grid, TILE)
    target = np.all(layout.coords // np.array([2, 2, 4]) == [1, 0, 1], axis=1)  # t 2-3, h 0-1, w 4-7
    d, s = 8, layout.seq_len
    k = jnp.zeros((1, s, 2, d)).at[0, np.flatnonzero(target), :, 0].set(10.0)
    q = jnp.zeros((1, s, 2, d)).at[..., 0].set(10.0)
    fn = g.curve_fn(grid, TILE, g.BOXES, (1, 32, 64, 128), 16, 256, True, 2)
    out = {key: g.keep_ratios(np.asarray(v)) for key, v in fn(q, k, q[..., :4], k[..., :4]).items()}
    expected = {  # box -> keep ratio at (0.9, 0.95)
        "1": (15 / 256, 16 / 256),
        "1x1x4": (4 / 64, 4 / 64),
        "1x2x2": (4 / 64, 4 / 64),
        "2x2x2": (2 / 32, 2 / 32),
        "1x2x4": (2 / 32, 2 / 32),
        "1x4x4": (2 / 16, 2 / 16),
        "2x2x4": (1 / 16, 1 / 16),
        "2x4x4": (1 / 8, 1 / 8),
        "4x4x4": (1 / 4, 1 / 4),
    }
    assert len(out) == 3 * 4 * len(g.BOXES)
    for (method, qt, box), keep in out.items():
        np.testing.assert_allclose(keep, np.broadcast_to(np.array(expected[box])[:, None], (2, 2)), err_msg=box)


def run_study(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
    env.pop("OUT", None)
    cmd = [sys.executable, "-m", "experiments.granularity", "--quick", "--results-dir", str(tmp_path / "results")]
    r = subprocess.run(
        cmd + ["--workdir", str(tmp_path / "work"), *args],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "results" / "granularity_quick.json") as f:
        return json.load(f), r.stdout + r.stderr


def test_study_measures_every_granularity_and_resumes(tmp_path):
    out, log = run_study(tmp_path, "--steps", "1", "--measure-at", "1")
    assert (tmp_path / "results" / "granularity_quick.png").exists() and "step 1: keep ratio holding 90%" in log
    assert out["tile"] == [4, 4, 4] and out["tokens"] == 256 and out["in_tile_order_today"] == "raster_thw"
    assert out["contiguity"]["2x2x4"] == {
        "raster_thw": {"contiguous": False, "aligned": False},
        "morton_thw": {"contiguous": True, "aligned": True},
    }
    rows = out["rows"]
    assert len(rows) == 2 * 3 * 4 * len(g.BOXES)  # theta x method x q_tile x box, one step
    keep = {(r["theta"], r["method"], r["q_tile"], r["box"]): r for r in rows}
    for r in rows:
        assert 0 < r["keep_sparsest_block"] <= r["keep"] <= r["keep_densest_block"] <= 1
    sizes = sorted(g.BOXES, key=lambda b: int(np.prod(g.parse_box(b))))
    nested = ["1", "1x2x2", "2x2x2", "2x2x4", "2x4x4", "4x4x4"]  # each box a union of the one before
    for theta in (0.9, 0.95):
        k = lambda m, qt, box: keep[(theta, m, qt, box)]["keep"]
        assert k("rule", 1, "1") == pytest.approx(k("oracle", 1, "1"))  # q . k ranks keys as the softmax does
        for qt in (1, 32, 64, 128):
            for box in sizes:  # the oracle is the best a shared list of these boxes can do
                assert k("oracle", qt, box) <= min(k("rule", qt, box), k("predictor", qt, box)) + 1e-9
            for fine, coarse in zip(nested, nested[1:]):
                assert k("oracle", qt, fine) <= k("oracle", qt, coarse) + 1e-9
        for box in sizes:  # a larger query tile shares one list among more queries
            assert k("oracle", 1, box) <= k("oracle", 32, box) <= k("oracle", 64, box) <= k("oracle", 128, box)
    assert keep[(0.9, "oracle", 1, "1")]["keep"] <= keep[(0.95, "oracle", 1, "1")]["keep"]
    record = out["records"]["1"]["t"]["0.5"]
    assert np.shape(record["keep_per_block"]["0.9"]["predictor"]["64"]["2x2x4"]) == (2,)  # [blocks]
    assert len(record["recall"]["rule"]["32"]["1x4x4"]) == len(out["recall_fractions"])

    again, log = run_study(tmp_path, "--steps", "1", "--measure-at", "1")
    assert "resuming the records" in log and "measured in" not in log  # nothing to train or measure again
    assert again["rows"] == rows
