"""MFU of the training loop: the FLOPs of each step (dsv_jax/model/flops.py) over a logging window.

meter = StepFlops(cfg, mesh)
window += meter(shape, global_batch, plans, inputs)     # per step: [dense-equivalent, work] FLOPs
record.update(meter.metrics(window, seconds))           # tflops_per_device, mfu/dense_equiv, mfu/work
"""

from __future__ import annotations

import numpy as np

from dsv_jax.config import Config
from dsv_jax.dsv.plan import tiled
from dsv_jax.model.flops import kept_fractions, mfu_metrics, peak_flops, train_step_flops


class StepFlops:
    def __init__(self, cfg: Config, mesh):
        self.cfg = cfg
        self.devices = int(mesh.devices.size)
        device = mesh.devices.flat[0]
        self.peak = peak_flops(device.device_kind, device.platform)  # None: MFU is left out of the metrics
        self._cache: dict = {}

    def __call__(self, shape, batch: int, plans, inputs=None) -> np.ndarray:
        """[dense-equivalent, work] FLOPs of one train step of `batch` samples (all devices together)."""
        keep = None if inputs is None or "keep" not in inputs else np.asarray(inputs["keep"])
        key = (tuple(shape), int(batch), plans, None if keep is None else keep.tobytes())
        if key not in self._cache:
            kept = kept_fractions(self.cfg, shape, plans, inputs)
            # stage-2 steps between the predictor's (dsv.stage2_predictor_every) skip its loss
            blocks = plans if isinstance(plans, (list, tuple)) else (plans,)
            trains = bool(self.cfg.predictor_rank) and any(getattr(p, "predictor", False) for p in blocks)
            f = train_step_flops(self.cfg, shape, batch, kept=kept, predictor=trains, tiles=tiled(plans))
            if any(getattr(p, "model_frozen", False) for p in blocks):
                f = frozen_model_flops(f, selection=bool(np.any(np.asarray(kept) < 1)))
            self._cache[key] = np.array([f["dense_equiv"], f["work"]])
        return self._cache[key]

    def metrics(self, flops: np.ndarray, seconds: float) -> dict[str, float]:
        return mfu_metrics(float(flops[0]), float(flops[1]), seconds, self.devices, self.peak)


def frozen_model_flops(f: dict[str, float], selection: bool = False) -> dict[str, float]:
    """`train_step_flops` `f` of a step that trains the DSV predictors alone (dsv.freeze_model_stage1): the
    model runs its forward once (no backward, so no remat either); the predictor's forward and backward and
    the selection (where a block selects) as in any step. Its model FLOPs are that one forward's."""
    model = f["forward_linear"] + f["forward_text_attention"]
    dense = model + f["forward_video_attention_dense"]
    work = model + f["forward_video_attention"] + 3 * f["forward_predictor"] + f["forward_selection"] * selection
    return {"dense_equiv": dense, "work": work}
