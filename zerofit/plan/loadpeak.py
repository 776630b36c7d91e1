"""The host peak of loading and tokenizing the data, predicted before it is loaded.

`train` reads every data file through HF `datasets` (pyarrow), tokenizes each row into two
Python lists (datafiles, tokenizing; forked workers under data.num_workers) and packs them
into int64 arrays (rowlayout) before the model exists: a large dataset on a small host could
die of memory there, before any plan was checked. `load_peak` is the pure part: from the
files' facts (bytes, format, rows, the tokens a sample of their rows gives) it returns the
peak's components in bytes; `load_facts` gathers those facts (file sizes, parquet metadata,
the first rows of each file tokenized) and whether a tokenized cache will be read instead.

The constants were fitted on the CPU test machine (2 cores, glibc 2.35, CPython 3.12,
pyarrow/datasets as installed) with bench/tokenize_peak.py (bench/results/README.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zerofit.core.timeline import human_bytes
from zerofit.data import cache
from zerofit.data import workers as tokenworkers
from zerofit.data.files import JsonRows, data_entries, holds_json_lines, saved_dataset, with_columns
from zerofit.data.tokenize import no_model_length_warning, row_format, tokenize_row
from zerofit.machine.hardware import cpu_cores

MIB = 2**20
LOADING = "loading the data"  # the moment's name in the plan, its table and its refusal
BUILT_IN = ("demo", "synthetic")  # data.path's sources without files: nothing worth predicting
# VmRSS of `train` when it starts loading (python, torch, transformers, deepspeed, the process
# group, the model's config and tokenizer, the facts below gathered; a parquet file's sizing
# imports pyarrow too). train passes its own RSS instead; `zerofit plan`, another process,
# plans with this.
LOAD_BASE_BYTES = 400 * MIB
# HF datasets (and pyarrow, where sizing a parquet file had not imported it) imported and their
# first table read, beyond the table itself (jsonl and parquet alike).
DATASETS_IMPORT_BYTES = 100 * MIB
# Per token, held until the rows are packed: a pointer in input_ids and one in labels, the copies
# rowlayout makes (cut, relabelled, laid out in rows) and the packed int64 arrays (np.fromiter
# grows them by doubling), with ids that are all cached small ints (the demo's 100-id tokenizer),
# beyond HF datasets and its table.
TOKEN_LIST_BYTES = 64
# An id above 256 is an int object of its own (CPython caches -5..256): every real vocabulary's
# are; labels share input_ids' objects. sys.getsizeof(1000) = 28, 32 under pymalloc.
INT_OBJECT_BYTES = 32
SMALL_INT_IDS = 257
# Per example: the (ids, labels) tuple and the two lists' headers, pymalloc-rounded
EXAMPLE_BYTES = 184
# Rows sampled per file (its first) to count the tokens a file byte (or a parquet row) holds
SAMPLE_ROWS = 200
UNSAMPLED_ROW_BYTES = 1024  # a file without rows to sample (one JSON array): rows counted by its bytes
# Forked tokenizing workers (tokenworkers): per worker its private pages (heap, the tokenizer's
# buffers, the parent's pages it touched), and per token the results the parent has not read yet
# (pool.map sends every chunk's back as soon as it is done); fitted with 2 and 8 workers.
WORKER_BYTES = 20 * MIB
WORKER_RESULT_BYTES = 24  # per token


@dataclass(frozen=True)
class DataFile:
    """What loading one data file costs, known before it is read."""
    kind: str            # json (json/jsonl) | parquet | saved (a save_to_disk directory)
    table_bytes: int     # the Arrow table's bytes: the file's (json), uncompressed columns (parquet)
    rows: int            # rows, exact (parquet, saved) or estimated from the sample (json)
    tokens: int          # tokens its rows make, from the sample


@dataclass(frozen=True)
class LoadShape:
    """Everything the loading's peak depends on."""
    files: tuple[DataFile, ...]
    workers: int = 1             # processes tokenizing one file (tokenworkers.worker_count)
    vocab_size: int = 32000      # the tokenizer's ids: whether they are int objects of their own
    cached: bool = False         # a valid tokenized cache is read instead of the files
    process_bytes: int = LOAD_BASE_BYTES  # the process's RSS before it loads (train: measured)

    @property
    def tokens(self) -> int:
        return sum(f.tokens for f in self.files)

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)


