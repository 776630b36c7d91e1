"""A data file's rows tokenized by worker processes (data.num_workers, LLaMA-Factory's
preprocessing_num_workers): chunks of rows in file order, each row's result (its input_ids and
labels, or the RowError that refused it) back in that order, so that the examples, the first
bad row named and the rows skipped are the same as in the training process alone.

The workers are forked: they inherit the rows (an Arrow-backed Dataset, memory-mapped, or the
parsed lines) and the tokenizer instead of having them pickled, as HF datasets' map(num_proc)
forks; only the chunks' bounds go out and the token ids come back. Tokenizing happens before
the model is built, so a fork copies little. Where fork is not offered (Windows), the
training process tokenizes alone."""
from __future__ import annotations

import ctypes
import math
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Any

from zerofit.core.errors import ConfigError

# per file: below it, under a second at stake (1k short alpaca rows: 0.6 s on one core), one process
# kept; a directory of shards gets its workers shard by shard (a pool forks in milliseconds)
AUTO_MIN_ROWS = 1_000
AUTO_MOST_WORKERS = 16  # still faster than 8 on a 16-core host (bench/results/README.md)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
CHUNKS_PER_WORKER = 4  # small enough that the progress moves and the workers finish together
MOST_ROWS_PER_CHUNK = 64  # a stop (a bad row, Ctrl-C) waits for one chunk: 64 rows (a task costs ~0.2 ms)


class WorkerDied(ConfigError):
    """A worker ended without its chunk's results: killed (the OOM killer) or crashed."""


_tokenize_at: Callable[[int], Any] | None = None  # set before the fork, called by the workers


def worker_count(setting: int | None, rows: int, cores: int, local_ranks: int) -> int:
    """How many processes tokenize a file of `rows` rows: data.num_workers (`setting`, None for
    the default), never more than the share of the cores of one of `local_ranks` ranks tokenizing
    at once on the machine (one where its first rank tokenizes for all, see datacache.read) nor
    than the rows."""
    share = max(1, cores // max(1, local_ranks))
    if setting is None:
        wanted = min(AUTO_MOST_WORKERS, share) if rows >= AUTO_MIN_ROWS else 1
    else:
        wanted = min(setting, share)
    return max(1, min(wanted, rows))


def chunk_bounds(rows: int, workers: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk, in file order."""
    size = max(1, min(MOST_ROWS_PER_CHUNK, math.ceil(rows / (workers * CHUNKS_PER_WORKER))))
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def tokenized(rows: int, tokenize_at: Callable[[int], Any], workers: int) -> Iterator:
    """tokenize_at(i) for each of the `rows` rows, in order: in this process, or in `workers`
    forked ones that inherit tokenize_at (the rows and tokenizer it holds) unpickled. Close
    the iterator to stop the workers early; a worker killed (the OOM killer) raises
    WorkerDied here rather than hang the start."""
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        yield from map(tokenize_at, range(rows))
        return
    with _forked_workers(workers) as pool:
        try:
            for chunk in _mapped(pool, tokenize_at, chunk_bounds(rows, workers)):
                yield from chunk
        except BrokenProcessPool:
            raise WorkerDied(f"a tokenizing worker process died ({workers} were tokenizing, each with its copy of "
                             f"the tokenizer; the OOM killer, most likely: `dmesg | grep -i kill` says): set "
                             f"data.num_workers lower, 1 to tokenize in the training process alone") from None


@contextmanager
def _forked_workers(workers: int):
    """`workers` processes forked at the first task; left early (a bad row ended the reading, or
    an interrupt), the workers are killed and the chunks not yet begun dropped."""
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_as_worker,
                               initargs=(os.getpid(),))
    finished = False
    try:
        yield pool
        finished = True
    finally:
        if not finished:  # stopped early: the running chunks are not waited for (long rows: seconds each)
            for process in list(pool._processes.values()):  # the executor offers no terminate of its own
                process.kill()
        pool.shutdown(wait=True, cancel_futures=True)


def _mapped(pool: ProcessPoolExecutor, tokenize_at: Callable[[int], Any],
            bounds: list[tuple[int, int]]) -> Iterator[list]:
    """The chunks' results in order. The workers fork while map submits (all at once, under
    fork), so they see `tokenize_at` as it is then, none of it pickled."""
    global _tokenize_at
    _tokenize_at = tokenize_at
    # the Rust tokenizer's threads, once used here, would warn in each child and turn themselves
    # off there: say so before the fork; the parent keeps its own setting
    quiet = "TOKENIZERS_PARALLELISM" not in os.environ
    if quiet:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return pool.map(_tokenize_chunk, bounds)
    finally:
        _tokenize_at = None  # the children hold their copy; the parent's goes with its reading
        if quiet:
            del os.environ["TOKENIZERS_PARALLELISM"]


def _as_worker(parent: int) -> None:
    """The training process's signal handlers are not a worker's: Ctrl-C is the parent's to
    handle (it ends the pool), and SIGTERM ends a worker outright. A worker dies with its
    parent (prctl PR_SET_PDEATHSIG): it holds the parent's open files, the run's lock among
    them, and a parent killed outright (the OOM killer) left it holding the run ("in use by
    another zerofit train") and a pipe into `tee` open."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)


def _tokenize_chunk(bounds: tuple[int, int]) -> list:
    return [_tokenize_at(index) for index in range(*bounds)]
