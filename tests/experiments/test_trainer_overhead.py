"""experiments/trainer_overhead.py --dsv: its arms and the DSV state it times."""

import numpy as np

from dsv_jax.config import get_config
from dsv_jax.dsv.controller import DSVController
from experiments.trainer_overhead import dense_stage2, dsv_arms


class Args:
    quick, preset, cycles = False, "tiny", 1


def test_dsv_arms_differ_only_in_attention_and_backoff():
    arms = dsv_arms(Args())
    cfgs = {name: get_config("tiny", overrides) for name, overrides in arms.items()}
    assert cfgs["full"].attention == "auto" and cfgs["dsv"].attention == "dsv"
    assert cfgs["dsv"].dsv.backoff_max_every == 400 and cfgs["dsv_no_backoff"].dsv.backoff_max_every == 0
    assert cfgs["full"].data == cfgs["dsv"].data == get_config("tiny").data  # the preset's buckets, same batches
    assert cfgs["full"].train.steps > 400 and cfgs["dsv"].train.eval_every == 0


def test_dense_stage2_is_the_backoff_steady_state():
    """Stage 2, every block dense, the back-off at its cap: the next profile of each bucket half a cycle in,
    then one every backoff_max_every steps; before the back-off, the usual schedule."""
    cfg = get_config("tiny", dsv_arms(Args())["dsv"])
    shapes = [tuple(s) for s in cfg.data.buckets]
    ctl = DSVController(cfg)
    dense_stage2(ctl, shapes, backed_off=True)
    assert ctl.stage == 2 and all(not p.sparse for s in shapes for p in ctl.plans(s))
    assert ctl.intervals(shapes[0]) == (400, 64)  # profile_every 25 x 16, stage2_predictor_every 4 x 16
    assert next(s for s in range(1000) if ctl.profile_due(s, shapes[0])) == 200
    for shape in shapes:  # a profile that leaves the blocks dense keeps the cap
        metrics = {"dsv/predictor_loss": np.ones(cfg.model.depth), "dsv/sparsity": np.zeros((cfg.model.depth, 4))}
        ctl.observe(200, shape, metrics)
    assert next(s for s in range(201, 1000) if ctl.profile_due(s, shapes[0])) == 600
    dense_stage2(ctl, shapes, backed_off=False)
    assert ctl.intervals(shapes[0]) == (25, 4) and ctl.profile_due(25, shapes[0])
