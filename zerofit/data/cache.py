"""The tokenized rows of a run, kept in RUN_DIR/data-cache/ for its next start: a resume (after
a preemption, an OOM retry, torchrun restarting the ranks) reads them instead of tokenizing
every row again (100k short alpaca rows: 30 s on 2 cores, 1 s from the cache).

A cache file is named by what decides its contents: each data file's path, size and
modification time (a saved dataset's files too), the data keys tokenizing reads, the
tokenizer (its tokenizer.json, chat template and special tokens) and zerofit's own code that
reads and tokenizes rows, and the versions of the libraries that render and tokenize them
(transformers, tokenizers, jinja2, datasets). Anything else changed, and the rows are tokenized
again. Only fast tokenizers (a tokenizer.json to hash) are cached.

A cache file is numpy's .npz, read with allow_pickle=False: the token ids, the labels and each
example's lengths as int32 arrays, the rest of the Read as JSON bytes. Nothing in it can run
code (a data.cache_dir may be shared with others); one that cannot be read is stale: said, and
the rows are tokenized again."""
from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.metadata
import itertools
import json
import os
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerofit.config.data import DataConfig
from zerofit.core.console import HIDDEN, Shown, say, warn
from zerofit.data.tokenize import Read, read_examples

CACHE_DIR = "data-cache"
SUFFIX = ".npz"
# the data keys tokenize_row and read_examples read: the others shape sequences from the examples
READ_KEYS = ("format", "alpaca_template", "columns", "max_samples", "skip_bad_rows")
# zerofit's code that reads and tokenizes rows: the data keys' meaning (dataconfig.py) and how a
# section reads its values (section.py) included
CODE = ("data/tokenize.py", "data/conversations.py", "data/workers.py", "data/files.py", "data/toolcalls.py",
        "config/data.py", "config/section.py", "data/cache.py")
LIBRARIES = ("transformers", "tokenizers", "jinja2", "datasets")


@dataclass(frozen=True)
class Node:
    """How the ranks of one machine share a tokenization (LLaMA-Factory's main_process_first):
    the `first` tokenizes with all of the machine's cores and keeps the rows in the cache; the
    others `wait` (every rank of the machine calls it once per read) and read them there. Each
    rank tokenizing at once took a share of the cores, and held its own tokenizing peak."""
    first: bool
    ranks: int  # the ranks on this machine
    wait: Callable[[], None]  # returns once every rank of the machine has called it


def read(files: list[list[Path]], cfg: DataConfig, tokenizer, run_dir: Path | None, kind: str,
         shown: Shown = HIDDEN, node: Node | None = None) -> Read:
    """read_examples(files, ...), from the data cache (data.cache_dir, else RUN_DIR/data-cache)
    when a start before tokenized the same rows the same way; otherwise tokenized and kept
    there, by one rank of the machine where a `node` of several is given. No `run_dir`:
    nothing cached (a verb that only looks at the data)."""
    key = cache_key(files, cfg, tokenizer) if run_dir is not None else None
    if key is None:  # nothing to hand the rows over in: every rank tokenizes
        return read_examples(files, cfg, tokenizer, shown)
    shared = cfg.cache_dir is not None
    path = cache_file(Path(cfg.cache_dir) if shared else run_dir / CACHE_DIR, kind, key)
    sharing = node is not None and node.ranks > 1
    if sharing and not node.first:
        node.wait()  # the first has kept the rows, or could not: then each rank tokenizes them itself
        return cached(path, shown) or read_examples(files, cfg, tokenizer, shown, ranks_tokenizing=node.ranks - 1)
    found = cached(path, shown)
    if found is not None:
        if shown.enabled:
            said = "data.cache_dir, tokenized before from the same files, data keys and tokenizer" if shared \
                else "tokenized by an earlier start of this run"
            say(f"{kind} rows: {said} ({path})")
    else:
        found = read_examples(files, cfg, tokenizer, shown, ranks_tokenizing=1 if sharing else None)
        problem = keep(path, found, kind, replace_older=not shared)
        if problem and shown.enabled:  # a directory that is a file, or unwritable: each start paid the tokenizing
            where = f"data.cache_dir {path.parent}" if shared else f"{path.parent}"
            warn(f"{where}: the tokenized rows could not be kept ({problem}); the next start tokenizes them again: "
                 f"make it a writable directory, or free space there")
        if sharing and shown.enabled:
            say(sharing_note(kind, node.ranks - 1, path.parent, problem))
    if sharing:
        node.wait()
    return found


def sharing_note(kind: str, others: int, where: Path, problem: str | None) -> str:
    ranks = "rank" if others == 1 else "ranks"
    if problem:
        return f"{kind} rows: tokenized by this machine's first rank but not kept ({problem}); its {others} other " \
               f"{ranks} tokenize them too"
    return f"{kind} rows: tokenized once per machine, by its first rank with all of its cores; its {others} other " \
           f"{ranks} read them from {where}"


