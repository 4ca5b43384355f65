"""prepare-data: a folder of videos and images with captions -> ArrayRecord shards + manifest.json.

    dsv-jax prepare-data --input clips/ --output data/ --buckets 1x32x32,8x32x48 --codec pixel:1x2x2

1. Find media under --input (recursively): videos .mp4 .webm .mov .mkv .avi .gif (read by imageio's
   pyav plugin; gif by pillow) and images .png .jpg .jpeg .webp .bmp. Captions come from a manifest
   (--captions FILE: JSONL with "file" and "caption", or CSV with those columns) or a sidecar
   NAME.txt beside the file; a file without one gets the empty caption (counted).
2. Put each file in a bucket: images in single-frame buckets, videos in multi-frame buckets with no
   more frames than the clip has (at --frame-stride). Among those, the closest aspect ratio wins;
   near ties go to the most frames, then to the largest size that needs no upscaling.
3. Resize keeping the aspect ratio until the frame covers the bucket, crop the centre; for videos
   take the centred window of frames. Reader processes (--workers) do this in parallel.
4. Encode in the main process with the codec (default: pixel patches, see data/codec.py; Wan 2.1's VAE,
   --codec wan2.1-vae:DIR, see data/wan.py; or your VAE, --codec pkg.module:fn) and, optionally, a text
   encoder (--text-encoder umt5:DIR, Wan's; or pkg.module:fn, returning fn(captions) -> (embeddings
   [N, L, D], mask [N, L])); write one ArrayRecord shard series per bucket.
5. With --eval-fraction F, hold out whole files: the round(F x files) files whose path hashes lowest
   (sha256, so the split depends on the names only: the same on every run and machine) go to a
   separate held-out shard series (`eval_shards` in the manifest), never to training.

A file that cannot be read is reported by name, counted, and skipped (--strict: stop at once). Shards
are written under a temporary name and renamed when complete; a failed run removes what it wrote,
and manifest.json (written last, atomically) marks a complete dataset.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from dsv_jax.data.codec import get_codec, get_text_encoder, is_builtin_text_encoder
from dsv_jax.data.manifest import MANIFEST, Manifest
from dsv_jax.data.records import pack

log = logging.getLogger(__name__)

VIDEO_EXTS = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".gif")
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
ASPECT_TIE = 0.05  # buckets within this log-aspect distance of the best count as equally close


class PrepareError(ValueError):
    pass


def parse_buckets(spec) -> list[tuple[int, int, int]]:
    """'1x32x32,8x32x48' (or a list of triples) -> [(1, 32, 32), (8, 32, 48)], latent T x H x W."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for item in items:
        try:
            shape = tuple(int(v) for v in (item.lower().split("x") if isinstance(item, str) else item))
        except ValueError:
            raise ValueError(f"bucket {item!r} is not of the form TxHxW (e.g. 8x32x48)") from None
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"bucket {item!r} must be three positive sizes T x H x W")
        out.append(shape)
    if not out:
        raise ValueError("no buckets given")
    if len(set(out)) != len(out):
        raise ValueError(f"buckets {out} repeat a shape")
    return out


# ---------------------------------------------------------------------------------------------
# Finding files and captions


