"""Wan 2.1's VAE and its umT5 text encoder as built-in specs of the data path (PyTorch models).

    --codec wan2.1-vae:DIR[?dtype=fp32|bf16&tiling=1]       (prepare-data; the sampler decodes with it)
    --text-encoder umt5:DIR[?max_len=512&dtype=bf16|fp32]   (prepare-data and sample)

DIR is a diffusers-format folder: for the VAE, `config.json` + `diffusion_pytorch_model.safetensors` of an
`AutoencoderKLWan` (the `vae/` folder of a Wan2.1-T2V-*-Diffusers download); for the text encoder, a
transformers `UMT5EncoderModel` with its tokenizer (the `text_encoder/` folder, its tokenizer beside it
in `text_encoder/../tokenizer/` or in the same folder). The pipeline's root folder works for both: the
specs look in its `vae/`, `text_encoder/` and `tokenizer/`. Nothing is ever downloaded.

The VAE (z_dim 16) compresses 4x in time and 8x in space and is causal in time: 1 + 4k frames make
1 + k latent frames (81 frames -> 21), 480 x 832 pixels -> 60 x 104. Latents are the mean of the
encoder's distribution, normalised per channel with the config's `latents_mean` / `latents_std`
(model latents = (z - mean) / std; decoding undoes it), as Wan trains and samples. Pixels go in as
[-1, 1]. It runs in fp32 by default (`dtype=bf16` halves its memory on a GPU); `tiling=1` encodes and
decodes large frames in overlapping spatial tiles (diffusers' tiling), for a GPU short of memory.

umT5 (width 4096 for Wan's umT5-XXL) reads each caption as Wan does (HTML entities and runs of white
space cleaned; ftfy's text repair where ftfy is installed), padded or cut to `max_len` tokens (512,
Wan's length) with the closing `</s>`. The embeddings past a caption's tokens are exactly zero, as Wan
pads them. The mask marks the caption's tokens (its true length, `</s>` included): a dsv-jax DiT uses
it as the key mask of text attention; Wan's own transformer attends to all `max_len` positions, the
zero tail included, and ignores it. umT5 runs in bf16 on a GPU and fp32 on the CPU unless `dtype=`
says otherwise.

The models run through PyTorch on the GPU when torch sees one (else the CPU); `DSV_JAX_TORCH_DEVICE`
(e.g. `cpu`, `cuda:1`) picks the device. torch, diffusers and transformers are imported only when a
model is first used (`pip install -e ".[wan]"`); a spec's folder and config are checked when it is
named, so a bad spec fails before prepare-data reads a file. A spec's `name` (stored in the dataset
manifest) is the spec with DIR made absolute and the options in a fixed order.
"""

from __future__ import annotations

import glob
import html
import importlib.util
import json
import os
import re

import numpy as np

VAE_PREFIX = "wan2.1-vae:"
UMT5_PREFIX = "umt5:"
INSTALL = 'pip install -e ".[wan]"'
DEVICE_ENV = "DSV_JAX_TORCH_DEVICE"
DEFAULT_MAX_LEN = 512  # the text length Wan trains and samples with
Z_DIM = 16  # Wan 2.1's latent channels (Wan 2.2's TI2V VAE has 48: a different codec)


class WanSpecError(ValueError):
    """A wan2.1-vae: or umt5: spec that names no usable model (the message says why, in one line)."""


class TorchOutOfMemory(RuntimeError):
    """The GPU ran out of memory inside a PyTorch model of these specs."""


# ---------------------------------------------------------------------------------------------
# Spec strings


def _parse(spec: str, prefix: str, what: str, options: dict) -> tuple[str, dict]:
    """'PREFIX:DIR?k=v&k=v' -> (absolute DIR, {k: parsed v}); `options` maps each key to its parser."""
    rest = spec.strip()[len(prefix) :]
    path, query = rest, ""
    if "?" in rest:
        head, _, tail = rest.rpartition("?")
        if "=" in tail or not tail:
            path, query = head, tail
    if not path.strip():
        raise WanSpecError(f"{what} {spec!r} names no folder: give {prefix}DIR")
    opts = {}
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        if key not in options or not eq:
            known = ", ".join(f"{k}=" for k in options)
            raise WanSpecError(f"{what} {spec!r}: unknown option {item!r} (options: {known})")
        try:
            opts[key] = options[key](value)
        except ValueError as e:
            raise WanSpecError(f"{what} {spec!r}: {key}={value!r} {e}") from None
    return os.path.abspath(os.path.expanduser(path.strip())), opts


def _canonical(prefix: str, folder: str, opts: dict) -> str:
    def text(v):
        return str(int(v)) if isinstance(v, bool) else str(v)

    query = "&".join(f"{k}={text(opts[k])}" for k in sorted(opts))
    return f"{prefix}{folder}" + (f"?{query}" if query else "")