def cache_file(directory: Path, kind: str, key: str) -> Path:
    return directory / f"{kind}-{key}{SUFFIX}"


def cached(path: Path, shown: Shown = HIDDEN) -> Read | None:
    """The rows kept at `path`; None when there are none, or when they cannot be read (cut
    short, damaged, not what `keep` writes): then said, and tokenized again."""
    if not path.is_file():
        return None
    try:
        return from_arrays(path)
    except (OSError, ValueError, TypeError, KeyError, EOFError, zipfile.BadZipFile) as e:
        if shown.enabled:
            warn(f"{path}: the tokenized rows kept there cannot be read ({type(e).__name__}: "
                 f"{str(e).splitlines()[0][:120] if str(e) else 'damaged'}); tokenizing them again")
        return None


def to_arrays(found: Read) -> dict:
    """A Read as arrays: every example's ids and labels end to end, their lengths, the rest as JSON."""
    examples = found.examples
    meta = {"skipped": found.skipped, "reasons": found.reasons, "formats": list(found.formats),
            "capped": found.capped, "unread": found.unread}
    return {"ids": np.fromiter(itertools.chain.from_iterable(ids for ids, _ in examples), np.int32),
            "labels": np.fromiter(itertools.chain.from_iterable(labels for _, labels in examples), np.int32),
            "id_lengths": np.fromiter((len(ids) for ids, _ in examples), np.int64, len(examples)),
            "label_lengths": np.fromiter((len(labels) for _, labels in examples), np.int64, len(examples)),
            "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}


def from_arrays(path: Path) -> Read:
    """The Read `to_arrays` wrote at `path` (allow_pickle=False: no object can be in it)."""
    with np.load(path, allow_pickle=False) as arrays, gc_paused():
        meta = json.loads(arrays["meta"].tobytes())
        examples = list(zip(split(arrays["ids"], arrays["id_lengths"]),
                            split(arrays["labels"], arrays["label_lengths"]), strict=True))
    return Read(examples, int(meta["skipped"]), list(meta["reasons"]), tuple(meta["formats"]), bool(meta["capped"]),
                list(meta["unread"]))


@contextlib.contextmanager
def gc_paused():
    """Python's cycle collector off while the lists are made: it ran again and again over the
    growing lists, 1.7 s of the 2.1 s that 7M tokens in 100k examples took (0.5 s without)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def split(values: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    """`values` cut into consecutive lists of `lengths` (which must add up to all of them)."""
    if int(lengths.sum()) != len(values) or (lengths < 0).any():
        raise ValueError(f"lengths add up to {int(lengths.sum())} of {len(values)} values")
    flat, ends = values.tolist(), np.cumsum(lengths).tolist()
    return [flat[start:end] for start, end in zip([0] + ends[:-1], ends)]


def keep(path: Path, found: Read, kind: str, replace_older: bool = True) -> str | None:
    """Written whole or not at all (each rank its own temporary, unique across hosts sharing
    the directory, then renamed over); a full disk or a read-only directory costs the next
    start its time, not this one its run: the OSError's words come back. `replace_older`
    (the run's own directory): an older tokenization of the `kind` rows goes."""
    partial = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        partial = Path(name)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **to_arrays(found))
        os.replace(partial, path)
        for older in path.parent.glob(f"{kind}-*{SUFFIX}") if replace_older else ():
            if older != path:
                older.unlink(missing_ok=True)
    except OSError as e:
        if partial is not None:
            partial.unlink(missing_ok=True)
        return e.strerror or str(e)
    return None


def cache_key(files: list[list[Path]], cfg: DataConfig, tokenizer) -> str | None:
    """What the tokenized rows depend on, hashed; None for a tokenizer without tokenizer.json."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    digest = hashlib.sha256()
    for entry in files:
        for file in entry:
            for part in sorted(file.rglob("*")) if file.is_dir() else [file]:
                if part.is_file():
                    stat = part.stat()
                    digest.update(f"{part.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        digest.update(b"\x01")  # where one data.path entry ends: max_samples counts per entry
    digest.update(json.dumps({k: getattr(cfg, k) for k in READ_KEYS}, sort_keys=True, default=str).encode())
    digest.update(backend.to_str().encode())
    digest.update(json.dumps([type(tokenizer).__name__, tokenizer.chat_template, tokenizer.special_tokens_map],
                             sort_keys=True, default=str).encode())
    here = Path(__file__).parents[1]  # zerofit/
    for name in CODE:
        digest.update((here / name).read_bytes())
    digest.update(" ".join(importlib.metadata.version(name) for name in LIBRARIES).encode())
    return digest.hexdigest()[:16]
