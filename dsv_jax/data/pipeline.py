"""The Grain pipeline over a prepared dataset (ArrayRecord shards + manifest.json).

    record ids --shuffle(seed), every epoch--> (id, bucket)      same on every host, cheap: the
        --BucketBatcher--> (bucket, B global ids)                 bucket comes from the manifest
        --HostRows--> this host's B / hosts ids                   each host reads only its own rows
        --ReadSamples--> numpy batch {latents, text_*}            ArrayRecord reads + decode
        --mp_prefetch (data.workers processes)--> the trainer (`to_global` makes the global jax.Array)

One jitted step has one shape, so all hosts must emit the same bucket at the same step. They do:
every host runs the same shuffle (shared seed) and the same batcher over record ids, whose buckets
are known from the manifest without reading a record, so the bucket schedule is identical everywhere;
only the read at the end is per host. The schedule is data-driven: a bucket is emitted when its buffer
holds B samples, B from the one batch rule (`bucketing.batch_rule`: equal_tokens or dual), so over an
epoch each bucket appears in proportion to its samples / B.

State: the shuffle position and every partly filled bucket buffer (per prefetch worker), plain JSON,
and the same on every host, so the checkpoint's single JSON copy restores all hosts.
Grain is imported here only: the rest of dsv_jax (and training on the embedded dataset) runs without it.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import grain
import numpy as np

from dsv_jax.config import Config
from dsv_jax.data.bucketing import batch_rule, tokens_per_sample, warn_over_memory
from dsv_jax.data.codec import latents_from_stored
from dsv_jax.data.manifest import Manifest, check_dataset
from dsv_jax.data.records import unpack
from dsv_jax.data.text import tokenize

log = logging.getLogger(__name__)


class BucketBatcher(grain.IterDataset):
    """(record id, bucket) elements -> {"bucket": k, "ids": int64 [B_k]} as soon as bucket k holds B_k ids.

    A batch never holds one record twice when its bucket has at least B_k records: an id that comes
    round again (the next epoch) while its previous copy still waits is deferred to the next batch."""

    def __init__(self, parent: grain.IterDataset, batch_sizes: Sequence[int], bucket_records: Sequence[int]):
        super().__init__(parent)
        self.batch_sizes = tuple(int(b) for b in batch_sizes)
        self.unique = tuple(int(n) >= b for n, b in zip(bucket_records, self.batch_sizes))

    def __iter__(self) -> "BucketBatcherIterator":
        return BucketBatcherIterator(self._parent.__iter__(), self.batch_sizes, self.unique)


class BucketBatcherIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, batch_sizes: tuple[int, ...], unique: tuple[bool, ...]):
        super().__init__(parent)
        self.batch_sizes, self.unique = batch_sizes, unique
        self.buffers: list[list[int]] = [[] for _ in batch_sizes]
        self.deferred: list[list[int]] = [[] for _ in batch_sizes]

    def _add(self, bucket: int, record_id: int) -> None:
        if self.unique[bucket] and record_id in self.buffers[bucket]:
            self.deferred[bucket].append(record_id)
        else:
            self.buffers[bucket].append(record_id)

    def __next__(self) -> dict[str, Any]:
        while True:
            for bucket, buffer in enumerate(self.buffers):
                if len(buffer) >= self.batch_sizes[bucket]:
                    return self._emit(bucket)
            record_id, bucket = next(self._parent)
            self._add(bucket, int(record_id))

    def _emit(self, bucket: int) -> dict[str, Any]:
        size = self.batch_sizes[bucket]  # a buffer restored under a smaller batch size keeps its rest
        ids, rest = self.buffers[bucket][:size], self.buffers[bucket][size:]
        waiting, self.buffers[bucket], self.deferred[bucket] = self.deferred[bucket], rest, []
        for record_id in waiting:
            self._add(bucket, record_id)
        return {"bucket": np.int64(bucket), "ids": np.asarray(ids, np.int64)}

    def get_state(self) -> dict[str, Any]:
        # Copies: a prefetching parent may keep this dict while the buffers keep filling.
        return {
            "parent": self._parent.get_state(),
            "buffers": [list(b) for b in self.buffers],
            "deferred": [list(d) for d in self.deferred],
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if len(state["buffers"]) != len(self.batch_sizes):
            raise ValueError(
                f"data iterator state has {len(state['buffers'])} bucket buffers, this dataset has "
                f"{len(self.batch_sizes)} buckets"
            )
        self._parent.set_state(state["parent"])
        self.buffers = [[int(i) for i in b] for b in state["buffers"]]
        self.deferred = [[int(i) for i in d] for d in state["deferred"]]


class KeyByBucket:
    """record id -> (record id, bucket of that record)."""

    def __init__(self, record_buckets: np.ndarray):
        self.record_buckets = record_buckets

    def __call__(self, record_id):
        return int(record_id), int(self.record_buckets[record_id])


class HostRows:
    """A global batch of ids -> this host's contiguous share (the rows its devices hold)."""

    def __init__(self, process_index: int, process_count: int):
        self.process_index, self.process_count = process_index, process_count

    def __call__(self, batch):
        ids = batch["ids"]
        per_host = len(ids) // self.process_count
        first = self.process_index * per_host
        return {"bucket": batch["bucket"], "ids": ids[first : first + per_host]}


