"""Sampling speed on Wan 2.1's shapes: the DiT's time for a guided sampling run through dsv_jax.generate's
compiled loop (dsv_jax.sample._sample with the preset's solver, UniPC for Wan: one program for all steps, the
conditional and the unconditional branch batched), full attention (cuDNN) against DSV stage 2 at a set
sparsity, the predictor's selection included. Random weights: these are speed figures. With --codecs, the
same run also times Wan's umT5 text encoder and its VAE decode, for end-to-end figures.

    python -m experiments.bench_sample --preset wan2.1-t2v-1.3b --length 480p --steps 50 [--codecs]
    python -m experiments.bench_sample --preset wan2.1-t2v-14b --length 720p --steps 2 [--codecs]  # x 25 for 50
    python -m experiments.bench_sample --quick [--codecs]                                  # CPU, tiny models

Per variant: compile time (lowered and compiled before any timing; nothing compiles while timed), then
--repeats runs of the whole loop of --steps guided steps (2 x steps forward passes at batch 2), each blocked
on; median and spread; the time per step and the projection to 50 steps (x 50 / steps: the loop's steps all
run the same program, so its time is linear in them). Text: random embeddings of the preset's 512 tokens (what
umT5 gives after Wan's zero-filled tail), a fresh random tensor per variant. Weights: random in bf16, made on
the device (a 14B model in fp32 would not fit one card with its activations). Before timing, both variants run
one step from the same noise and their outputs are compared at keep 1.0 (DSV through the sparse kernel with
every KV block) against full attention: the same velocity within bf16 rounding.

--codecs (PyTorch, before jax starts: see time_codecs), each timed as one warm-up then the median of --repeats
calls, waited for with torch.cuda.synchronize, on torch's GPU (else the CPU; $DSV_JAX_TORCH_DEVICE picks):
- text: Wan's umT5-XXL encoder (transformers' UMT5EncoderModel at Wan's sizes, random bf16 weights, as
  WanPipeline and the umt5: spec run it on a GPU) on the prompt and the negative prompt, one batch of
  2 x 512 random token ids, all 512 valid (the encoder runs every padded position anyway), the embeddings
  copied to the host in fp32 (as dsv_jax.sample encodes a prompt with its negative prompt; WanPipeline makes
  two calls of one). No tokenizer (none can be downloaded): a fast SentencePiece tokenizer takes about a
  millisecond for two captions, nothing beside these figures.
- VAE: diffusers' AutoencoderKLWan() (its default config is Wan 2.1's VAE) with random weights, decoding
  random latents of the sampled shape [1, 16, 21, 60, 104] (480p) or [1, 16, 21, 90, 160] (720p) to 81
  frames, to uint8 frames on the host; fp32 (--vae-dtype): what WanPipeline's documented example, Wan's own
  WanVAE and the wan2.1-vae: spec use (WanPipeline.from_pretrained(torch_dtype=bf16) without a separate VAE
  would give bf16). No tiling (WanPipeline's default). The latents' un-normalisation and their copy from jax
  (10-20 MB) are left out. The decode runs 1 + --repeats times: budget the run's time for it at 720p.
End to end per variant: text + the DiT's 50 steps (projected) + VAE decode, and its ratio to full attention.
--quick builds tiny random umT5 and VAE models from configs (as tests/test_wan_data.py), seconds on a CPU.

On the GPU machines' image (its package list as read 2026-11-17, Python 3.12): torch, transformers, tokenizers,
huggingface_hub, safetensors, accelerate and sentencepiece are there; diffusers is not (nor ftfy, which only
cleans real captions: not needed here). Carry the diffusers wheel: pure Python (py3-none-any), 0.42.1 needs
huggingface-hub >= 1.32, safetensors >= 0.8, filelock, numpy, regex, requests and Pillow, all in the image
(its importlib_metadata is imported on Python < 3.8 only): `pip download --no-deps -d .whl diffusers==0.42.1`
here, and there `python3 -m pip show huggingface_hub safetensors transformers` first.
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import contextlib
import gc
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv_jax.config import get_config
from dsv_jax.data import wan
from dsv_jax.dsv.plan import AttentionPlan
from dsv_jax.dsv.policy import make_policy
from dsv_jax.model.flops import forward_flops
from dsv_jax.model.t2v import TextToVideo
from dsv_jax.sample import _sample
from dsv_jax.solvers import make_schedule
from experiments import harness
from experiments.training import stage2_controller

LENGTHS = {"480p": (21, 60, 104), "720p": (21, 90, 160)}  # 81 frames: latent T x H x W (Wan's VAE: 4x8x8)
QUICK = [
    "model.hidden=64",
    "model.heads=2",
    "model.depth=2",
    "model.mlp_width=96",
    "model.text_dim=32",
    "text.max_len=16",
    "model.tile=[1,4,4]",
    "dsv.rank=8",
]
QUICK_LENGTH = (3, 16, 24)
# --codecs: Wan's umT5-XXL (the sizes of its text_encoder/config.json; the rest are UMT5Config's defaults)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
QUICK_UMT5 = dict(
    vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8
)
QUICK_VAE = dict(base_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=0)  # still 4x8x8 (AutoencoderKLWan(): Wan 2.1's)
CODEC_PACKAGES = ("torch", "diffusers", "transformers")
E2E_INCLUDES = "codecs' text_encode_s + the variant's projected_50_steps_s + codecs' vae_decode_s (one sample)"


def random_params(cfg, seed: int = 0):
    """(graphdef, bf16 parameters) of a random model made inside one jitted function, so that only the bf16
    copy is ever whole on the device; zero-initialised entries (gates, the final projection) get noise too, so
    that every block's attention reaches the output."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TextToVideo(cfg, rngs=nnx.Rngs(0))))

    @jax.jit
    def make(key):
        model = TextToVideo(cfg, rngs=nnx.Rngs(params=key))
        state = nnx.state(model, nnx.Param)
        leaves, tree = jax.tree.flatten(state)
        keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
        noisy = [(a + 0.02 * jax.random.normal(k, a.shape)).astype(jnp.bfloat16) for a, k in zip(leaves, keys)]
        return jax.tree.unflatten(tree, noisy)

    return graphdef, make(jax.random.key(seed))