def _dtype_option(value: str) -> str:
    table = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
    if value.lower() not in table:
        raise ValueError("is not fp32 or bf16")
    return table[value.lower()]


def _flag_option(value: str) -> bool:
    table = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
    if value.lower() not in table:
        raise ValueError("is not 0 or 1")
    return table[value.lower()]


def _length_option(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ValueError("is not a whole number of tokens") from None
    if n < 1:
        raise ValueError("must be >= 1")
    return n


def _read_config(path: str, what: str, spec: str) -> dict:
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise WanSpecError(f"{what} {spec!r}: cannot read {path} ({e})") from None
    if not isinstance(config, dict):
        raise WanSpecError(f"{what} {spec!r}: {path} is not a JSON object")
    return config


def _require(what: str, spec: str, modules: tuple[str, ...]) -> None:
    """Fail in one line, naming the extra, when a package the spec runs on is not installed."""
    missing = [m for m in modules if not _installed(m)]
    if missing:
        raise WanSpecError(
            f"{what} {spec!r} runs on {', '.join(modules)}; not installed: {', '.join(missing)} ({INSTALL})"
        )


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def torch_device(torch) -> str:
    """$DSV_JAX_TORCH_DEVICE, else the GPU where torch sees one, else the CPU."""
    chosen = os.environ.get(DEVICE_ENV, "").strip()
    if chosen:
        return chosen
    return "cuda" if torch.cuda.is_available() else "cpu"


def _torch_dtype(torch, name: str):
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


class _OutOfMemoryReported:
    """Turns the GPU running out of memory inside the `with` block into a TorchOutOfMemory saying what
    to do; every other error passes as it is."""

    def __init__(self, torch, what: str):
        self.oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if self.oom is not None and isinstance(e, self.oom):
            first = str(e).splitlines()[0][:160] if str(e) else ""
            raise TorchOutOfMemory(
                f"{self.what}: the GPU ran out of memory ({first}); jax may hold most of it: run with "
                f"XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 (or XLA_PYTHON_CLIENT_PREALLOCATE=false), or "
                f"{DEVICE_ENV}=cpu, or the VAE's ?tiling=1"
            ) from e
        return False


def _quiet_loading_kwargs() -> dict:
    """diffusers' from_pretrained warns without accelerate unless told not to use it."""
    return {} if _installed("accelerate") else {"low_cpu_mem_usage": False}


# ---------------------------------------------------------------------------------------------
# The VAE


VAE_OPTIONS = {"dtype": _dtype_option, "tiling": _flag_option}


class WanVAECodec:
    """Wan 2.1's VAE behind the Codec interface of data/codec.py (see the module doc)."""

    def __init__(self, spec: str):
        what = "codec"
        root, self.options = _parse(spec, VAE_PREFIX, what, VAE_OPTIONS)
        self.name = _canonical(VAE_PREFIX, root, self.options)
        if not os.path.isdir(root):
            raise WanSpecError(
                f"{what} {spec!r}: folder {root} does not exist (a run or an export names its VAE in its "
                "config.json's data.codec)"
            )
        folder = root
        if not os.path.isfile(os.path.join(folder, "config.json")) and os.path.isfile(
            os.path.join(root, "vae", "config.json")
        ):
            folder = os.path.join(root, "vae")  # a pipeline's root: its vae/ folder
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise WanSpecError(
                f"{what} {spec!r}: {root} holds no config.json (nor vae/config.json): give the vae/ folder of a "
                "Wan2.1 diffusers download"
            )
        config = _read_config(path, what, spec)
        kind = config.get("_class_name")
        if kind != "AutoencoderKLWan":
            raise WanSpecError(
                f"{what} {spec!r}: {path} describes a {kind or 'model of no class'}, not AutoencoderKLWan"
            )
        z_dim = config.get("z_dim", Z_DIM)
        if z_dim != Z_DIM or config.get("patch_size") is not None or config.get("is_residual"):
            raise WanSpecError(
                f"{what} {spec!r}: {path} is not Wan 2.1's VAE (z_dim {z_dim}, patch_size "
                f"{config.get('patch_size')}; Wan 2.1's has z_dim {Z_DIM} and no patch)"
            )
        mean, std = config.get("latents_mean"), config.get("latents_std")
        if not (isinstance(mean, list) and isinstance(std, list) and len(mean) == len(std) == Z_DIM):
            raise WanSpecError(f"{what} {spec!r}: {path} lacks {Z_DIM} latents_mean and latents_std values")
        dim_mult = config.get("dim_mult", [1, 2, 4, 4])
        down = config.get("temperal_downsample", [False, True, True])
        self.time_factor = 2 ** sum(bool(d) for d in down)
        self.space_factor = 2 ** (len(dim_mult) - 1)
        if self.time_factor != 4:
            raise WanSpecError(
                f"{what} {spec!r}: {path} compresses time {self.time_factor}x; the Wan VAE encodes 4-frame steps"
            )
        if not glob.glob(os.path.join(folder, "diffusion_pytorch_model*")):
            raise WanSpecError(f"{what} {spec!r}: {folder} holds no diffusion_pytorch_model.safetensors")
        _require(what, spec, ("torch", "diffusers"))
        self.folder = folder
        self.mean = np.asarray(mean, np.float32)
        self.std = np.asarray(std, np.float32)
        self._loaded = None

    channels = Z_DIM

    def pixel_shape(self, latent_shape) -> tuple[int, int, int]:
        """Frames of a latent (t, h, w): 1 + 4 (t - 1) frames of 8h x 8w pixels (t = 1: one image)."""
        t, h, w = (int(s) for s in latent_shape)
        return 1 + self.time_factor * (t - 1), self.space_factor * h, self.space_factor * w

    def _model(self):
        """(torch, the diffusers model on its device, dtype), loaded on first use."""
        if self._loaded is None:
            _require("codec", self.name, ("torch", "diffusers"))
            import torch
            from diffusers import AutoencoderKLWan

            device = torch_device(torch)
            dtype = _torch_dtype(torch, self.options.get("dtype", "fp32"))
            vae = AutoencoderKLWan.from_pretrained(
                self.folder, torch_dtype=dtype, local_files_only=True, **_quiet_loading_kwargs()
            )
            vae = vae.to(device).eval().requires_grad_(False)
            if self.options.get("tiling"):
                vae.enable_tiling()
            self._loaded = torch, vae, device, dtype
        return self._loaded

    def encode(self, frames: np.ndarray) -> np.ndarray:
        """uint8 frames [1 + 4k, 8h, 8w, 3] -> normalised float32 latents [1 + k, h, w, 16]."""
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(
                f"codec {self.name!r} encodes uint8 frames [T, H, W, 3], got {frames.dtype} {frames.shape}"
            )
        t, h, w, _ = frames.shape
        if (t - 1) % self.time_factor or h % self.space_factor or w % self.space_factor:
            raise ValueError(
                f"codec {self.name!r} encodes 1 + {self.time_factor}k frames of sizes divisible by "
                f"{self.space_factor}, got {t} x {h} x {w}"
            )
        torch, vae, device, dtype = self._model()
        x = torch.from_numpy(np.ascontiguousarray(frames)).to(device=device, dtype=torch.float32)
        x = (x / 127.5 - 1.0).permute(3, 0, 1, 2).unsqueeze(0).to(dtype)  # [1, 3, T, H, W] in [-1, 1]
        with _OutOfMemoryReported(torch, f"codec {self.name!r}: encoding {t} x {h} x {w}"), torch.inference_mode():
            mu = vae.encode(x).latent_dist.mean
        z = mu[0].float().permute(1, 2, 3, 0).cpu().numpy()  # [t, h, w, 16]
        return (z - self.mean) / self.std

    def decode(self, latents: np.ndarray) -> np.ndarray:
        """Normalised latents [..., t, h, w, 16] -> uint8 frames [..., 1 + 4(t - 1), 8h, 8w, 3]."""
        x = np.asarray(latents, np.float32)
        if x.ndim < 4 or x.shape[-1] != self.channels:
            raise ValueError(
                f"codec {self.name!r} decodes latents [..., t, h, w, {self.channels}], got {x.shape}; "
                "is data.codec the codec the data was prepared with?"
            )
        *lead, t, h, w, c = x.shape
        clips = (x.reshape(-1, t, h, w, c) * self.std + self.mean).astype(np.float32)
        torch, vae, device, dtype = self._model()
        out = []
        for clip in clips:  # one clip at a time: the decoder's memory does not grow with the batch
            z = torch.from_numpy(np.ascontiguousarray(clip.transpose(3, 0, 1, 2)))[None].to(device=device, dtype=dtype)
            with _OutOfMemoryReported(torch, f"codec {self.name!r}: decoding {t} x {h} x {w}"), torch.inference_mode():
                y = vae.decode(z).sample  # [1, 3, T, H, W] in [-1, 1]
            y = y[0].float().permute(1, 2, 3, 0).cpu().numpy()
            out.append(np.clip(np.round((y + 1.0) * 127.5), 0, 255).astype(np.uint8))
        frames = np.stack(out)
        return frames.reshape(*lead, *frames.shape[1:])


_VAES: dict[str, WanVAECodec] = {}


def vae_codec(spec: str) -> WanVAECodec:
    """The codec of a `wan2.1-vae:` spec, one per process and spec: the sampler's size checks and its
    decoding share the weights, loaded once."""
    codec = WanVAECodec(spec)
    return _VAES.setdefault(codec.name, codec)


# ---------------------------------------------------------------------------------------------
# The text encoder


UMT5_OPTIONS = {"max_len": _length_option, "dtype": _dtype_option}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model")


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)