class ReadSamples:
    """Host ids -> the training batch: latents float32 [b, T, H, W, C] and text, read from the shards."""

    def __init__(self, paths: list[str], text_encoder: str, max_len: int, hash_buckets: int, with_ids: bool = False):
        self.paths, self.text_encoder = paths, text_encoder
        self.max_len, self.hash_buckets, self.with_ids = max_len, hash_buckets, with_ids
        self._source = None

    def __getstate__(self):  # the open source stays behind when pickled into a prefetch worker
        return {**self.__dict__, "_source": None}

    @property
    def source(self):
        if self._source is None:
            self._source = grain.sources.ArrayRecordDataSource(self.paths)
        return self._source

    def __call__(self, batch) -> dict[str, np.ndarray]:
        ids = [int(i) for i in batch["ids"]]
        records = [unpack(r) for r in self.source.__getitems__(ids)]
        out = {"latents": np.stack([latents_from_stored(a["latent"]) for a, _ in records])}
        if self.text_encoder == "builtin":
            ids_mask = [tokenize(m.get("caption", ""), self.max_len, self.hash_buckets) for _, m in records]
            out["text_ids"] = np.stack([i for i, _ in ids_mask])
            out["text_mask"] = np.stack([m for _, m in ids_mask])
        else:
            out["text_emb"] = np.stack([a["text_emb"].astype(np.float32) for a, _ in records])
            out["text_mask"] = np.stack([a["text_mask"].astype(bool) for a, _ in records])
        if self.with_ids:
            out["record_id"] = np.asarray(ids, np.int64)
        return out