def text_batch(cfg, seed: int) -> dict:
    """One prompt's random embeddings and an unconditional branch of zeros (as generate's batch holds them)."""
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((1, cfg.text.max_len, cfg.model.text_dim)).astype(np.float32)
    return {
        "text_emb": jnp.asarray(np.concatenate([emb, np.zeros_like(emb)])),
        "text_mask": jnp.ones((2, cfg.text.max_len), bool),
    }


def attention_for(cfg, shape, name: str):
    """(plans, runtime inputs) of a variant: full = the dense backend; dsvX = stage 2 at head sparsity X."""
    if name == "full":
        return "auto", None
    keep = 1.0 - float(name.removeprefix("dsv"))
    policy = make_policy(cfg, stage2_controller(cfg, shape, keep).state_dict())
    plans = policy.plans(shape, train=False)
    return (tuple(plans) if isinstance(plans, list) else plans), policy.inputs(shape, train=False)


def compile_loop(cfg, graphdef, params, batch, shape, steps, attention, inputs):
    schedule = make_schedule(cfg.train.sample_solver, steps, cfg.train.sample_shift)
    noise = jax.random.normal(jax.random.key(0), (1, *shape, cfg.model.in_channels))
    grid = [jnp.asarray(schedule.sigmas), jnp.asarray(schedule.timesteps)]
    grid.append(None if schedule.coefficients is None else jnp.asarray(schedule.coefficients))
    args = (graphdef, params, batch, noise, inputs, *grid, jnp.float32(cfg.train.guidance), jnp.int32(steps))
    kw = dict(attention=attention, solver=schedule.solver, guided=True)
    t0 = time.perf_counter()
    exe = _sample.lower(*args, **kw).compile()
    return exe, args[1:], time.perf_counter() - t0


def check(cfg, graphdef, params, shape) -> dict:
    """One guided step of full attention and of DSV at keep 1.0 from the same noise: the same latents within
    bf16 rounding (the sparse kernel over every KV block is dense attention)."""
    batch = text_batch(cfg, 99)
    keep1 = AttentionPlan(mode="dsv", backend=cfg.dsv.dense_backend, sparse=True, keep=1.0, kv_block=cfg.dsv.kv_block)
    outs = {}
    for name, attention in (("full", "auto"), ("keep1", keep1)):
        exe, args, _ = compile_loop(cfg, graphdef, params, batch, shape, 1, attention, None)
        outs[name] = np.asarray(exe(params, *args[1:]), np.float32)
    err = float(np.abs(outs["full"] - outs["keep1"]).max() / max(np.abs(outs["full"]).max(), 1e-6))
    return {"max_rel_error": err, "ok": err < 5e-2}


def timed(fn, repeats: int, sync) -> list[float]:
    """One warm-up call of fn, then `repeats` timed calls, each waited for with sync()."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


@contextlib.contextmanager
def built_as(torch, device: str, dtype):
    """Modules made inside are made on `device` in `dtype`: umT5-XXL never exists in fp32 (23 GB)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(before)