def clean_caption(text: str) -> str:
    """A caption as Wan's pipeline reads it: ftfy's repair (where installed), HTML entities decoded
    (twice: captions scraped from the web are often escaped twice) and white space runs made one space."""
    if _installed("ftfy"):
        import ftfy

        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class UMT5Encoder:
    """Wan's umT5 text encoder: f(captions) -> (embeddings float32 [N, max_len, d_model], mask bool
    [N, max_len]), the embeddings zero past each caption's tokens (see the module doc)."""

    def __init__(self, spec: str):
        what = "text encoder"
        root, self.options = _parse(spec, UMT5_PREFIX, what, UMT5_OPTIONS)
        self.spec = _canonical(UMT5_PREFIX, root, self.options)
        self.max_len = self.options.get("max_len", DEFAULT_MAX_LEN)
        if not os.path.isdir(root):
            raise WanSpecError(f"{what} {spec!r}: folder {root} does not exist")
        if os.path.isfile(os.path.join(root, "text_encoder", "config.json")):  # a pipeline's root
            model = os.path.join(root, "text_encoder")
            tokenizers = [os.path.join(root, "tokenizer"), model]
        elif os.path.isfile(os.path.join(root, "config.json")):
            model = root
            tokenizers = [root, os.path.join(os.path.dirname(root), "tokenizer")]
        else:
            raise WanSpecError(
                f"{what} {spec!r}: {root} holds no config.json (nor text_encoder/config.json): give the "
                "text_encoder/ folder of a Wan2.1 diffusers download"
            )
        config = _read_config(os.path.join(model, "config.json"), what, spec)
        if config.get("model_type") != "umt5":
            kind = config.get("model_type") or "model of no model_type"
            raise WanSpecError(
                f"{what} {spec!r}: {os.path.join(model, 'config.json')} describes a {kind}, not umT5 "
                "(transformers' UMT5EncoderModel)"
            )
        tokenizer = next((t for t in tokenizers if _has_tokenizer(t)), None)
        if tokenizer is None:
            raise WanSpecError(
                f"{what} {spec!r}: no tokenizer ({', '.join(TOKENIZER_FILES)}) in "
                f"{' or '.join(dict.fromkeys(tokenizers))}"
            )
        if not glob.glob(os.path.join(model, "*.safetensors")) + glob.glob(os.path.join(model, "*.bin")):
            raise WanSpecError(f"{what} {spec!r}: {model} holds no weights (model.safetensors)")
        _require(what, spec, ("torch", "transformers"))
        self.model_folder, self.tokenizer_folder = model, tokenizer
        self.dim = int(config.get("d_model", 0))
        self._loaded = None

    def _model(self):
        if self._loaded is None:
            _require("text encoder", self.spec, ("torch", "transformers"))
            import torch
            from transformers import AutoTokenizer, UMT5EncoderModel

            device = torch_device(torch)
            name = self.options.get("dtype", "fp32" if device == "cpu" else "bf16")
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_folder, local_files_only=True)
            tokenizer.padding_side = "right"  # the caption's tokens first: the mask is a prefix
            model = UMT5EncoderModel.from_pretrained(
                self.model_folder, dtype=_torch_dtype(torch, name), local_files_only=True
            )
            model = model.to(device).eval().requires_grad_(False)
            self._loaded = torch, tokenizer, model, device
        return self._loaded

    def __call__(self, captions) -> tuple[np.ndarray, np.ndarray]:
        captions = [captions] if isinstance(captions, str) else list(captions)
        torch, tokenizer, model, device = self._model()
        batch = tokenizer(
            [clean_caption(c) for c in captions],
            padding="max_length",
            max_length=self.max_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        with _OutOfMemoryReported(torch, f"text encoder {self.spec!r}"), torch.inference_mode():
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        keep = mask.bool()
        hidden = torch.where(keep[..., None], hidden.float(), torch.zeros((), device=hidden.device))
        return hidden.cpu().numpy(), keep.cpu().numpy()


_ENCODERS: dict[str, UMT5Encoder] = {}


def umt5_encoder(spec: str) -> UMT5Encoder:
    """The text encoder of a `umt5:` spec, one per process and spec (the model is loaded once)."""
    encoder = UMT5Encoder(spec)
    return _ENCODERS.setdefault(encoder.spec, encoder)