def discover(input_dir: str) -> list[str]:
    """Media files under input_dir, as sorted paths relative to it."""
    found = []
    for root, dirs, files in os.walk(input_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.lower().endswith(VIDEO_EXTS + IMAGE_EXTS) and not name.startswith("."):
                found.append(os.path.relpath(os.path.join(root, name), input_dir))
    return found


def load_captions(path: str) -> dict[str, str]:
    """A JSONL or CSV caption manifest -> {relative path or file name: caption}."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"caption manifest {path!r} does not exist")
    rows: list[dict] = []
    if path.lower().endswith(".csv"):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
    table = {}
    for n, row in enumerate(rows, 1):
        name = next((row[k] for k in ("file", "path", "video", "image") if row.get(k)), None)
        text = next((row[k] for k in ("caption", "text", "prompt") if k in row), None)
        if name is None or text is None:
            raise ValueError(f"{path}: entry {n} needs a 'file' and a 'caption' field, got {sorted(row)}")
        table[os.path.normpath(name)] = str(text)
    return table


def caption_for(input_dir: str, rel: str, table: dict[str, str]) -> str | None:
    for key in (os.path.normpath(rel), os.path.basename(rel)):
        if key in table:
            return table[key]
    sidecar = os.path.join(input_dir, os.path.splitext(rel)[0] + ".txt")
    if os.path.exists(sidecar):
        with open(sidecar, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    return None


# ---------------------------------------------------------------------------------------------
# Reading and fitting one file (runs in reader processes; no jax here)


def probe(path: str) -> tuple[int, int, int]:
    """(frames, height, width) of a media file without decoding it all where the container says."""
    import imageio.v3 as iio

    ext = os.path.splitext(path)[1].lower()
    if ext in IMAGE_EXTS:
        shape = iio.improps(path).shape
        return 1, int(shape[0]), int(shape[1])
    if ext == ".gif":
        shape = iio.improps(path, index=None)
        return int(shape.shape[0]), int(shape.shape[1]), int(shape.shape[2])
    shape = iio.improps(path, plugin="pyav").shape
    n, h, w = int(shape[0]), int(shape[1]), int(shape[2])
    if n <= 0:  # some containers (webm) do not store a frame count: count by decoding
        n = sum(1 for _ in iio.imiter(path, plugin="pyav"))
    return n, h, w


def iter_frames(path: str) -> Iterable[np.ndarray]:
    import imageio.v3 as iio

    ext = os.path.splitext(path)[1].lower()
    if ext in IMAGE_EXTS:
        yield iio.imread(path)
    elif ext == ".gif":
        yield from iio.imiter(path, plugin="pillow", mode="RGB")
    else:
        yield from iio.imiter(path, plugin="pyav", format="rgb24")


def video_problem(path: str) -> str | None:
    """What FFmpeg says is wrong with a video file (empty, container, stream, codec, a frame that does
    not decode), or None when it finds nothing. Only called for a file that already failed."""
    import av

    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if os.path.getsize(path) == 0:
        return "empty file (0 bytes)"
    try:
        container = av.open(path)
    except av.error.FFmpegError as e:
        return f"cannot open the {ext} container: {e.strerror or e} (the file is corrupt, truncated or not {ext})"
    with container:
        if not container.streams.video:
            kinds = ", ".join(sorted({s.type for s in container.streams})) or "none"
            return f"the {ext} file holds no video stream (streams: {kinds})"
        stream = container.streams.video[0]
        codec = stream.codec_context.name if stream.codec_context is not None else "unknown"
        good = 0
        try:
            for _ in container.decode(stream):
                good += 1
        except av.error.FFmpegError as e:
            return (
                f"the {codec} video stream of the {ext} file does not decode after {good} good frame(s): "
                f"{e.strerror or e}"
            )
        if not good:
            return f"the {codec} video stream of the {ext} file has no decodable frame"
    return None


def to_rgb(frame: np.ndarray) -> np.ndarray:
    if frame.ndim == 2:
        frame = np.repeat(frame[..., None], 3, axis=-1)
    if frame.shape[-1] == 4:
        frame = frame[..., :3]
    if frame.shape[-1] == 1:
        frame = np.repeat(frame, 3, axis=-1)
    if frame.dtype != np.uint8:
        frame = np.clip(
            frame / (np.iinfo(frame.dtype).max / 255.0 if frame.dtype.kind == "u" else 1 / 255.0), 0, 255
        ).astype(np.uint8)
    return frame


def choose_bucket(frames: int, height: int, width: int, pixel_shapes, stride: int = 1) -> int | None:
    """Index of the bucket (given as pixel shapes) for a file of `frames` x height x width, or None."""
    is_image = frames == 1
    fits = [i for i, (f, _, _) in enumerate(pixel_shapes) if (f == 1) == is_image and (f - 1) * stride + 1 <= frames]
    if not fits:
        return None
    aspect = math.log(width / height)
    err = {i: abs(math.log(pixel_shapes[i][2] / pixel_shapes[i][1]) - aspect) for i in fits}
    best = min(err.values())
    close = [i for i in fits if err[i] <= best + ASPECT_TIE]

    def preference(i):
        f, h, w = pixel_shapes[i]
        no_upscale = h <= height and w <= width
        return (f, no_upscale, h * w if no_upscale else -h * w)

    return max(close, key=preference)


def fit_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """Aspect-preserving resize until the frame covers height x width, then the centre crop."""
    from PIL import Image, ImageOps

    img = Image.fromarray(to_rgb(frame))
    return np.asarray(ImageOps.fit(img, (width, height), method=Image.Resampling.BICUBIC, centering=(0.5, 0.5)))


@dataclass(frozen=True)
class ReadTask:
    path: str
    rel: str


@dataclass
class ReadResult:
    rel: str
    bucket: int | None = None
    frames: np.ndarray | None = None  # uint8 [F, PH, PW, 3]
    error: str | None = None  # unreadable
    skipped: str | None = None  # readable but fits no bucket


_reader_cfg: dict = {}


def _init_reader(pixel_shapes, stride):
    _reader_cfg.update(pixel_shapes=[tuple(s) for s in pixel_shapes], stride=stride)


def read_clip(task: ReadTask) -> ReadResult:
    shapes, stride = _reader_cfg["pixel_shapes"], _reader_cfg["stride"]
    try:
        n, h, w = probe(task.path)
        if n < 1 or h < 1 or w < 1:
            raise ValueError(f"no frames ({n} x {h} x {w})")
        k = choose_bucket(n, h, w, shapes, stride)
        if k is None:
            kind = "image" if n == 1 else f"video of {n} frames"
            return ReadResult(task.rel, skipped=f"{kind} fits no bucket (at frame stride {stride})")
        f, ph, pw = shapes[k]
        span = (f - 1) * stride + 1
        start = (n - span) // 2
        wanted = set(range(start, start + span, stride))
        out = []
        for i, frame in enumerate(iter_frames(task.path)):
            if i in wanted:
                out.append(fit_frame(frame, ph, pw))
                if len(out) == f:
                    break
        if len(out) < f:
            raise ValueError(f"the file holds {len(out)} readable frames from frame {start}, {f} needed")
        return ReadResult(task.rel, bucket=k, frames=np.stack(out))
    except Exception as e:  # any failure of a file is that file's failure, reported by name
        problem = None
        ext = os.path.splitext(task.path)[1].lower()
        if ext in VIDEO_EXTS and ext != ".gif":  # imageio's "`pyav` can not handle the given uri" says little
            try:
                problem = video_problem(task.path)
            except Exception:  # the diagnosis must not hide the original error
                problem = None
        return ReadResult(task.rel, error=problem or f"{type(e).__name__}: {e}".strip().splitlines()[0][:300])


# ---------------------------------------------------------------------------------------------
# Writing


class ShardWriter:
    """One bucket's shard series; each shard is written as NAME.partial and renamed when complete."""

    def __init__(self, directory: str, bucket: int, shard_size: int, prefix: str = "b"):
        self.directory, self.bucket, self.shard_size, self.prefix = directory, bucket, shard_size, prefix
        self.done: list[dict] = []
        self._writer, self._count, self._name = None, 0, None

    def write(self, record: bytes) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        if self._writer is None:
            self._name = f"{self.prefix}{self.bucket:02d}-{len(self.done):05d}.array_record"
            self._writer = ArrayRecordWriter(self._partial(), "group_size:1")
            self._count = 0
        self._writer.write(record)
        self._count += 1
        if self._count == self.shard_size:
            self.finish()

    def _partial(self) -> str:
        return os.path.join(self.directory, self._name + ".partial")

    def finish(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        os.replace(self._partial(), os.path.join(self.directory, self._name))
        self.done.append({"file": self._name, "bucket": self.bucket, "count": self._count})
        self._writer = None

    def abort(self) -> None:
        """Remove everything this writer wrote (used when the run fails)."""
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # the partial file goes anyway
                pass
            if os.path.exists(self._partial()):
                os.remove(self._partial())
            self._writer = None
        for shard in self.done:
            path = os.path.join(self.directory, shard["file"])
            if os.path.exists(path):
                os.remove(path)
        self.done = []


@dataclass
class PrepareReport:
    manifest: str
    records: int
    per_bucket: dict[str, int]
    failed: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    uncaptioned: int = 0
    seconds: float = 0.0
    eval_per_bucket: dict[str, int] = field(default_factory=dict)  # the held-out split (--eval-fraction)

    @property
    def eval_records(self) -> int:
        return sum(self.eval_per_bucket.values())

    def summary(self) -> str:
        held = f" (+ {self.eval_records} held out for evaluation)" if self.eval_per_bucket else ""
        lines = [f"wrote {self.records} samples{held} in {self.seconds:.1f} s to {os.path.dirname(self.manifest)}"]
        lines += [
            f"  bucket {k}: {n}" + (f" (+ {self.eval_per_bucket[k]} held out)" if self.eval_per_bucket else "")
            for k, n in self.per_bucket.items()
        ]
        if self.failed:
            lines.append(f"{len(self.failed)} file(s) could not be read:")
            lines += [f"  {f['file']}: {f['error']}" for f in self.failed]
        if self.skipped:
            lines.append(f"{len(self.skipped)} file(s) fit no bucket:")
            lines += [f"  {f['file']}: {f['reason']}" for f in self.skipped]
        if self.uncaptioned:
            lines.append(f"{self.uncaptioned} file(s) had no caption (trained with the empty caption)")
        return "\n".join(lines)


def prepare(
    input_dir: str,
    output_dir: str,
    buckets,
    *,
    codec: str = "pixel:1x2x2",
    captions: str | None = None,
    text_encoder: str | None = None,
    workers: int | None = None,
    shard_size: int = 1000,
    frame_stride: int = 1,
    strict: bool = False,
    overwrite: bool = False,
    eval_fraction: float = 0.0,
    progress: bool = True,
) -> PrepareReport:
    """Prepare a dataset (see the module doc). Every argument is checked before any file is read."""
    t0 = time.perf_counter()
    if not os.path.isdir(input_dir):
        raise FileNotFoundError(f"--input {input_dir!r} is not a directory")
    shapes = parse_buckets(buckets)
    the_codec = get_codec(codec)
    pixel_shapes = [tuple(the_codec.pixel_shape(s)) for s in shapes]
    encode_text = get_text_encoder(text_encoder) if text_encoder else None
    if is_builtin_text_encoder(text_encoder):  # stored canonically: its folder made absolute
        text_encoder = encode_text.spec
    table = load_captions(captions) if captions else {}
    if shard_size < 1 or frame_stride < 1:
        raise ValueError(f"--shard-size ({shard_size}) and --frame-stride ({frame_stride}) must be >= 1")
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"--eval-fraction {eval_fraction} must be in [0, 1)")
    if os.path.exists(os.path.join(output_dir, MANIFEST)) and not overwrite:
        raise FileExistsError(
            f"--output {output_dir!r} already holds a dataset ({MANIFEST}); pass --overwrite to replace it"
        )
    files = discover(input_dir)
    if not files:
        raise FileNotFoundError(
            f"no videos ({' '.join(VIDEO_EXTS)}) or images ({' '.join(IMAGE_EXTS)}) under {input_dir!r}"
        )
    held_out = held_out_files(files, eval_fraction)
    # Shards are staged in a private folder and moved into place only when the whole run succeeded:
    # a failed run leaves the output (and any dataset already there) as it was, and removes the
    # folders it made for it.
    made = _missing_ancestor(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=output_dir)
    tasks = [ReadTask(os.path.join(input_dir, rel), rel) for rel in files]
    workers = min(len(tasks), workers if workers is not None else max(1, (os.cpu_count() or 2) - 1))

    writers = [ShardWriter(staging, k, shard_size) for k in range(len(shapes))]
    eval_writers = [ShardWriter(staging, k, shard_size, prefix="e") for k in range(len(shapes))]
    failed, skipped, uncaptioned = [], [], 0
    counts, eval_counts = [0] * len(shapes), [0] * len(shapes)
    text_spec: dict = {"kind": "caption"}
    pending: list[tuple[ReadResult, str]] = []

    def flush():
        nonlocal text_spec
        if not pending:
            return
        caps = [c for _, c in pending]
        emb = mask = None
        if encode_text is not None:
            emb, mask = encode_text(caps)
            emb, mask = np.asarray(emb), np.asarray(mask, bool)
            if emb.ndim != 3 or mask.shape != emb.shape[:2] or len(emb) != len(caps):
                raise PrepareError(
                    f"text encoder {text_encoder!r} returned embeddings {emb.shape} and mask "
                    f"{mask.shape} for {len(caps)} captions; expected [N, L, D] and [N, L]"
                )
            spec = {
                "kind": "embedding",
                "max_len": int(emb.shape[1]),
                "dim": int(emb.shape[2]),
                "encoder": text_encoder,
            }
            if text_spec["kind"] == "embedding" and spec != text_spec:
                raise PrepareError(
                    f"text encoder {text_encoder!r} changed its output shape between batches: {text_spec} then {spec}"
                )
            text_spec = spec
        for j, (res, cap) in enumerate(pending):
            latent = np.asarray(the_codec.encode(res.frames))
            if latent.shape != (*shapes[res.bucket], the_codec.channels):
                raise PrepareError(
                    f"codec {the_codec.name!r} encoded {res.rel} to {latent.shape}, expected "
                    f"{(*shapes[res.bucket], the_codec.channels)}"
                )
            if latent.dtype != np.uint8:
                latent = latent.astype(np.float16)
            arrays = {"latent": latent}
            if emb is not None:
                arrays.update(text_emb=emb[j].astype(np.float16), text_mask=mask[j])
            held = res.rel in held_out
            (eval_writers if held else writers)[res.bucket].write(pack(arrays, {"caption": cap, "file": res.rel}))
            (eval_counts if held else counts)[res.bucket] += 1
        pending.clear()

    from dsv_jax.progress import on_terminal, tqdm_class

    tqdm = tqdm_class()

    pool = None
    try:
        if workers > 1:
            # spawn: the caller may hold jax or threads, which fork would copy in an unusable state
            pool = mp.get_context("spawn").Pool(
                workers, initializer=_init_reader, initargs=(pixel_shapes, frame_stride)
            )
            results = pool.imap(read_clip, tasks, chunksize=1)  # ordered: the output does not depend on timing
        else:
            _init_reader(pixel_shapes, frame_stride)
            results = map(read_clip, tasks)
        for res in tqdm(
            results, total=len(tasks), desc="prepare-data", disable=not (progress and on_terminal()), unit="file"
        ):
            if res.error is not None:
                if strict:
                    raise PrepareError(f"{res.rel}: {res.error} (--strict)")
                log.warning("skipping unreadable file %s: %s", res.rel, res.error)
                failed.append({"file": res.rel, "error": res.error})
                continue
            if res.skipped is not None:
                skipped.append({"file": res.rel, "reason": res.skipped})
                continue
            cap = caption_for(input_dir, res.rel, table)
            if cap is None:
                uncaptioned += 1
                cap = ""
            pending.append((res, cap))
            if len(pending) >= 32:
                flush()
        flush()
        if sum(counts) == 0:
            what = f"{len(tasks) - len(held_out)} training file(s)" if held_out else f"{len(tasks)} file(s)"
            raise PrepareError(
                f"none of the {what} under {input_dir!r} gave a sample ({len(failed)} unreadable, "
                f"{len(skipped)} fitting no bucket)"
            )
        if held_out and sum(eval_counts) == 0:
            log.warning(
                "none of the %d held-out file(s) gave a sample: the dataset has no held-out split", len(held_out)
            )
        for w in writers + eval_writers:
            w.finish()
    except BaseException:
        for w in writers + eval_writers:
            w.abort()
        shutil.rmtree(staging, ignore_errors=True)
        _remove_made(output_dir, made)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()

    if overwrite:
        _remove_dataset(output_dir)
    for w in writers + eval_writers:
        for shard in w.done:
            os.replace(os.path.join(staging, shard["file"]), os.path.join(output_dir, shard["file"]))
    shutil.rmtree(staging, ignore_errors=True)

    manifest = Manifest(
        directory=os.path.abspath(output_dir),
        codec=the_codec.name,
        channels=the_codec.channels,
        text=text_spec,
        buckets=[
            {"shape": list(s), "pixel_shape": list(p), "count": c, "eval_count": e}
            for s, p, c, e in zip(shapes, pixel_shapes, counts, eval_counts)
        ],
        shards=[s for w in writers for s in w.done],
        failed=failed,
        skipped=skipped,
        eval_shards=[s for w in eval_writers for s in w.done],
        extra={
            "source": os.path.abspath(input_dir),
            "frame_stride": frame_stride,
            "uncaptioned": uncaptioned,
            "eval_fraction": eval_fraction,
            "eval_files": len(held_out),
        },
    )
    path = manifest.write()
    names = ["x".join(map(str, s)) for s in shapes]
    return PrepareReport(
        manifest=path,
        records=sum(counts),
        per_bucket=dict(zip(names, counts)),
        failed=failed,
        skipped=skipped,
        uncaptioned=uncaptioned,
        seconds=time.perf_counter() - t0,
        eval_per_bucket=dict(zip(names, eval_counts)) if held_out else {},
    )


def held_out_files(files: list[str], fraction: float) -> set[str]:
    """The files of the held-out split: the round(fraction x files) (at least one, never all) whose
    relative path hashes lowest. Depends only on the names, so it is the same on every run."""
    if fraction <= 0:
        return set()
    if len(files) < 2:
        raise ValueError(f"--eval-fraction {fraction} needs at least 2 files to split, found {len(files)}")
    n = min(len(files) - 1, max(1, round(fraction * len(files))))
    key = lambda rel: hashlib.sha256(rel.replace(os.sep, "/").encode()).hexdigest()
    return set(sorted(files, key=key)[:n])


def _missing_ancestor(path: str) -> str | None:
    """The outermost folder of `path` (itself included) that does not exist yet: what makedirs will make."""
    path, missing = os.path.abspath(path), None
    while not os.path.lexists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _remove_made(path: str, made: str | None) -> None:
    """Remove the empty folders from `path` up to `made` (those this run made); a folder that holds
    anything, or one that existed before, is left."""
    if made is None:
        return
    path, made = os.path.abspath(path), os.path.abspath(made)
    while True:
        try:
            os.rmdir(path)
        except OSError:  # not empty (or gone): nothing above it is ours to remove either
            return
        if path == made:
            return
        path = os.path.dirname(path)


def _remove_dataset(directory: str) -> None:
    for name in os.listdir(directory):
        if name == MANIFEST or name.endswith((".array_record", ".array_record.partial")):
            os.remove(os.path.join(directory, name))