def time_codecs(shape, text_len: int, repeats: int, quick: bool, vae_dtype: str = "fp32") -> dict:
    """umT5 on 2 captions of `text_len` random tokens and the VAE decode of random latents of `shape` (t, h, w)
    through PyTorch, with random weights (the module doc says what each includes). Each model is made, timed
    and freed in turn (torch's cache emptied), so that jax, started after this, finds the GPU as good as
    empty: jax's client takes 75% of the GPU's memory when it starts and keeps it, leaving torch too little
    for umT5-XXL and the 720p decode if jax came first (then set XLA_PYTHON_CLIENT_MEM_FRACTION=0.5)."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    device = wan.torch_device(torch)
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)

    def text_times():
        with built_as(torch, device, torch.bfloat16):
            model = UMT5EncoderModel(UMT5Config(**(QUICK_UMT5 if quick else UMT5_XXL))).eval()
        ids = torch.randint(0, model.config.vocab_size, (2, text_len), device=device)
        mask = torch.ones_like(ids)

        def encode():
            with torch.inference_mode():
                return model(input_ids=ids, attention_mask=mask).last_hidden_state.float().cpu()

        with wan._OutOfMemoryReported(torch, "--codecs: umT5"):
            return timed(encode, repeats, sync)

    def vae_times():
        dtype = wan._torch_dtype(torch, vae_dtype)
        with built_as(torch, device, dtype):
            vae = AutoencoderKLWan(**(QUICK_VAE if quick else {})).eval()
        z = torch.randn(1, wan.Z_DIM, *shape, device=device, dtype=dtype)

        def decode():
            with torch.inference_mode():
                y = vae.decode(z).sample  # [1, 3, 1 + 4 (t - 1), 8h, 8w] in [-1, 1]
                return ((y.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()

        with wan._OutOfMemoryReported(torch, "--codecs: the VAE"):
            return timed(decode, repeats, sync)

    out = {}
    for key, run in (("text_encode", text_times), ("vae_decode", vae_times)):
        times = run()  # the model is freed on return
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        out[f"{key}_s"], out[f"{key}_times_s"] = statistics.median(times), times
    return {
        **out,
        "device": f"{device} ({torch.cuda.get_device_name(device)})" if cuda else device,
        "dtype": {"text": "bfloat16", "vae": {"fp32": "float32", "bf16": "bfloat16"}[vae_dtype]},
        "models": "tiny random (--quick)" if quick else "umT5-XXL encoder, AutoencoderKLWan() (Wan 2.1): random",
        "text_tokens": [2, text_len],
        "latents": [1, wan.Z_DIM, *shape],
        "frames": [1 + 4 * (shape[0] - 1), 8 * shape[1], 8 * shape[2]],
        "versions": {m: __import__(m).__version__ for m in CODEC_PACKAGES},
        "includes": (
            "text_encode: umT5 on the prompt and the negative prompt, one batch of 2 x text_tokens random ids "
            "(no tokenizer: about a millisecond), embeddings to the host in fp32; vae_decode: AutoencoderKLWan's "
            "decode of device latents (no tiling) to uint8 frames on the host, not the latents' "
            "un-normalisation or their copy from jax; each one warm-up, then the median of the timed runs"
        ),
    }


def end_to_end(codecs: dict, rows: dict) -> dict:
    """Per variant: text + the DiT's 50 steps (projected) + VAE decode, and the ratio to full attention's."""
    e2e = {}
    for variant, row in rows.items():
        parts = (codecs["text_encode_s"], row["projected_50_steps_s"], codecs["vae_decode_s"])
        e2e[variant] = dict(zip(("text_encode_s", "dit_50_steps_s", "vae_decode_s"), parts), total_s=sum(parts))
    if "full" in e2e:
        for row in e2e.values():
            row["speedup_vs_full"] = e2e["full"]["total_s"] / row["total_s"]
    return e2e


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model on the CPU: every code path")
    p.add_argument("--preset", default="wan2.1-t2v-1.3b")
    p.add_argument("--length", default="480p", choices=sorted(LENGTHS))
    p.add_argument("--steps", type=int, default=50, help="guided steps in the timed loop")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of the whole loop per variant")
    p.add_argument("--attention", default="full,dsv0.9", help="variants: full, dsvS (S: head sparsity)")
    p.add_argument("--no-check", action="store_true", help="skip the keep-1.0 check")
    p.add_argument("--codecs", action="store_true", help="also time umT5 and the VAE decode (PyTorch): end to end")
    p.add_argument("--vae-dtype", default="fp32", choices=["fp32", "bf16"], help="--codecs: the VAE's dtype")
    p.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    p.add_argument("--name", default="", help="results file (default bench_sample_<preset>_<length>)")
    args = p.parse_args()
    missing = [m for m in CODEC_PACKAGES if args.codecs and not wan._installed(m)]
    if missing:
        p.error(f"--codecs runs on {', '.join(CODEC_PACKAGES)}; not installed: {', '.join(missing)}")
    overrides = ["attention=dsv", *(QUICK if args.quick else []), *args.set]
    cfg = get_config(args.preset, overrides)
    shape = QUICK_LENGTH if args.quick else LENGTHS[args.length]
    steps = 2 if args.quick else args.steps
    name = args.name or f"bench_sample_{args.preset}_{args.length}" + ("_quick" if args.quick else "")
    codecs = None
    if args.codecs:  # before jax's first array, which starts its client (time_codecs says why)
        codecs = time_codecs(shape, cfg.text.max_len, args.repeats, args.quick, args.vae_dtype)
        print(
            f"codecs on {codecs['device']}: umT5 (bf16) 2 x {cfg.text.max_len} tokens {codecs['text_encode_s']:.3f} s; "
            f"VAE ({args.vae_dtype}) decode {codecs['latents']} -> {codecs['frames']} {codecs['vae_decode_s']:.2f} s"
        )
    t0 = time.perf_counter()
    graphdef, params = random_params(cfg)
    jax.block_until_ready(params)
    print(f"{cfg.name}: random bf16 weights in {time.perf_counter() - t0:.1f} s; latents {shape}, {steps} steps")
    checked = None if args.no_check else check(cfg, graphdef, params, shape)
    if checked is not None:
        print(f"check (one step, full vs DSV keep 1.0): max error {checked['max_rel_error']:.2e} of max")
    rows = {}
    for i, variant in enumerate(args.attention.split(",")):
        attention, inputs = attention_for(cfg, shape, variant)
        batch = text_batch(cfg, i)
        exe, run_args, compile_s = compile_loop(cfg, graphdef, params, batch, shape, steps, attention, inputs)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(exe(params, *run_args[1:]))
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        kept = 1.0 if variant == "full" else 1.0 - float(variant.removeprefix("dsv"))
        flops = forward_flops(cfg, shape, 2, kept=kept)
        rows[variant] = {
            "attention": attention if isinstance(attention, str) else attention[0].describe(),
            "compile_s": compile_s,
            "loop_s": times,
            "loop_median_s": median,
            "per_step_s": median / steps,
            "projected_50_steps_s": 50 * median / steps,
            "forward_flops_batch2": flops,
        }
        print(
            f"{variant:8s} compile {compile_s:6.1f} s  {steps} steps {median:7.2f} s "
            f"({min(times):.2f}-{max(times):.2f})  per step {median / steps:.3f} s  "
            f"-> 50 steps {50 * median / steps:.1f} s"
        )
    if "full" in rows:
        for variant, row in rows.items():
            row["speedup_vs_full"] = rows["full"]["loop_median_s"] / row["loop_median_s"]
            lo = min(rows["full"]["loop_s"]) / max(row["loop_s"])
            hi = max(rows["full"]["loop_s"]) / min(row["loop_s"])
            row["speedup_range"] = [lo, hi]
            print(f"{variant:8s} {row['speedup_vs_full']:.2f}x full ({lo:.2f}-{hi:.2f})")
    e2e = None
    if codecs is not None:
        e2e = end_to_end(codecs, rows)
        print("end to end (50 steps):")
        columns = ["variant", "text_encode_s", "dit_50_steps_s", "vae_decode_s", "total_s", "speedup_vs_full"]
        harness.print_table([{"variant": v, **r} for v, r in e2e.items()], columns)
    harness.write_results(
        name,
        {
            "preset": cfg.name,
            "latent_shape": list(shape),
            "tokens": int(np.prod([s // p for s, p in zip(shape, cfg.model.patch)])),
            "text_tokens": cfg.text.max_len,
            "steps": steps,
            "guidance": cfg.train.guidance,
            "batch": "1 sample; conditional + unconditional branches batched (2 per forward)",
            "dtype": "bfloat16 weights and compute",
            "check": checked,
            "variants": rows,
            "includes": "the DiT's denoising loop only: no text encoding, no VAE decode",
            **({} if e2e is None else {"codecs": codecs, "end_to_end": e2e, "end_to_end_includes": E2E_INCLUDES}),
        },
    )


if __name__ == "__main__":
    main()
