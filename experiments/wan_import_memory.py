"""Peak host memory of `dsv-jax import-weights` on a multi-shard Wan checkpoint, against its largest shard.

    python -m experiments.wan_import_memory                # the 1.3B at full size (5.7 GB fp32, 2 GB shards)
    python -m experiments.wan_import_memory --quick        # a small config, seconds

The checkpoint is diffusers' own: `WanTransformer3DModel` of the `wan2.1-t2v-1.3b` sizes with random weights
(torch's CPU build), written by its `save_pretrained` in shards of at most --shard-size. The import runs as the
CLI in a child process; its peak resident set (ru_maxrss, which counts the mapped pages of the shards it reads
as well as its own arrays) is compared with a child that only imports what the CLI imports (jax, flax, orbax,
dsv_jax) and with the checkpoint's largest shard and the output's size (the parameters in --dtype).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from experiments import harness

SIZES = {
    "1.3b": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30, text_dim=4096),
    "quick": dict(num_attention_heads=8, attention_head_dim=64, ffn_dim=2048, num_layers=8, text_dim=512),
}
BASELINE = "import jax, flax.nnx, orbax.checkpoint, safetensors, dsv_jax.wan.convert, dsv_jax.cli; jax.devices()"


def child_peak_rss(cmd: list[str]) -> tuple[int, float]:
    """(peak RSS in bytes, seconds) of one child process (run alone: RUSAGE_CHILDREN keeps the maximum)."""
    code = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "r = subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.perf_counter() - t, r.returncode)"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, env=env, check=True)
    rss_kib, seconds, rc = out.stdout.split()[-3:]
    if int(rc):
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr[-2000:]}")
    return int(rss_kib) * 1024, float(seconds)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--shard-size", default="2GB", help="diffusers' max_shard_size of the source checkpoint")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--keep", action="store_true", help="keep the temporary folders")
    args = p.parse_args()
    from diffusers import WanTransformer3DModel

    size = "quick" if args.quick else "1.3b"
    shard_size = "20MB" if args.quick else args.shard_size
    root = tempfile.mkdtemp(prefix="wan_import_")
    try:
        t0 = time.perf_counter()
        model = WanTransformer3DModel(**SIZES[size])
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(os.path.join(root, "src"), max_shard_size=shard_size)
        del model
        print(f"wrote {n_params / 1e9:.2f}B parameters in {time.perf_counter() - t0:.0f} s")
        shards = sorted(
            os.path.getsize(os.path.join(root, "src", f))
            for f in os.listdir(os.path.join(root, "src"))
            if f.endswith(".safetensors")
        )
        base_rss, _ = child_peak_rss([sys.executable, "-c", BASELINE])
        cli = [sys.executable, "-m", "dsv_jax", "import-weights", "--from", os.path.join(root, "src")]
        peak, seconds = child_peak_rss([*cli, "--out", os.path.join(root, "out"), "--dtype", args.dtype])
        output = n_params * (2 if args.dtype == "bf16" else 4)
        row = {
            "parameters": n_params,
            "source_dtype": "float32",
            "shards": len(shards),
            "shard_bytes": shards,
            "largest_shard_bytes": shards[-1],
            "checkpoint_bytes": sum(shards),
            "output_dtype": args.dtype,
            "output_bytes": output,
            "import_seconds": seconds,
            "peak_rss_bytes": peak,
            "baseline_rss_bytes": base_rss,
            "peak_minus_baseline_bytes": peak - base_rss,
            "peak_over_largest_shard": peak / shards[-1],
            "peak_minus_baseline_over_output": (peak - base_rss) / output,
        }
        gib = 2**30
        print(
            f"{len(shards)} shards, largest {shards[-1] / gib:.2f} GiB, checkpoint {sum(shards) / gib:.2f} GiB; "
            f"output {output / gib:.2f} GiB ({args.dtype}); import {seconds:.0f} s, peak RSS {peak / gib:.2f} GiB "
            f"(imports alone {base_rss / gib:.2f} GiB): {peak / shards[-1]:.2f}x the largest shard"
        )
        name = "wan_import_memory" + ("_quick" if args.quick else "")
        harness.write_results(name, {"size": size, "command": " ".join(cli[1:]), **row})
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}")


if __name__ == "__main__":
    main()