def token_bytes(vocab_size: int, cached: bool = False) -> int:
    """Bytes one token takes until the rows are packed. Read from the cache (numpy's tolist), every
    label is an int object of its own too (no int but -5..256 is shared, IGNORE's -100 included)."""
    own_ints = (vocab_size > SMALL_INT_IDS) + cached
    return TOKEN_LIST_BYTES + own_ints * INT_OBJECT_BYTES


def load_peak(shape: LoadShape) -> dict[str, int]:
    """The host peak of load_splits, by component (bytes): the examples' lists and the packed
    arrays made from them at the end, with HF datasets and the largest file's Arrow table while
    it is tokenized, and the tokenizing workers; from a tokenized cache, the lists and arrays."""
    peak = {"process": shape.process_bytes,
            "examples": shape.tokens * token_bytes(shape.vocab_size, shape.cached) + shape.rows * EXAMPLE_BYTES}
    if shape.cached:
        return peak
    peak.update(datasets_library=DATASETS_IMPORT_BYTES,
                arrow_table=max((f.table_bytes for f in shape.files), default=0))
    if shape.workers > 1:
        peak["tokenizing_workers"] = shape.workers * WORKER_BYTES + shape.tokens * WORKER_RESULT_BYTES
    return peak


# ---------------------------------------------------------------- the facts (I/O)
def load_facts(cfg, tokenizer, run_dir: Path | None = None, process_bytes: int = LOAD_BASE_BYTES,
               ranks_tokenizing: int = 1) -> LoadShape | None:
    """The LoadShape of data.path and data.eval_path: None for the built-in sources (demo,
    synthetic), nothing worth predicting. Each file is sized from its metadata and the first
    SAMPLE_ROWS rows tokenized as a run tokenizes them; `run_dir` (train's) names where a
    tokenized cache would be (datacache), whose files are then read instead."""

    if cfg.path in BUILT_IN:
        return None
    sets = [("train", data_entries(cfg.path))] + ([("eval", data_entries(cfg.eval_path, "data.eval_path"))]
                                                  if cfg.eval_path else [])
    files = tuple(f for _, entries in sets for entry in entries for f in entry_facts(entry, cfg, tokenizer))
    cached = run_dir is not None and all(cache_found(entries, cfg, tokenizer, run_dir, kind) for kind, entries in sets)
    workers = max((tokenworkers.worker_count(cfg.num_workers, f.rows, cpu_cores(), ranks_tokenizing) for f in files),
                  default=1)
    return LoadShape(files, workers, len(tokenizer), cached, process_bytes)


def cache_found(entries: list[list[Path]], cfg, tokenizer, run_dir: Path, kind: str) -> bool:
    """Whether datacache.read will find the `kind` rows tokenized already."""

    key = cache.cache_key(entries, cfg, tokenizer)
    where = Path(cfg.cache_dir) if cfg.cache_dir is not None else Path(run_dir) / cache.CACHE_DIR
    return key is not None and cache.cache_file(where, kind, key).is_file()


