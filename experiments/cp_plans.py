"""What the trainer's context-parallel policy runs for one DSV stage-2 step of the 2.7B preset.

    python -m experiments.cp_plans          # CPU, seconds: fake devices, the planner's default H200 model

For 64k and 128k video tokens per sample on 8 and 32 devices (8 H200 per node, modelled links and
kernel rates of `dsv_jax.parallel.planner`), the same objects the trainer builds: a DSV controller in
stage 2 whose blocks are sparse at a keep rung with measured per-head keep ratios (uniform 0.1, and
skewed heads with the same mean), wrapped in `ContextPolicy` on a mesh of that many (fake CPU) devices.
Prints per block the placement (HCP x SCP, SCP strategy, head slots) and the bytes one device sends
per step in attention (forward, backward and the remat forward), next to the dense strategies' bytes
(ring, all-gather, Ulysses, the planner's dense hybrid). Writes experiments/results/cp_plans.json.
"""

from __future__ import annotations

from experiments.quick_cpu import use_cpu

use_cpu(devices=32, fast_compile=False)  # before jax starts: 32 fake CPU devices (nothing here is timed)

import jax  # noqa: E402

from dsv_jax.config import get_config  # noqa: E402
from dsv_jax.dsv.plan import AttentionPlan  # noqa: E402
from dsv_jax.model.tokens import grid_shape, token_layout  # noqa: E402
from dsv_jax.parallel.comm import context_bytes  # noqa: E402
from dsv_jax.parallel.mesh import make_mesh  # noqa: E402
from dsv_jax.parallel.policy import ContextPolicy  # noqa: E402
from experiments import harness  # noqa: E402
from experiments.training import stage2_controller  # noqa: E402

SHAPES = {"64k": (16, 128, 128), "128k": (32, 128, 128)}  # latents; patch 1x2x2 -> T x 64 x 64 tokens
KEEP = {"uniform 0.1": (0.1,) * 16, "skewed, mean 0.1": (0.4, 0.3, 0.2, 0.15) + (0.0458333,) * 12}
RUNG = 0.15  # the ladder rung that holds the largest uniform keep ratio; skewed heads need 0.5


def dense_bytes(cfg, seq_len, devices) -> dict[str, float]:
    """Per device per step (fwd + bwd + remat fwd) of one block's dense attention, per pure strategy."""
    m = cfg.model
    out = {}
    for name, (ph, ps, st) in {
        "ring": (1, devices, "ring"),
        "allgather": (1, devices, "allgather"),
        "ulysses": (devices if m.heads % devices == 0 else 0, 1, "allgather"),
    }.items():
        if not ph:
            continue
        parts = context_bytes(
            hcp=ph, scp=ps, scp_strategy=st, batch=1, seq_len=seq_len, heads=m.heads, head_dim=m.head_dim, itemsize=2
        )
        out[name] = 2 * (parts["hcp_forward"] + parts["scp_forward"]) + parts["hcp_backward"] + parts["scp_backward"]
    return out


def main() -> None:
    rows = []
    for devices in (8, 32):
        cfg = get_config(
            "2.7b", [f"parallel.context={devices}", "parallel.fsdp=1", "attention=dsv", "model.dtype=bfloat16"]
        )
        mesh = make_mesh(cfg.parallel, jax.devices()[:devices])
        for tokens, shape in SHAPES.items():
            seq_len = token_layout(grid_shape(shape, cfg.model.patch), cfg.model.tile).seq_len
            for keep_name, keep in KEEP.items():
                policy = ContextPolicy(stage2_controller(cfg, shape, keep), cfg, mesh, lambda s: 1)
                plans = policy.plans(shape, train=True)
                assert all(isinstance(p, AttentionPlan) and p.sparse for p in plans)
                record = policy.record(shape)
                placement = next(iter(policy.placements.values()))  # every block has the same keep here
                dense_parts = policy.summary([shape])
                row = {
                    "devices": devices,
                    "tokens": tokens,
                    "seq_len": seq_len,
                    "heads_keep": keep_name,
                    "rung": plans[0].keep,
                    "placement": f"{placement['hcp']}x{placement['scp']} {placement['scp_strategy']}",
                    "head_slots": placement["slots"],
                    "sparse_mb_per_block": placement["bytes"] / 1e6,
                    "sparse_mb_per_step": record["cp/bytes_per_step"] / 1e6,
                    "dense_hybrid": dense_parts[f"cp/{'x'.join(map(str, shape))}/plan"],
                    "modelled_attention_ms_per_block": 1e3 * placement["time_s"],
                }
                row.update({f"dense_{k}_mb_per_block": v / 1e6 for k, v in dense_bytes(cfg, seq_len, devices).items()})
                row["dense_hybrid_mb_per_block"] = policy._bytes(shape, None, "auto") / 1e6
                rows.append(row)
    columns = [
        "devices",
        "tokens",
        "heads_keep",
        "rung",
        "placement",
        "head_slots",
        "sparse_mb_per_block",
        "dense_ring_mb_per_block",
        "dense_allgather_mb_per_block",
        "dense_ulysses_mb_per_block",
        "dense_hybrid",
        "dense_hybrid_mb_per_block",
        "modelled_attention_ms_per_block",
    ]
    harness.print_table(rows, columns)
    harness.write_results(
        "cp_plans",
        {
            "preset": "2.7b",
            "batch_per_device": 1,
            "dtype": "bfloat16",
            "rows": rows,
            "note": "bytes per device, forward + backward + remat forward, one block",
        },
    )


if __name__ == "__main__":
    main()
