"""One process of the two-process test (tests/test_multihost.py); not collected by pytest.

    python tests/multihost_worker.py PROCESS_ID PORT DATASET WORKDIR OUT.json

Trains 2 steps, stops (checkpoint), resumes in a new Trainer to step 4, and writes what it fed per
step (bucket, its record ids, loss) plus the ids a fresh feed gives for the same steps.
"""

import json
import sys

import jax

process_id, port, dataset, workdir, out = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

from dsv_jax.config import get_config  # noqa: E402
from dsv_jax.data.feed import resolve_data_config  # noqa: E402
from dsv_jax.data.pipeline import GrainFeed  # noqa: E402
from dsv_jax.train.trainer import Trainer  # noqa: E402
from tests.conftest import SMALL  # noqa: E402

CFG = get_config(
    "tiny",
    SMALL
    + [
        f"data.path={dataset}",
        "model.in_channels=12",
        "data.workers=0",
        "data.batching=dual",
        "data.m_mem=160",
        "data.m_comp=700",
        "data.cost_p=1.5",
        "train.steps=100",
        "train.ckpt_every=1000",
    ],
)


class Recorder:
    """The trainer's feed, with ids: remembers the record ids of each batch it hands out."""

    def __init__(self, feed):
        self.feed, self.ids = feed, []
        self.shapes, self.batch_size, self.batch_at = feed.shapes, feed.batch_size, feed.batch_at
        self.heldout = feed.heldout

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.feed)
        self.ids.append(batch.pop("record_id").tolist())
        return batch

    def get_state(self):
        return self.feed.get_state()

    def set_state(self, state):
        self.feed.set_state(state)

    def close(self):
        self.feed.close()


def phase(stop_at):
    trainer = Trainer(CFG, workdir, progress=False)
    start = int(trainer.state.step)
    feed = GrainFeed(
        trainer.cfg,
        batch_multiple=8,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        with_ids=True,
    )
    feed.set_state(trainer.feed.get_state())  # fresh, or as restored from the checkpoint
    trainer.feed = Recorder(feed)
    records = [r for r in trainer.run(stop_at=stop_at) if "loss" in r]
    trainer.close()
    return start, records, trainer.feed.ids[: stop_at - start]  # the prefetcher may have read ahead


assert jax.device_count() == 8 and jax.local_device_count() == 4
start1, rec1, ids1 = phase(2)
start2, rec2, ids2 = phase(4)
reference = GrainFeed(
    resolve_data_config(CFG), batch_multiple=8, process_index=jax.process_index(), process_count=2, with_ids=True
)
ref_ids = [next(reference)["record_id"].tolist() for _ in range(4)]
with open(out, "w") as f:
    json.dump(
        {
            "starts": [start1, start2],
            "steps": [r["step"] for r in rec1 + rec2],
            "buckets": [r["bucket"] for r in rec1 + rec2],
            "batch": [r["batch"] for r in rec1 + rec2],
            "losses": [r["loss"] for r in rec1 + rec2],
            "ids": ids1 + ids2,
            "ref_ids": ref_ids,
            "ref_state": reference.get_state(),
        },
        f,
    )
jax.distributed.shutdown()
