"""Local data files -> rows: jsonl/json/parquet files, directories of them and `datasets`
save_to_disk directories, read through HF `datasets`; a broken file or line is named by
file and line number, with the fix."""
from __future__ import annotations

import codecs
import json
import logging
import re
from pathlib import Path

from zerofit.config.data import FORMAT_FIELDS, column_fields
from zerofit.config.section import read_from
from zerofit.core.errors import ConfigError
from zerofit.core.runlock import LOCK_FILE

SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SAVED_DATASET_FILES = ("dataset_info.json", "state.json")  # what datasets' save_to_disk writes beside the arrow files
SAVED_DATASET_DICT_FILE = "dataset_dict.json"  # ... and above the splits' directories for a DatasetDict
METADATA_FILES = (*SAVED_DATASET_FILES, SAVED_DATASET_DICT_FILE)  # LLaMA-Factory names its registry so too


class DataError(ConfigError):
    """A data problem the user fixes in the file: names file, row/line and field."""


def data_entries(path: str | list[str], key: str = "data.path") -> list[list[Path]]:
    """The files (and saved datasets) data.path (or `key`) names, per entry: a directory stands
    for the data files under it, in name order, or for the dataset `datasets.save_to_disk` wrote
    there. Each entry is one dataset, whose first rows data.max_samples keeps."""
    return [entry_files(Path(p), key) for p in ([path] if isinstance(path, str) else path)]


def entry_files(f: Path, key: str) -> list[Path]:
    if f.is_dir():
        return [f] if is_saved_dataset(f) else files_under(f, key)
    if not f.is_file():
        raise DataError(f"data file {f} does not exist{read_from(f)}; set {key} to local .jsonl/.json/.parquet "
                        f"files or a directory of them")
    if f.suffix not in SUFFIXES:
        raise DataError(f"data file {f}: unsupported suffix {f.suffix!r}; use .jsonl, .json or .parquet")
    return [f]


def is_saved_dataset(directory: Path) -> bool:
    return (all((directory / name).is_file() for name in SAVED_DATASET_FILES)
            or (directory / SAVED_DATASET_DICT_FILE).is_file())


def files_under(directory: Path, key: str = "data.path") -> list[Path]:
    found, _ = walk_data(directory)
    if not found:
        raise DataError(f"data directory {directory} holds no .jsonl, .json or .parquet files (nor a dataset "
                        f"saved with datasets' save_to_disk); point {key} at the data files")
    return found


