"""DSV dynamic sparse attention: low-rank predictor, sparsity profiler, selection, two-stage controller.

    plan.py        AttentionPlan: the static per-block attention decision (hashable, backend-agnostic),
                   one class per mode (dense, DSV) registered by name, answering its geometry and costs
    window.py      WindowPlan: the window baseline's plan (a sparse variant in one file)
    predictor.py   LowRankPredictor and its loss
    selection.py   top-k KV blocks per query tile (with per-head counts), window baseline index lists
    profiler.py    sparsity / recall statistics from exact attention rows of sampled queries
    backend.py     the "dsv" and "window" attention backends (registered on import of this package)
    controller.py  stage 1 -> stage 2, per-block sparse/dense decisions on a keep ladder (host side)
    policy.py      the attention-policy interface the training loop talks to (static, or the controller)

The block glue that runs a plan inside a transformer block is the model's (`dsv_jax.model.attention`).
"""

from dsv_jax.dsv import backend as _backend  # noqa: F401  (registers the "dsv" and "window" backends)
from dsv_jax.dsv import window as _window  # noqa: F401  (registers the "window" plan)
