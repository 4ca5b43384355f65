"""experiments/bench_sample.py --codecs: a --quick run times the tiny umT5 and VAE on the CPU beside the DiT, and
its end-to-end totals are the sums of their parts (the ratio: full attention's total over the variant's)."""

import importlib.util

import pytest

from experiments import bench_sample

MISSING = [m for m in bench_sample.CODEC_PACKAGES if importlib.util.find_spec(m) is None]


@pytest.mark.skipif(
    bool(MISSING),
    reason=f"{', '.join(MISSING)} not installed: the test extra installs torch (the CPU build) and the Wan "
    "models' packages on Python < 3.12 only",
)
def test_quick_codecs_time_text_and_decode_and_add_up_end_to_end(monkeypatch):
    written = {}
    monkeypatch.setenv("DSV_JAX_TORCH_DEVICE", "cpu")
    monkeypatch.setattr(bench_sample.harness, "write_results", lambda name, payload: written.update(payload))
    monkeypatch.setattr("sys.argv", ["bench_sample", "--quick", "--codecs", "--no-check", "--repeats", "1"])
    bench_sample.main()
    codecs, e2e = written["codecs"], written["end_to_end"]
    assert codecs["text_encode_s"] > 0 and codecs["vae_decode_s"] > 0 and len(codecs["vae_decode_times_s"]) == 1
    assert codecs["device"] == "cpu" and codecs["dtype"] == {"text": "bfloat16", "vae": "float32"}
    assert codecs["text_tokens"] == [2, 16] and codecs["latents"] == [1, 16, 3, 16, 24]
    assert codecs["frames"] == [9, 128, 192]  # Wan's VAE: 1 + 4 (t - 1) frames, 8x in space
    assert set(e2e) == {"full", "dsv0.9"}
    for variant, row in e2e.items():
        assert row["dit_50_steps_s"] == written["variants"][variant]["projected_50_steps_s"]
        parts = codecs["text_encode_s"] + row["dit_50_steps_s"] + codecs["vae_decode_s"]
        assert row["total_s"] == pytest.approx(parts)
        assert row["speedup_vs_full"] == pytest.approx(e2e["full"]["total_s"] / row["total_s"])
    assert e2e["full"]["speedup_vs_full"] == 1.0