def walk_data(directory: Path) -> tuple[list[Path], list[Path]]:
    """(read, left out) under a directory, in path order, hidden entries aside: data files, and
    saved datasets read whole (their metadata .json files are not rows, nor is LLaMA-Factory's
    dataset_info.json registry); left out, the files of other kinds and zerofit run directories
    whole (a run_dir inside data.path: its manifests and logs are .json and .jsonl, not rows)."""
    read, left_out = [], []
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith("."):
            continue
        if is_run_dir(entry):
            left_out.append(entry)
        elif entry.is_dir() and is_saved_dataset(entry):
            read.append(entry)
        elif entry.is_dir():
            deeper = walk_data(entry)
            read, left_out = read + deeper[0], left_out + deeper[1]
        elif entry.suffix in SUFFIXES and entry.name not in METADATA_FILES:
            read.append(entry)
        elif entry.is_file() and entry.name not in METADATA_FILES:
            left_out.append(entry)
    return read, left_out


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a zerofit run directory: every run holds its lock file there."""

    return (path / LOCK_FILE).is_file()


def shown_left_out(path: Path) -> str:
    """A left-out entry as the warning names it."""
    return f"{path}/ (a zerofit run directory)" if is_run_dir(path) else str(path)


def named_paths(*paths: str | list[str] | None) -> list[Path]:
    """The files and directories data.path / data.eval_path name (not the built-in sources)."""
    return [Path(p) for path in paths if path not in (None, "demo", "synthetic")
            for p in ([path] if isinstance(path, str) else path)]


def unread_splits(*paths: str | list[str] | None) -> list[str]:
    """Saved DatasetDicts among data.path / data.eval_path (or in their directories) with splits
    other than the `train` that saved_dataset reads, as "DIR (test, validation)"."""
    named = named_paths(*paths)
    found = [d for d in named if d.is_dir() and is_saved_dataset(d)]
    found += [f for d in named if d.is_dir() and not is_saved_dataset(d) for f in walk_data(d)[0] if f.is_dir()]
    unread = []
    for directory in found:
        if (directory / SAVED_DATASET_DICT_FILE).is_file():
            splits = json.loads((directory / SAVED_DATASET_DICT_FILE).read_text()).get("splits", [])
            if others := [split for split in splits if split != "train"]:
                unread.append(f"{directory} ({', '.join(others)})")
    return unread


def left_out_files(*paths: str | list[str] | None) -> list[Path]:
    """Files under the directories data.path / data.eval_path name that are not read (a .csv, a
    .txt): said, so that none goes missing from training unnoticed."""
    named = named_paths(*paths)
    return [f for d in named if d.is_dir() and not is_saved_dataset(d) for f in walk_data(d)[1]]


def read_rows(file: Path, skip_bad_lines: bool = False, limit: int | None = None) -> tuple:
    """One file as an HF Dataset (or its rows as written, `as_written`), and the jsonl line
    numbers of its rows when it was read line by line (else None). A line that is not a JSON
    object is reported with its number, or, with `skip_bad_lines` (data.skip_bad_rows), left
    out and listed as (where, why). With `limit` (data.max_samples), only the file's first
    `limit` rows, a bad line left out counting as one of them."""
    import datasets

    datasets.disable_progress_bars()
    if file.is_dir():
        return first_rows(saved_dataset(file), limit), None, []
    null_line = file.suffix != ".parquet" and check_text(file)
    # its "Failed to load JSON ... in row N" (rows counted its own way) would precede our line number
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
    try:
        rows, numbers, bad = datasets.load_dataset(SUFFIXES[file.suffix], data_files=str(file), split="train"), None, []
    except Exception as e:  # pyarrow's parse errors carry no line number: find it ourselves
        if holds_json_lines(file):  # line by line: a bad line, or a value of another type than its column's
            rows, numbers, bad = as_written(file, skip_bad_lines, limit)
        else:
            raise DataError(json_array_problem(file) or f"{file}: cannot be read as {SUFFIXES[file.suffix]} "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); fix the file") from None
    if not isinstance(rows, JsonRows) and file.suffix != ".parquet" and (null_line or decodes_json_text(rows.features)):
        rows, numbers, bad = as_written(file, skip_bad_lines, limit)
    if len(rows) == 0 and not bad:
        raise DataError(f"{file} holds no rows; add data or leave the file out of data.path")
    return first_rows(rows, limit), numbers, bad


def first_rows(rows, limit: int | None):
    """The first `limit` rows (all when None), as LLaMA-Factory's max_samples keeps them
    (src/llamafactory/data/loader.py, _load_single_dataset: `dataset.select(range(min(max_samples, len)))`)."""
    if limit is None or len(rows) <= limit:
        return rows
    return JsonRows(rows[:limit]) if isinstance(rows, JsonRows) else rows.select(range(limit))


def with_columns(rows, columns: dict[str, str | None], file: Path, fmt: str = "auto") -> tuple:
    """(`read_rows`' rows with the files' columns renamed to the fields they hold, the renames
    {column: field}, the columns left out): data.columns, dataconfig.column_fields under data.format
    `fmt`. A file holding none of the columns named keeps its own names (a directory may mix
    files); one holding a format's mapped column must hold that format's other required ones
    (dataconfig.FORMAT_FIELDS). A field held under both names is read from the column named for it;
    one mapped to None is not read: its column is dropped."""
    field_of, named = column_fields(fmt), {key: column for key, column in columns.items() if column is not None}
    # a null field's own column is dropped, unless another key reads that column ({prompt: input, query: null})
    unread = ({field_of[key] for key in columns.keys() - named.keys()} & set(rows.column_names)) - set(named.values())
    columns, present = named, set(rows.column_names) - unread
    renames = {column: field_of[key] for key, column in columns.items() if column in present}
    if not renames:
        return dropped_and_renamed(rows, unread, {}), renames, []
    format_of = {field: name for name, fields in FORMAT_FIELDS.items() for field in fields}
    in_play = {format_of[field] for field in renames.values() if field in format_of}
    missing = [f"{key}: {column}" for key, column in columns.items()
               if column not in present and format_of.get(field_of[key]) in in_play]
    if missing:
        raise DataError(f"{file} has no column {', '.join(missing)} (data.columns), though it has "
                        f"{', '.join(sorted(renames))}; its columns are {', '.join(sorted(present))}: fix "
                        f"data.columns, or the file")
    # the column data.columns names for a field is the one read, as in LLaMA-Factory: a column under
    # the field's own name is then left out (one renamed away itself leaves the name free)
    shadowed = sorted(field for column, field in renames.items()
                      if field in present and field not in renames and field != column)
    said = [f"{file}: its {field} column ({source} is read as {field}, data.columns)"
            for field in shadowed for source, read_as in renames.items() if read_as == field]
    return dropped_and_renamed(rows, unread | set(shadowed), renames), renames, said


def dropped_and_renamed(rows, dropped: set[str], renames: dict[str, str]):
    """`rows` without the columns `dropped`, the others renamed {column: field}: one pass."""
    if not dropped and not renames:
        return rows
    if isinstance(rows, JsonRows):
        return JsonRows([{renames.get(key, key): value for key, value in row.items() if key not in dropped}
                         for row in rows])
    rows = rows.remove_columns(sorted(dropped)) if dropped else rows
    return rows.rename_columns(renames) if renames else rows


def decodes_json_text(feature) -> bool:
    """Whether datasets holds some field as JSON text (datasets.Json): it does so for a field
    whose values differ in type between rows, and decodes every value on reading, so a
    string that is valid JSON comes back as something else ("8" as 8, "null" as None): one
    row with a number for `output` made every digit answer a bad row."""
    import datasets

    if isinstance(feature, datasets.Json):
        return True
    if isinstance(feature, dict):
        return any(decodes_json_text(inner) for inner in feature.values())
    inner = getattr(feature, "feature", None)  # List, Sequence, LargeList
    return inner is not None and decodes_json_text(inner)


def as_written(file: Path, skip_bad_lines: bool, limit: int | None = None) -> tuple:
    """A JSON file's rows with the types each row was written with (`read_rows`' layout); JSON
    lines past the first `limit` rows are not read."""
    if holds_json_lines(file):
        rows, numbers, bad = _json_lines(file, skip_bad_lines, limit)
        return JsonRows(rows), numbers, bad
    with file.open(encoding="utf-8-sig") as text:
        return JsonRows(json.load(text)), None, []  # an array of objects: datasets has read it so already


def saved_dataset(directory: Path):
    """What datasets.save_to_disk wrote: one Dataset, or a DatasetDict's "train" split."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(directory))
    except Exception as e:  # noqa: BLE001 - datasets raises several kinds for a damaged directory
        raise DataError(f"{directory}: cannot be read as a saved dataset ({type(e).__name__}: {e}); save it again "
                        f"with save_to_disk, or export it to .jsonl") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{directory} holds the splits {sorted(loaded)} and no `train`; point data.path at "
                            f"{directory}/<split> (data.eval_path at another)")
        loaded = loaded["train"]
    return loaded


