"""Batches for training: the `Feed` interface and the data sources that open one (`SOURCES`).

A feed is an iterator of host-local batches (numpy dicts), one bucket shape per step and the same schedule
on every host, with `get_state()` / `set_state()` so the checkpoint can resume it exactly. Batch keys:
    latents    float32 [b, T, H, W, C]
    text_ids   int32 [b, L]      (built-in text encoder)   or   text_emb float32 [b, L, Dt]
    text_mask  bool [b, L]       valid tokens are a prefix
where b is this host's share of the global batch B (B / process_count rows). Every feed sizes its
batches with the one rule of `data/bucketing.py` (data.batching = equal_tokens | dual).

Sources, by data.source ("auto" is resolved in one place, `DataConfig.resolved_source`):
    synthetic    the embedded shapes (`data/synthetic.py`: SyntheticFeed)
    photos       the embedded photos (`data/photos.py`, drawn by a SyntheticFeed)
    arrayrecord  a prepared dataset at data.path (`data/pipeline.py`: GrainFeed; grain is imported only then)
A new source is its feed module plus one SOURCES entry (and its name in `dsv_jax.config.DATA_SOURCES`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import numpy as np

from dsv_jax.config import Config
from dsv_jax.data import photos
from dsv_jax.data.bucketing import (  # noqa: F401 (re-exported: the feed's batch sizes)
    batch_rule,
    equal_token_batch_size,
    tokens_per_sample,
    warn_over_memory,
)
from dsv_jax.data.synthetic import PROMPTS, SyntheticFeed


@runtime_checkable
class Feed(Protocol):
    """What the trainer, evaluation and sampling ask of a data feed."""

    shapes: list  # the bucket shapes (T, H, W) it emits
    heldout: bool  # whether its samples are held out from training (an eval split that has its own records)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]: ...
    def __next__(self) -> dict[str, np.ndarray]: ...
    def batch_size(self, shape) -> int: ...  # the global batch of a bucket (all hosts together)
    def batch_at(self, index: int, shape) -> dict[str, np.ndarray]: ...  # a fixed batch (evaluation)
    def get_state(self) -> dict[str, Any]: ...  # JSON: where the stream is
    def set_state(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None: ...  # stops background readers (a Grain feed's prefetch processes)


FEED_MEMBERS = (
    *Feed.__annotations__,
    *(n for n, v in vars(Feed).items() if callable(v) and (not n.startswith("_") or n in ("__iter__", "__next__"))),
)


@dataclasses.dataclass(frozen=True)
class Source:
    """A data.source: how its feed opens, and what else the package asks of it."""

    # (cfg, *, batch_multiple, process_index, process_count, split) -> Feed
    open: Callable[..., Feed]
    # drawn from (seed, key) by a renderer, no files: the feed has `render` and `seed`, and its held-out
    # captions give the semantic score (`dsv_jax.evaluate`)
    embedded: bool
    prompts: tuple[str, ...]  # what `dsv-jax sample` draws without --prompt
    # the config a run saves (a prepared dataset's buckets and codec), before anything is built
    configure: Callable[[Config], Config] = lambda cfg: cfg
    real_clips: bool = False  # its models are also evaluated on real video (data/real_clips.py)


def _photos_feed(cfg: Config, *, split: str = "train", **kw) -> SyntheticFeed:
    return SyntheticFeed(cfg, split=split, renderer=photos.renderer(cfg, split), **kw)


def _grain_feed(cfg: Config, **kw) -> Feed:
    try:
        from dsv_jax.data.pipeline import GrainFeed  # grain only when a dataset is used
    except ImportError as e:
        raise ImportError(f"data.path needs grain and array_record (pip install grain array-record): {e}") from e
    return GrainFeed(cfg, **kw)


def _dataset_config(cfg: Config) -> Config:
    """Take the bucket shapes, their sample counts (as weights) and the codec from the dataset's manifest,
    so that the saved config (and the sampler) describe the data trained on."""
    from dsv_jax.data.manifest import Manifest, check_dataset

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
    resolved = dataclasses.replace(cfg, data=data)
    check_dataset(resolved, manifest)  # before a run makes its work directory (training.md)
    return resolved


SOURCES: dict[str, Source] = {
    "synthetic": Source(open=SyntheticFeed, embedded=True, prompts=PROMPTS),
    "photos": Source(open=_photos_feed, embedded=True, prompts=photos.PROMPTS, real_clips=True),
    # a prepared dataset names no prompts: sampling without --prompt draws the shapes'
    "arrayrecord": Source(open=_grain_feed, embedded=False, prompts=PROMPTS, configure=_dataset_config),
}


def source_named(name: str) -> Source:
    """The SOURCES entry of a data.source name (not "auto": see `source_of`)."""
    if name not in SOURCES:
        raise ValueError(f"unknown data source {name!r}; the sources are {', '.join(SOURCES)}")
    return SOURCES[name]


def source_of(cfg: Config) -> Source:
    """The SOURCES entry a config reads (data.source, "auto" resolved)."""
    return source_named(cfg.data.resolved_source)


def make_feed(
    cfg: Config, *, batch_multiple: int = 1, process_index: int = 0, process_count: int = 1, split: str = "train"
) -> Feed:
    """The feed of cfg's data source: this host's rows, batches a multiple of `batch_multiple`."""
    feed = source_of(cfg).open(
        cfg, batch_multiple=batch_multiple, process_index=process_index, process_count=process_count, split=split
    )
    if not isinstance(feed, Feed):
        missing = [name for name in FEED_MEMBERS if not hasattr(feed, name)]
        raise TypeError(
            f"data.source={cfg.data.resolved_source} opened a {type(feed).__name__} without {', '.join(missing)} "
            "(dsv_jax.data.feed.Feed)"
        )
    return feed


def resolve_data_config(cfg: Config) -> Config:
    """The config a run saves for its data source (with data.path: the dataset's buckets, weights and codec)."""
    return source_of(cfg).configure(cfg)
