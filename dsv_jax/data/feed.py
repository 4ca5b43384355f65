"""Batches for training: one bucket shape per step, the same schedule on every host.

A feed is an iterator of host-local batches (numpy dicts) with `get_state()` / `set_state()` so the
checkpoint can resume it exactly. Batch keys:
    latents    float32 [b, T, H, W, C]
    text_ids   int32 [b, L]      (built-in text encoder)   or   text_emb float32 [b, L, Dt]
    text_mask  bool [b, L]       valid tokens are a prefix
where b is this host's share of the global batch B (B / process_count rows). Every feed sizes its
batches with the one rule of `data/bucketing.py` (data.batching = equal_tokens | dual).

Feeds: SyntheticFeed (the embedded datasets, below: data.source=synthetic shapes or photos) and, with
data.path set, GrainFeed (`data/pipeline.py`: a prepared dataset through Grain; grain is imported only then).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np

from dsv_jax.config import Config
from dsv_jax.data.bucketing import (  # noqa: F401 (re-export)
    batch_rule,
    equal_token_batch_size,
    tokens_per_sample,
    warn_over_memory,
)
from dsv_jax.data.synthetic import render
from dsv_jax.data.text import tokenize_batch

log = logging.getLogger(__name__)


def embedded_renderer(cfg: Config, split: str = "train"):
    """render(seed, key, shape) -> (frames, caption) of the embedded source of `cfg` (data.source
    synthetic or photos); the photos source draws its held-out captions only for split="eval"."""
    if cfg.data.source != "photos":
        return render
    from dsv_jax.data import photos

    photos.data_dir()  # a clear error now, not in the prefetch thread, when the photos are missing
    if cfg.text.encoder == "builtin" and cfg.text.max_len < photos.MAX_CAPTION_WORDS + 1:
        log.warning(
            "data.source=photos: captions have up to %d words and text.max_len=%d tokens cuts the longest "
            "(set text.max_len=%d)",
            photos.MAX_CAPTION_WORDS,
            cfg.text.max_len,
            photos.MAX_CAPTION_WORDS + 1,
        )
    return functools.partial(photos.render, split=split)


class SyntheticFeed:
    """An embedded dataset as an infinite, deterministic stream of bucketed batches.

    Step s draws its bucket from (seed, s) and renders sample j of that step from (seed, s, j): the
    position in the stream is the whole state, and every host computes the same bucket schedule.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        batch_multiple: int = 1,
        process_index: int = 0,
        process_count: int = 1,
        split: str = "train",
    ):
        self.cfg = cfg
        self.shapes = [tuple(s) for s in cfg.data.buckets]
        weights = np.asarray(cfg.data.bucket_weights, np.float64)
        self.probs = weights / weights.sum()
        self.seed = cfg.data.seed + (0 if split == "train" else 1_000_003)
        self.heldout = split == "eval"  # the eval split renders samples of another seed, never trained on
        self.batch_multiple = max(batch_multiple, process_count)
        self.process_index, self.process_count = process_index, process_count
        self.position = 0
        for shape in self.shapes:
            if any(s % p for s, p in zip(shape, cfg.model.patch)):
                raise ValueError(f"data.buckets entry {shape} is not divisible by model.patch {cfg.model.patch}")
        self.rule = batch_rule(cfg.data, self.batch_multiple)
        self.render = embedded_renderer(cfg, split)
        if split == "train":
            seq = {"x".join(map(str, s)): tokens_per_sample(s, cfg.model.patch) for s in self.shapes}
            warn_over_memory(self.rule, seq)

    def batch_size(self, shape) -> int:
        return self.rule(tokens_per_sample(shape, self.cfg.model.patch))

    def bucket_at(self, position: int) -> tuple[int, int, int]:
        rng = np.random.default_rng([self.seed, position, 0x5EED])
        return self.shapes[int(rng.choice(len(self.shapes), p=self.probs))]

    def batch_at(self, position: int, shape=None) -> dict[str, np.ndarray]:
        shape = shape or self.bucket_at(position)
        b = self.batch_size(shape)
        per_host = b // self.process_count
        rows = range(self.process_index * per_host, (self.process_index + 1) * per_host)
        clips = [self.render(self.seed, (position, j), shape) for j in rows]
        latents = np.stack([c[0] for c in clips])
        ids, mask = tokenize_batch([c[1] for c in clips], self.cfg.text.max_len, self.cfg.text.hash_buckets)
        return {"latents": latents, "text_ids": ids, "text_mask": mask}

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    def get_state(self) -> dict:
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        self.position = int(state["position"])


def make_feed(cfg: Config, *, batch_multiple: int, process_index: int, process_count: int, split: str = "train"):
    if cfg.data.path:
        try:
            from dsv_jax.data.pipeline import GrainFeed  # grain only when a dataset is used
        except ImportError as e:
            raise ImportError(f"data.path needs grain and array_record (pip install grain array-record): {e}") from e

        return GrainFeed(
            cfg, batch_multiple=batch_multiple, process_index=process_index, process_count=process_count, split=split
        )
    return SyntheticFeed(
        cfg, batch_multiple=batch_multiple, process_index=process_index, process_count=process_count, split=split
    )


def resolve_data_config(cfg: Config) -> Config:
    """With data.path set, take the bucket shapes, their sample counts (as weights) and the codec from
    the dataset's manifest, so that the saved config (and the sampler) describe the data trained on."""
    if not cfg.data.path:
        return cfg
    from dsv_jax.data.manifest import Manifest

    manifest = Manifest.load(cfg.data.path)
    if cfg.data.codec and cfg.data.codec != manifest.codec:
        raise ValueError(
            f"data.codec={cfg.data.codec!r} but the dataset at {cfg.data.path!r} was prepared with "
            f"codec {manifest.codec!r}"
        )
    kept = [b for b in manifest.buckets if b["count"] > 0]
    data = dataclasses.replace(
        cfg.data,
        codec=manifest.codec,
        buckets=tuple(tuple(b["shape"]) for b in kept),
        bucket_weights=tuple(float(b["count"]) for b in kept),
    )
    return dataclasses.replace(cfg, data=data)
