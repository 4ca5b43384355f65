"""DSV retrofitted onto pretrained weights: `train --init-from` (an export's weights, its config as the default,
the mismatch error, a checkpoint's precedence), `dsv.freeze_model_stage1` (stage 1 trains the predictors alone,
bitwise), the per-block recall and keep ratios of the end-of-run summary, and every command of wan.md's
"DSV on a pretrained Wan model" run at tiny sizes."""

from __future__ import annotations

import jax
import numpy as np

from tests.conftest import small_config

FREEZE_RUN = [
    "attention=dsv",
    "dsv.rank=4",
    "dsv.freeze_model_stage1=true",
    "dsv.stage1_steps=3",
    "dsv.profile_every=2",
    "data.buckets=[[4,16,16]]",
    "data.bucket_weights=[1]",
    "train.ema_decay=0.9",
    "train.steps=5",
    "train.ckpt_every=100",
]


def _leaves(params) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def test_stage_one_trains_the_predictors_alone_bitwise(tmp_path):
    """Three stage-1 steps leave every parameter but the predictors' (and their EMA) bitwise as they were,
    weight decay and all; the predictors move; stage 2 then trains the model."""
    from dsv_jax.train.trainer import Trainer

    trainer = Trainer(small_config(*FREEZE_RUN), str(tmp_path / "run"), progress=False)
    try:
        start, start_ema = _leaves(trainer.state.params), _leaves(trainer.state.ema)
        records = trainer.run(stop_at=3)
        assert [r["dsv/stage"] for r in records if "loss" in r] == [1, 1, 1]
        after, after_ema = _leaves(trainer.state.params), _leaves(trainer.state.ema)
        predictor = {k for k in start if "predictor" in k}
        assert predictor and len(predictor) < len(start)
        for k in start:
            if k in predictor:
                assert not np.array_equal(after[k], start[k]), k
            else:
                assert after[k].tobytes() == start[k].tobytes(), k
                assert after_ema[k].tobytes() == start_ema[k].tobytes(), k
        assert all(r["grad_norm"] == 0 for r in records if "loss" in r)  # no gradient reached the model
        records = trainer.run()
        assert [r["dsv/stage"] for r in records if "loss" in r] == [2, 2]
        moved = _leaves(trainer.state.params)
        changed = [k for k in start if k not in predictor and not np.array_equal(moved[k], start[k])]
        assert len(changed) > (len(start) - len(predictor)) // 2  # (AdaLN-Zero's gated paths wait for their gates)
    finally:
        trainer.close()