def entry_facts(entry: list[Path], cfg, tokenizer) -> list[DataFile]:
    """The files of one data.path entry, data.max_samples keeping its first rows."""
    found, left = [], cfg.max_samples
    for file in entry:
        if left == 0:
            break
        try:
            facts = file_facts(file, cfg, tokenizer)
        except Exception:  # noqa: BLE001 - unreadable here (not UTF-8, damaged): read_rows says why, or reads it
            size = sum(p.stat().st_size for p in file.rglob("*")) if file.is_dir() else file.stat().st_size
            facts = DataFile("json", size, max(1, size // UNSAMPLED_ROW_BYTES), size)  # a token a byte: the most
        if left is not None and facts.rows > left:
            facts = DataFile(facts.kind, facts.table_bytes, left, facts.tokens * left // max(facts.rows, 1))
        found.append(facts)
        left = None if left is None else left - facts.rows
    return found


def file_facts(file: Path, cfg, tokenizer) -> DataFile:
    """One file's (or saved dataset's) bytes and rows from its metadata, its tokens from a sample."""
    if file.is_dir():

        table = saved_dataset(file)
        rows, sample = len(table), table.select(range(min(SAMPLE_ROWS, len(table)))).to_list()
        table_bytes = sum(p.stat().st_size for p in file.rglob("*.arrow"))
        return DataFile("saved", table_bytes, rows, tokens_of(sample, cfg, tokenizer) * rows // max(len(sample), 1))
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(file)
        meta = parquet.metadata
        rows = meta.num_rows
        table_bytes = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        sample = next(parquet.iter_batches(batch_size=SAMPLE_ROWS), None)
        sample = sample.to_pylist() if sample is not None else []
        return DataFile("parquet", table_bytes, rows, tokens_of(sample, cfg, tokenizer) * rows // max(len(sample), 1))
    file_bytes = file.stat().st_size
    sample, sample_bytes = json_sample(file)
    if not sample:  # one JSON array (or unreadable): priced by the text's own tokens
        with file.open(encoding="utf-8", errors="replace") as text:
            head = text.read(1 << 16)
        per_byte = len(tokenizer.encode(head, add_special_tokens=False)) / max(len(head.encode()), 1)
        return DataFile("json", file_bytes, max(1, file_bytes // UNSAMPLED_ROW_BYTES), int(per_byte * file_bytes))
    rows = max(len(sample), round(file_bytes * len(sample) / max(sample_bytes, 1)))
    return DataFile("json", file_bytes, rows, tokens_of(sample, cfg, tokenizer) * rows // len(sample))


def json_sample(file: Path) -> tuple[list[dict], int]:
    """The first SAMPLE_ROWS rows of a JSON lines file and the bytes of their lines; ([], 0)
    for a file that is not JSON lines."""
    import json


    if not holds_json_lines(file):
        return [], 0
    rows, read = [], 0
    with file.open("rb") as lines:
        for line in lines:
            read += len(line)
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
            if len(rows) == SAMPLE_ROWS:
                break
    return rows, read


def tokens_of(sample: list[dict], cfg, tokenizer) -> int:
    """The tokens the sampled rows make, tokenized as read_examples tokenizes them (a bad row
    counts none)."""

    if not sample:
        return 0
    rows, _, _ = with_columns(JsonRows(sample), cfg.columns, Path("sample"), cfg.format)
    tokens = 0
    with no_model_length_warning(tokenizer):
        for row in rows:
            fmt = row_format(row) if cfg.format == "auto" else cfg.format
            try:
                tokens += len(tokenize_row(row, fmt, tokenizer, cfg.alpaca_template)[0]) if fmt else 0
            except Exception:  # noqa: BLE001 - a bad row (RowError, a template's own error) makes no example
                pass
    return tokens


def load_fix(components: dict[str, int]) -> str:
    """What brings loading the data under the host budget, for the components predicted."""
    fixes = []
    if "tokenizing_workers" in components:
        fixes.append(f"lower data.num_workers (each forked tokenizer ~{WORKER_BYTES // MIB}MiB; 1 tokenizes in the "
                     f"training process alone)")
    if "arrow_table" in components:
        fixes.append("tokenize once on a larger host with the same data.cache_dir, tokenizer and data keys: a start "
                     "then reads the tokenized rows alone, without HF datasets' tables")
    fixes.append("read fewer rows (data.max_samples, or fewer files in data.path); streaming the data is not "
                 "supported: every row is tokenized and held before training")
    return "; ".join(fixes)


def over_budget(host, headroom: float, ranks: int = 1) -> str | None:
    """Why loading the data cannot start: its peak on the host (a planner.Device, for `ranks`
    loading at once) over the usable budget, with the fix; None when it fits."""

    if host.fits:
        return None
    parts = ", ".join(f"{name} {human_bytes(v)}" for name, v in sorted(host.components.items(), key=lambda kv: -kv[1]))
    each = f" ({ranks} ranks of this host each loading it)" if ranks > 1 else ""
    return (f"{LOADING} would peak at {human_bytes(host.total_bytes)} of host RAM{each}, over the "
            f"{human_bytes(host.usable_bytes)} usable ({human_bytes(host.budget_bytes)} less plan.headroom "
            f"{headroom:.0%}): {parts}; refused before loading. Fix: {load_fix(host.components)}")