def _mark_flags_parsed() -> None:
    # Grain reads absl flags in its prefetch machinery; outside an absl app they are never parsed.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class GrainFeed:
    """The feed of a prepared dataset (a `data.feed.Feed`; data.source=arrayrecord).

    split="eval" reads the dataset's held-out split (prepare-data --eval-fraction) where it has one
    (`heldout` is then True); without one, the training records (fixed batches from the first records
    of each bucket), which the trainer's metrics name as such."""

    def __init__(
        self,
        cfg: Config,
        *,
        batch_multiple: int = 1,
        process_index: int = 0,
        process_count: int = 1,
        split: str = "train",
        with_ids: bool = False,
    ):
        self.cfg = cfg
        self.manifest = Manifest.load(cfg.data.path)
        check_dataset(cfg, self.manifest)
        self.process_index, self.process_count = process_index, process_count
        self.rule = batch_rule(cfg.data, multiple=max(batch_multiple, process_count))
        self.heldout = split == "eval" and self.manifest.has_eval
        self.split = "eval" if self.heldout else "train"  # which records this feed reads
        self.shapes = self.manifest.eval_shapes if self.heldout else self.manifest.shapes
        self._bucket_index = {tuple(b["shape"]): k for k, b in enumerate(self.manifest.buckets)}
        self.record_buckets = self.manifest.record_buckets(self.split)
        self.seed = (cfg.data.seed + (0 if split == "train" else 1_000_003)) % 2**32
        self.workers = cfg.data.workers
        self.reader = ReadSamples(
            self.manifest.shard_paths(self.split), cfg.text.encoder, cfg.text.max_len, cfg.text.hash_buckets, with_ids
        )
        self._it = None
        if split == "eval" and not self.heldout:
            log.warning(
                "evaluating on training records: the dataset at %s has no held-out split (prepare it with "
                "--eval-fraction F); its losses are logged as train_records_loss",
                self.manifest.directory,
            )
        if self.heldout and len(self.shapes) < len(self.manifest.shapes):
            log.info(
                "the held-out split has no samples of bucket(s) %s: they are not evaluated",
                sorted(set(self.manifest.shapes) - set(self.shapes)),
            )
        if split == "train":
            log.info(
                "data: %d samples in %d buckets from %s; batching %s",
                self.manifest.records,
                len(self.shapes),
                self.manifest.directory,
                self.rule.describe(),
            )
            warn_over_memory(self.rule, {"x".join(map(str, s)): self.seq_len(s) for s in self.shapes})
            for b, size in zip(self.manifest.buckets, self.batch_sizes()):
                if 0 < b["count"] < size:
                    log.warning(
                        "bucket %s holds %d samples, fewer than its batch of %d: its batches repeat samples",
                        "x".join(map(str, b["shape"])),
                        b["count"],
                        size,
                    )

    def seq_len(self, shape) -> int:
        return tokens_per_sample(shape, self.cfg.model.patch)

    def batch_size(self, shape) -> int:
        """Global batch size of a bucket (all hosts together)."""
        return self.rule(self.seq_len(shape))

    def batch_sizes(self) -> list[int]:
        return [self.batch_size(b["shape"]) for b in self.manifest.buckets]

    def dataset(self) -> grain.IterDataset:
        ds = grain.MapDataset.range(len(self.record_buckets)).shuffle(seed=self.seed).repeat()
        ds = ds.map(KeyByBucket(self.record_buckets)).to_iter_dataset()
        ds = BucketBatcher(
            ds,
            self.batch_sizes(),
            [b["count" if self.split == "train" else "eval_count"] for b in self.manifest.buckets],
        )
        ds = ds.map(HostRows(self.process_index, self.process_count)).map(self.reader)
        if self.workers > 0:
            _mark_flags_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers, per_worker_buffer_size=2))
        return ds

    def _iterator(self):
        if self._it is None:
            self._it = iter(self.dataset())
        return self._it

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._iterator())
        if self.workers > 0:
            # Prefetch processes hand batches over in shared memory, freed when the array is; jax on a CPU
            # keeps the array it is given (no copy) beyond the run, so the block outlived Grain's cleanup
            # and resource_tracker reported it leaked at exit. A batch the feed returns owns its memory.
            batch = {k: np.array(v, copy=True) for k, v in batch.items()}
        return batch

    def get_state(self) -> dict:
        return {
            "grain": self._iterator().get_state(),
            "workers": self.workers,
            "records": len(self.record_buckets),
            "batch_sizes": self.batch_sizes(),
        }

    def set_state(self, state: dict) -> None:
        if "grain" not in state:
            raise ValueError(
                f"the checkpoint's data state {sorted(state)} is not from a data.path dataset "
                "(was it trained on the embedded dataset?)"
            )
        if state.get("records") != len(self.record_buckets):
            raise ValueError(
                f"the checkpoint's data state is for a dataset of {state.get('records')} samples, "
                f"{self.manifest.directory!r} holds {len(self.record_buckets)}"
            )
        if state.get("workers") != self.workers:
            raise ValueError(
                f"the checkpoint's data state was saved with data.workers={state.get('workers')}; "
                f"resume with the same (now {self.workers}) to continue the same batch sequence"
            )
        if state.get("batch_sizes") != self.batch_sizes():
            log.warning(
                "batch sizes per bucket changed since the checkpoint (%s -> %s): training continues, "
                "but not with the batches an uninterrupted run would have seen",
                state.get("batch_sizes"),
                self.batch_sizes(),
            )
        self._iterator().set_state(state["grain"])

    def batch_at(self, index: int, shape) -> dict[str, np.ndarray]:
        """The index-th fixed batch of a bucket, in file order (for evaluation: no shuffling, no state)."""
        k = self._bucket_index[tuple(shape)]
        members = np.flatnonzero(self.record_buckets == k)
        b = self.batch_size(shape)
        ids = members[(index * b + np.arange(b)) % len(members)]
        rows = HostRows(self.process_index, self.process_count)({"bucket": k, "ids": ids})
        return self.reader(rows)

    def close(self) -> None:
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        self._it = None
