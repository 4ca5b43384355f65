"""Two things orbax does that a user should neither see nor pay for.

- A read-only CheckpointManager says so twice as it opens (`read_only=True, setting save_interval_steps=0`,
  `Given directory is read only`), through absl's logger: `read_only_quiet()` drops those two messages
  while one is made, nothing else.
- orbax runs each restore in an event loop of its own and closes it when the restore returns or raises
  (asyncio_utils._run_sync_via_new_loop). When one array of a checkpoint fails to read (a truncated file),
  the restore raises at once while tensorstore's other reads are still in flight; as each finishes, on a
  tensorstore thread, it hands its result to that closed loop (`call_soon_threadsafe`), which raises
  `RuntimeError: Event loop is closed` where nobody can catch it (an "unraisable" exception, printed or, under
  pytest, a PytestUnraisableExceptionWarning), seconds later. `late_reads_dropped()` makes the loops
  created meanwhile drop what arrives after they closed: the restore that awaited it has already failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import warnings


class ReadOnlyNotices(logging.Filter):
    """Drops orbax's notices that a read-only manager is read-only: a reader asked for exactly that."""

    NOTICES = ("read_only=True, setting save_interval_steps=0", "Given directory is read only")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(notice in str(record.msg) for notice in self.NOTICES)


@contextlib.contextmanager
def read_only_quiet():
    quiet, absl = ReadOnlyNotices(), logging.getLogger("absl")  # orbax logs through absl's logger
    absl.addFilter(quiet)
    try:
        yield
    finally:
        absl.removeFilter(quiet)


class ClosedLoopDropsLateResults(asyncio.SelectorEventLoop):
    """An event loop that, once closed, drops the callbacks other threads hand it instead of raising."""

    def call_soon_threadsafe(self, callback, *args, context=None):
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        except RuntimeError:
            if not self.is_closed():
                raise
            return None  # a read that finished after the restore awaiting it failed


def _dropping_policy():
    """An event loop policy whose new loops are ClosedLoopDropsLateResults; its base class is looked up here,
    not at import: the policy API is deprecated from Python 3.14, and importing dsv_jax must not warn."""

    class Policy(asyncio.DefaultEventLoopPolicy):
        def new_event_loop(self):
            return ClosedLoopDropsLateResults()

    return Policy()


_policy_lock = threading.Lock()
_policy_users = 0  # restores inside late_reads_dropped now (in any thread)
_policy_before = None  # the process's policy before the first of them


def _set_policy(policy) -> None:
    with warnings.catch_warnings():  # the policy API is deprecated from Python 3.14 (still there until 3.16)
        warnings.simplefilter("ignore", DeprecationWarning)
        asyncio.set_event_loop_policy(policy)


@contextlib.contextmanager
def late_reads_dropped():
    """orbax restores inside run on event loops that drop late reads (see the module docstring). The event
    loop policy is the process's: the first of overlapping restores (several threads) puts it in, the last to
    end puts the previous one back (the loops made meanwhile stay as made)."""
    global _policy_users, _policy_before
    with _policy_lock:
        if _policy_users == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                _policy_before = asyncio.get_event_loop_policy()
                policy = _dropping_policy()
            _set_policy(policy)
        _policy_users += 1
    try:
        yield
    finally:
        with _policy_lock:
            _policy_users -= 1
            if _policy_users == 0:
                _set_policy(_policy_before)
                _policy_before = None