def check_text(file: Path) -> bool:
    """A json/jsonl file must be UTF-8 and hold something: pyarrow raises a bare
    UnicodeDecodeError mid-iteration, and an empty file reads as `columns []`. Whether a line
    is only `null`, which pyarrow reads as a row of empty fields (said as a missing field)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, blank, null_line = 1, True, False
    with file.open("rb") as chunks:
        while chunk := chunks.read(1 << 24):
            if line == 1 and chunk.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                raise DataError(f"{file} is UTF-16 text (it opens with UTF-16's byte-order mark); save it as "
                                f"UTF-8, e.g. `iconv -f utf-16 -t utf-8`")
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:  # e.start counts from this chunk (a cut character's first bytes aside)
                line += chunk[:e.start].count(b"\n")
                raise DataError(f"{file}, line {line}: not UTF-8 text (byte 0x{chunk[e.start]:02x}); save the file "
                                f"as UTF-8, e.g. `iconv -f latin1 -t utf-8` where it was written as latin1") from None
            line += chunk.count(b"\n")
            blank = blank and not chunk.strip()
            null_line = null_line or NULL_LINE.search(chunk) is not None
    if blank:
        raise DataError(f"{file} is empty; add data or leave the file out of data.path")
    return null_line


NULL_LINE = re.compile(rb"(?m)^[ \t]*null[ \t]*\r?$")


def json_array_problem(file: Path) -> str | None:
    """Where a JSON file that datasets could not load goes wrong: its JSON error's line and
    column, an empty list, or a row that is not an object; None when none is found (the
    loader's own message is kept). The file is one array of rows or objects one after another
    (pretty-printed JSON lines)."""
    text = file.read_text(encoding="utf-8-sig")
    decoder, values, at, space = json.JSONDecoder(), [], 0, re.compile(r"\s*")
    try:
        while (at := space.match(text, at).end()) < len(text):
            value, at = decoder.raw_decode(text, at)
            values.append(value)
    except json.JSONDecodeError as e:
        return (f"{file}, line {e.lineno}, column {e.colno}: not valid JSON ({e.msg}); fix the file (a .json "
                f"file is one JSON array of rows; one row per line is .jsonl)")
    rows = values[0] if len(values) == 1 and isinstance(values[0], list) else values
    if not rows:
        return f"{file} holds no rows (an empty list); add data or leave the file out of data.path"
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            return (f"{file}, row {number}: a row must be a JSON object, got {kind_of(row)}; fix or delete "
                    f"the row")
    return None


def kind_of(row) -> str:
    """A JSON value's kind as the messages name them: `null` a line of its own, else the type read."""
    return "null" if row is None else type(row).__name__


class JsonRows(list):
    """A jsonl file's rows parsed line by line, where pyarrow could not read it whole (types
    are checked row by row, as tokenize_row reads them): what read_examples needs of a Dataset."""

    @property
    def column_names(self) -> list[str]:
        return list(dict.fromkeys(key for row in self for key in row))


def _json_lines(file: Path, skip_bad_lines: bool, limit: int | None = None) -> tuple[list[dict], list[int], list[str]]:
    """The rows of a jsonl file whose parse failed, their line numbers, and the bad lines: the
    first `limit` of the two together (a bad line past them is never seen)."""
    rows, numbers, bad = [], [], []
    with file.open(encoding="utf-8-sig") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if limit is not None and len(rows) + len(bad) == limit:
                break
            try:
                row = json.loads(line.rstrip("\r\n"))  # else a cut line is "wrong" past its end
                why = None if isinstance(row, dict) else f"a row must be a JSON object, got {kind_of(row)}"
            except json.JSONDecodeError as e:
                why = f"not valid JSON ({e.msg}, column {e.colno})"
            if why is None:
                rows.append(row)
                numbers.append(number)
            elif skip_bad_lines:
                bad.append(f"{file}, line {number}: {why}")
            else:
                raise DataError(f"{file}, line {number}: {why}; fix or delete the line, or set "
                                f"data.skip_bad_rows=true to skip such lines")
    return rows, numbers, bad


def holds_json_lines(file: Path) -> bool:
    """JSON lines: a .jsonl file, or a .json one whose text opens with an object, not an array
    (LLaMA-Factory's datasets often name JSON lines .json, and datasets reads either). Not one
    whose first line opens an array or only a brace: pretty-printed JSON spans lines, which
    datasets reads too, but a line number would not name a row there."""
    if file.suffix not in (".jsonl", ".json"):
        return False
    with file.open(encoding="utf-8-sig") as text:
        first = next((line for line in text if line.strip()), "").strip()
    return first.startswith("{") and first != "{"


def line_of_row(file: Path, row_index: int) -> str:
    """Human position of a row: its line number in JSON lines (blank lines skipped), else the row."""
    if not holds_json_lines(file):
        return f"row {row_index + 1}"
    seen = -1
    with file.open(encoding="utf-8-sig") as lines:
        for number, line in enumerate(lines, 1):
            seen += bool(line.strip())
            if seen == row_index:
                return f"line {number}"
    return f"row {row_index + 1}"
