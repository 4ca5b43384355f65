"""The built-in word tokenizer for captions (no pretrained tokenizer can be downloaded here).

Words of the embedded datasets' captions (synthetic shapes, photos) have their own ids; any other word
hashes (crc32, stable across runs and hosts) into `hash_buckets` extra ids, so every prompt encodes.
Id 0 is padding and id 1 starts every caption: the empty caption is [1], never all padding, so
attention to text always has a valid key. New words go at the end of WORDS (known words keep their
ids); the embedding table grows with them, so a checkpoint from before an addition (the photo words
came after the first release) does not restore into a model of the new vocabulary.
"""

from __future__ import annotations

import re
import zlib

import numpy as np

PAD, START = 0, 1
WORDS = (
    "a an the of and on in with at to is moving moves still static image video slowly quickly fast slow "
    "left right up down diagonally across background small large big tiny "
    "circle square triangle ring cross diamond "
    "red green blue yellow cyan magenta white orange purple pink gray black "
    "two three bouncing growing shrinking spinning "
    # data.source=photos (data/photos.py)
    "over front camera pans zooms out cat cup astronaut rocket horse coin eye "
    "brick wall grass gravel stars launch pad cells cameraman coins"
).split()
_IDS = {w: i + 2 for i, w in enumerate(WORDS)}


def vocab_size(hash_buckets: int) -> int:
    return 2 + len(WORDS) + hash_buckets


def tokenize(caption: str, max_len: int, hash_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """Caption -> (ids int32 [max_len], mask bool [max_len]); valid tokens are a prefix."""
    ids = [START]
    for word in re.findall(r"[a-z0-9]+", caption.lower()):
        if word in _IDS:
            ids.append(_IDS[word])
        elif hash_buckets > 0:
            ids.append(2 + len(WORDS) + zlib.crc32(word.encode()) % hash_buckets)
    ids = ids[:max_len]
    out = np.zeros(max_len, np.int32)
    out[: len(ids)] = ids
    return out, np.arange(max_len) < len(ids)


def tokenize_batch(captions, max_len: int, hash_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = zip(*(tokenize(c, max_len, hash_buckets) for c in captions))
    return np.stack(ids), np.stack(mask)
