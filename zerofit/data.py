"""Local files -> tokenized, loss-masked, packed (or padded) sequences -> per-rank batches.

Rows come through HF `datasets` (json/jsonl/parquet). Prompt tokens get label -100 so
only responses are learned. The batch order is a pure function of (seed, position): a
resumed run continues the very same stream, on any number of ranks.
"""
from __future__ import annotations

import bisect
import itertools
import codecs
import contextlib
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
from jinja2.exceptions import TemplateError

from zerofit import toolcalls
from zerofit.config import ConfigError, DataConfig

IGNORE = -100  # the label value HF causal-LM losses skip
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
CHAT_FORMATS = {"messages", "sharegpt"}  # the row formats read as conversations of chat messages
SAVED_DATASET_FILES = ("dataset_info.json", "state.json")  # what datasets' save_to_disk writes beside the arrow files
SAVED_DATASET_DICT_FILE = "dataset_dict.json"  # ... and above the splits' directories for a DatasetDict
METADATA_FILES = (*SAVED_DATASET_FILES, SAVED_DATASET_DICT_FILE)  # LLaMA-Factory names its registry so too
# The layouts tokenize_row trains on, as chat templates: written into the run's tokenizer (and so
# into every export) so that `zerofit chat`, transformers and vLLM prompt the model as it was
# trained. Alpaca: the system text and a blank line first, each user turn an instruction, each
# answer its response and EOS; no template: `role:\n` heads, EOS after each turn.
ALPACA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n\n"
    "### Response:\n{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:\n{% endif %}")


class DataError(ConfigError):
    """A data problem the user fixes in the file: names file, row/line and field."""


@dataclass
class Sequences:
    """Fixed-length training rows: token ids and labels, both [n, seq_len] int arrays."""
    input_ids: np.ndarray
    labels: np.ndarray
    skipped_rows: int = 0
    skipped_reasons: list[str] = field(default_factory=list)
    prompt_only_rows: int = 0     # rows of seq_len tokens without one answer token: nothing to learn
    longest_example: int = 0      # tokens of the longest example, for the advice on seq_len
    formats: tuple[str, ...] = ()  # the row formats read (text | alpaca | messages), for the chat template
    lengths: np.ndarray | None = None  # per row, the tokens before its padding (None: concatenated, all seq_len)
    positions: np.ndarray | None = None  # data.neat_packing: per token, its place in its example within the row
    cut: tuple[int, int, int] = (0, 0, 0)  # `truncated`'s (examples cut to seq_len, answer, prompt tokens lost)
    layout: str = "concatenated"  # packing_layout (padded | whole | concatenated), or synthetic
    truncation: str = "balanced"  # data.truncation, which made `cut`

    @property
    def packed(self) -> bool:
        """data.packing: what a prompt-only row is, and the advice about it."""
        return self.layout != "padded"

    def cut_note(self, seq_len: int) -> str:
        """What cutting examples to seq_len cost; "" when none was longer."""
        examples, answer_lost, prompt_lost = self.cut
        if not examples:
            return ""
        return (f"{examples} examples longer than train.seq_len {seq_len} were cut to it (data.truncation "
                f"{self.truncation}), losing {answer_lost} answer tokens and {prompt_lost} prompt tokens (the longest "
                f"example has {self.longest_example} tokens): raise train.seq_len to learn them whole")

    def dropped_note(self, seq_len: int) -> str:
        """Why `prompt_only_rows` rows were dropped and what would keep them; "" when none were."""
        if not self.prompt_only_rows:
            return ""
        rows = f"packed rows of {seq_len} tokens holding no answer token" if self.packed else \
            f"rows whose answer starts beyond train.seq_len {seq_len}"
        keep = "raise train.seq_len, or set data.truncation: balanced (a long prompt is cut, its answer kept)" \
            if self.truncation == "head" else "raise train.seq_len"
        return (f"dropped {self.prompt_only_rows} {rows} (the longest example has {self.longest_example} tokens): "
                f"{keep} to learn from them")

    def layout_note(self) -> str:
        """How the examples fill the rows, for the data line: `packed whole (3.1% padding)`."""
        if self.lengths is None or not len(self):
            return {"concatenated": "examples concatenated into rows",
                    "synthetic": "random tokens, every one learned"}.get(self.layout, "")
        padding = 1 - self.lengths.sum() / self.input_ids.size
        return f"{'examples packed whole' if self.layout == 'whole' else 'one example per row'} ({padding:.1%} padding)"

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def trained_tokens(self) -> int:
        """The labels the loss counts (`targets`: a row's first label is never predicted)."""
        return targets(self.labels)


# ------------------------------------------------------------------------ reading
def data_files(path: str | list[str], key: str = "data.path") -> list[Path]:
    """The files (and saved datasets) data.path (or `key`) names: a directory stands for the data
    files under it, in name order, or for the dataset `datasets.save_to_disk` wrote there."""
    files = []
    for f in [Path(p) for p in ([path] if isinstance(path, str) else path)]:
        if f.is_dir():
            files += [f] if is_saved_dataset(f) else files_under(f, key)
        elif not f.is_file():
            relative = "" if f.is_absolute() else f" (a relative path is read from the working directory, {Path.cwd()})"
            raise DataError(f"data file {f} does not exist{relative}; set {key} to local .jsonl/.json/.parquet "
                            f"files or a directory of them")
        elif f.suffix not in SUFFIXES:
            raise DataError(f"data file {f}: unsupported suffix {f.suffix!r}; use .jsonl, .json or .parquet")
        else:
            files.append(f)
    return files


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
    dataset_info.json registry); left out, the files of other kinds."""
    read, left_out = [], []
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir() and is_saved_dataset(entry):
            read.append(entry)
        elif entry.is_dir():
            deeper = walk_data(entry)
            read, left_out = read + deeper[0], left_out + deeper[1]
        elif entry.suffix in SUFFIXES and entry.name not in METADATA_FILES:
            read.append(entry)
        elif entry.is_file() and entry.name not in METADATA_FILES:
            left_out.append(entry)
    return read, left_out


def left_out_files(*paths: str | list[str] | None) -> list[Path]:
    """Files under the directories data.path / data.eval_path name that are not read (a .csv, a
    .txt): said, so that none goes missing from training unnoticed."""
    named = [Path(p) for path in paths if path not in (None, "demo", "synthetic")
             for p in ([path] if isinstance(path, str) else path)]
    return [f for d in named if d.is_dir() and not is_saved_dataset(d) for f in walk_data(d)[1]]


def read_rows(file: Path, skip_bad_lines: bool = False) -> tuple:
    """One file as an HF Dataset (or its rows as written, `as_written`), and the jsonl line
    numbers of its rows when it was read line by line (else None). A line that is not a JSON
    object is reported with its number, or, with `skip_bad_lines` (data.skip_bad_rows), left
    out and listed as (where, why)."""
    import datasets

    datasets.disable_progress_bars()
    if file.is_dir():
        return saved_dataset(file), None, []
    if file.suffix != ".parquet":
        check_text(file)
    # its "Failed to load JSON ... in row N" (rows counted its own way) would precede our line number
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
    try:
        rows, numbers, bad = datasets.load_dataset(SUFFIXES[file.suffix], data_files=str(file), split="train"), None, []
    except Exception as e:  # pyarrow's parse errors carry no line number: find it ourselves
        if holds_json_lines(file):  # line by line: a bad line, or a value of another type than its column's
            rows, numbers, bad = as_written(file, skip_bad_lines)
        else:
            raise DataError(json_array_problem(file) or f"{file}: cannot be read as {SUFFIXES[file.suffix]} "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); fix the file") from None
    if not isinstance(rows, JsonRows) and file.suffix != ".parquet" and decodes_json_text(rows.features):
        rows, numbers, bad = as_written(file, skip_bad_lines)
    if len(rows) == 0 and not bad:
        raise DataError(f"{file} holds no rows; add data or leave the file out of data.path")
    return rows, numbers, bad


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


def as_written(file: Path, skip_bad_lines: bool) -> tuple:
    """A JSON file's rows with the types each row was written with (`read_rows`' layout)."""
    if holds_json_lines(file):
        rows, numbers, bad = _json_lines(file, skip_bad_lines)
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


def check_text(file: Path) -> None:
    """A json/jsonl file must be UTF-8 and hold something: pyarrow raises a bare
    UnicodeDecodeError mid-iteration, and an empty file reads as `columns []`."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, blank = 1, True
    with file.open("rb") as chunks:
        while chunk := chunks.read(1 << 24):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:  # e.start counts from this chunk (a cut character's first bytes aside)
                line += chunk[:e.start].count(b"\n")
                raise DataError(f"{file}, line {line}: not UTF-8 text (byte 0x{chunk[e.start]:02x}); save the file "
                                f"as UTF-8, e.g. `iconv -f latin1 -t utf-8`") from None
            line += chunk.count(b"\n")
            blank = blank and not chunk.strip()
    if blank:
        raise DataError(f"{file} is empty; add data or leave the file out of data.path")


def json_array_problem(file: Path) -> str | None:
    """Where a .json file that datasets could not load goes wrong: its JSON error's line and
    column, or an empty list; None when it parses (the loader's own message is kept)."""
    try:
        value = json.loads(file.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        return (f"{file}, line {e.lineno}, column {e.colno}: not valid JSON ({e.msg}); fix the file (a .json "
                f"file is one JSON array of rows; one row per line is .jsonl)")
    if value == []:
        return f"{file} holds no rows (an empty list); add data or leave the file out of data.path"
    return None


class JsonRows(list):
    """A jsonl file's rows parsed line by line, where pyarrow could not read it whole (types
    are checked row by row, as tokenize_row reads them): what read_examples needs of a Dataset."""

    @property
    def column_names(self) -> list[str]:
        return list(dict.fromkeys(key for row in self for key in row))


def _json_lines(file: Path, skip_bad_lines: bool) -> tuple[list[dict], list[int], list[str]]:
    """The rows of a jsonl file whose parse failed, their line numbers, and the bad lines."""
    rows, numbers, bad = [], [], []
    with file.open(encoding="utf-8-sig") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # else a cut line is "wrong" past its end
                why = None if isinstance(row, dict) else f"a row must be a JSON object, got {type(row).__name__}"
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
    (LLaMA-Factory's datasets often name JSON lines .json, and datasets reads either)."""
    if file.suffix == ".jsonl":
        return True
    if file.suffix != ".json":
        return False
    with file.open(encoding="utf-8-sig") as text:
        while (char := text.read(1)).isspace():
            pass
    return char == "{"


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


def row_format(row: dict) -> str | None:
    """A row's format by the fields it fills (a Dataset gives every row every column of its
    file, None where the row lacks it), None when they fit no format."""
    fields = {key for key, value in row.items() if value is not None}
    if "messages" in fields:
        return "messages"
    if "conversations" in fields:
        return "sharegpt"
    if "instruction" in fields and "output" in fields:
        return "alpaca"
    if "text" in fields:
        return "text"
    return None


def row_formats(rows, file: Path) -> tuple[list[str | None], str]:
    """Each row's format, and the file's most common one: rows of several formats may share a
    file; a row that fits none is read as the file's format, so its error names the field it lacks."""
    found = [row_format(row) for row in rows]
    counts = Counter(fmt for fmt in found if fmt)
    if not counts:
        raise DataError(f"{file}: cannot tell the format from its fields {rows.column_names}; "
                        f"expected `text`, `instruction`+`output` (alpaca), `messages`, or `conversations` "
                        f"(sharegpt), or set data.format")
    return found, counts.most_common(1)[0][0]


# --------------------------------------------------------------------- tokenizing
class RowError(ValueError):
    def __init__(self, field_name: str | None, problem: str):
        super().__init__(f"field `{field_name}`: {problem}" if field_name else problem)
        self.field_name, self.problem = field_name, problem


def _text(row: dict, key: str, required: bool = True) -> str:
    value = row.get(key)
    if value is None:
        if required:
            raise RowError(key, "missing")
        return ""
    if not isinstance(value, str):
        raise RowError(key, f"expected a string, got {type(value).__name__}")
    return value


def text_ids(tokenizer, text: str) -> list[int]:
    """BOS (when the tokenizer has one), then the text: how every training example begins,
    whatever the tokenizer's own add_bos setting (`zerofit generate` prompts the same way)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode(text, add_special_tokens=False)


def chat_formats(tokenizer, alpaca_template: str = "chat") -> set[str]:
    """The row formats rendered as chat messages (by the tokenizer's chat template, or as
    `role:` lines where it has none): messages and sharegpt always; alpaca rows too under
    data.alpaca_template `chat` when the tokenizer has a template (as LLaMA-Factory renders
    them through its `template`), else in the alpaca layout."""
    return CHAT_FORMATS | ({"alpaca"} if alpaca_template == "chat" and tokenizer.chat_template else set())


def tokenize_row(row: dict, fmt: str, tokenizer, alpaca_template: str = "chat") -> tuple[list[int], list[int]]:
    """(input_ids, labels) for one row: the prompt is masked, the response and EOS learned."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if fmt == "text":
        ids = text_ids(tokenizer, _text(row, "text")) + eos
        return ids, list(ids)
    if fmt == "alpaca" and fmt not in chat_formats(tokenizer, alpaca_template):
        return _tokenize_alpaca(row, tokenizer, bos, eos)
    if fmt == "alpaca":
        with conversation_named(ALPACA_AS_CHAT):
            return _tokenize_messages(alpaca_messages(row), tokenizer, bos, eos, None)
    if fmt in CHAT_FORMATS:
        try:
            messages, tools = (_messages(row) if fmt == "messages" else sharegpt_messages(row)), toolcalls.tools_of(row)
        except toolcalls.ToolCallError as e:
            raise RowError(e.field_name, e.problem) from None
        with conversation_named("messages" if fmt == "messages" else "conversations"):
            return _tokenize_messages(messages, tokenizer, bos, eos, tools)
    raise ValueError(f"unknown format {fmt}")


ALPACA_AS_CHAT = "instruction/output as a conversation (data.alpaca_template: chat; `alpaca` renders the alpaca layout)"


@contextlib.contextmanager
def conversation_named(field_name: str):
    """A problem with the whole conversation (_tokenize_messages says `messages`) named under the
    row's own field: `conversations` for ShareGPT rows, the alpaca fields for an alpaca row the chat
    template renders."""
    try:
        yield
    except RowError as e:
        if e.field_name != "messages" or field_name == "messages":
            raise
        raise RowError(field_name, e.problem) from None


def alpaca_messages(row: dict) -> list[dict]:
    """An alpaca row as a conversation, as LLaMA-Factory's alpaca converter makes it: the system
    text, each `history` pair a user and an assistant turn, then the instruction and its input
    (on a line of its own) as the user's turn and the output as the answer."""
    instruction, extra = _text(row, "instruction"), _text(row, "input", required=False)
    system = _text(row, "system", required=False)
    turns = [*_history(row), ("\n".join(part for part in (instruction, extra) if part), _text(row, "output"))]
    return [{"role": "system", "content": system}] * bool(system) + \
        [{"role": role, "content": text} for pair in turns for role, text in zip(("user", "assistant"), pair)]


def _tokenize_alpaca(row: dict, tokenizer, bos: list[int], eos: list[int]) -> tuple[list[int], list[int]]:
    """LLaMA-Factory's alpaca row: the system text opens the prompt, each `history` pair is an
    earlier instruction and response (learned, as every assistant turn of a conversation is),
    then the row's own instruction (with its input) and output."""
    instruction, extra = _text(row, "instruction"), _text(row, "input", required=False)
    turns = [(ALPACA_PROMPT.format(instruction=q), a) for q, a in _history(row)]
    turns.append(((ALPACA_PROMPT_WITH_INPUT if extra else ALPACA_PROMPT).format(instruction=instruction, input=extra),
                  _text(row, "output")))
    system = _text(row, "system", required=False)
    ids, labels = list(bos), [IGNORE] * len(bos)
    for n, (prompt_text, answer_text) in enumerate(turns):
        prompt = tokenizer.encode((f"{system}\n\n" if system and n == 0 else "") + prompt_text,
                                  add_special_tokens=False)
        answer = tokenizer.encode(answer_text, add_special_tokens=False) + eos
        ids += prompt + answer
        labels += [IGNORE] * len(prompt) + answer
    return ids, labels


def _history(row: dict) -> list[tuple[str, str]]:
    history = row.get("history") or []
    if not isinstance(history, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair) for pair in history):
        raise RowError("history", "expected a list of [instruction, response] pairs of strings")
    return [tuple(pair) for pair in history]


# ShareGPT's speaker names (LLaMA-Factory's defaults) and the chat roles they are: a function
# call is the assistant's output (learned; its value the call's JSON, read as tool_calls); an
# observation is a tool's answer (masked).
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}
ROLES = ("system", "user", "assistant", "tool")  # what chat templates render; any other role they skip unseen


def _messages(row: dict) -> list[dict]:
    return _turns(row, "messages", "role", "content", tool_calls=True)


def sharegpt_messages(row: dict) -> list[dict]:
    """A ShareGPT row ({conversations: [{from, value}], system?}) as chat messages."""
    system = _text(row, "system", required=False)
    return [{"role": "system", "content": system}] * bool(system) + _turns(row, "conversations", "from", "value")


def _turns(row: dict, field_name: str, role: str, content: str, tool_calls: bool = False) -> list[dict]:
    """row[field_name], a non-empty list of {role: str, content: str} under the format's own key
    names, as chat messages with ShareGPT's speaker names read as roles. With `tool_calls`
    (OpenAI's messages), an assistant's `tool_calls` (its content may then be null) and a tool
    turn's `tool_call_id` / `name` are kept for the chat template (toolcalls). A `function_call`
    turn's value is the call's JSON, read as the assistant's tool_calls in either format."""
    turns = row.get(field_name)
    if not isinstance(turns, list) or not turns:
        raise RowError(field_name, f"expected a non-empty list of {{{role}, {content}}}")
    messages = []
    for i, turn in enumerate(turns):
        speaker, said = turn_keys(turn, (role, content))
        where, shape = f"{field_name}[{i}]", f"expected {{{speaker}: str, {said}: str}}"
        if not isinstance(turn, dict) or not isinstance(turn.get(speaker), str):
            raise RowError(where, shape)
        if ROLE_ALIASES.get(turn[speaker], turn[speaker]) not in ROLES:
            raise RowError(f"{where}.{speaker}", f"unknown speaker {turn[speaker]!r}: a chat template would leave the "
                                                 f"turn out; use {', '.join(ROLES)} (or ShareGPT's "
                                                 f"{', '.join(ROLE_ALIASES)})")
        calls = toolcalls.calls_of(turn, where) if tool_calls else []
        text = "" if turn.get(said) is None and calls else text_of(turn.get(said), f"{where}.{said}")
        if not isinstance(text, str):
            raise RowError(where, shape + (f" ({said} may be null beside tool_calls)" if tool_calls else ""))
        if turn[speaker] == "function_call":
            text, calls = "", calls + toolcalls.calls_written(text, f"{where}.{said}")
        message = {"role": ROLE_ALIASES.get(turn[speaker], turn[speaker]), "content": text}
        message.update({"tool_calls": calls} if calls else {})
        if tool_calls:
            message.update({key: turn[key] for key in ("tool_call_id", "name") if isinstance(turn.get(key), str)})
        messages.append(message)
    return messages


# A turn's speaker and text under either naming: OpenAI's and ShareGPT's. Published datasets mix
# them (`conversations` of {role, content}, `messages` of {from, value}); LLaMA-Factory maps them
# with dataset_info.json's role_tag / content_tag, which zerofit reads off the turn instead.
TURN_KEYS = (("role", "content"), ("from", "value"))


def turn_keys(turn, own: tuple[str, str]) -> tuple[str, str]:
    """The (speaker, text) keys `turn` uses: its format's own, else the other naming's when it
    holds that speaker key and not its own."""
    if isinstance(turn, dict) and own[0] not in turn:
        return next((keys for keys in TURN_KEYS if keys[0] in turn), own)
    return own


def text_of(content, where: str):
    """A turn's content; OpenAI's list of parts ([{type: text, text}]) joined into its text."""
    if not isinstance(content, list):
        return content
    kinds = {part.get("type") if isinstance(part, dict) else type(part).__name__ for part in content}
    if kinds - {"text"}:
        raise RowError(where, f"only text parts ({{type: text, text: str}}) can be trained on, not "
                              f"{', '.join(sorted(map(str, kinds - {'text'})))}")
    if not all(isinstance(part.get("text"), str) for part in content):
        raise RowError(where, "a text part is {type: text, text: str}")
    return "".join(part["text"] for part in content)


def _tokenize_messages(messages: list[dict], tokenizer, bos: list[int], eos: list[int],
                       tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    if not any(m["role"] == "assistant" for m in messages):
        roles = sorted({m["role"] for m in messages})
        raise RowError("messages", f"no assistant turn to learn from (roles: {', '.join(roles)}; the answers' role "
                                   f"is `assistant`, or `gpt` in ShareGPT's naming)")
    if tokenizer.chat_template:
        if messages[0]["role"] == "assistant":  # nothing prompts it, and templates add their default system prompt
            raise RowError("messages", "the conversation opens with an assistant turn; start it with a user (or "
                                       "system) turn, or drop the opening assistant turn")
        try:
            ids, labels = _chat_template_spans(messages, tokenizer, tools)
        except RowError:
            raise
        except (TemplateError, ValueError) as e:  # the template's raise_exception: Gemma's "System role not supported"
            raise RowError("messages", f"the tokenizer's chat template refused it: {e}") from None
        check_tools_rendered(messages, tools, ids, labels, tokenizer)
        return ids, labels
    # No template: a plain "role: content" layout, assistant turns learned (tool calls as JSON lines).
    ids, labels = list(bos), [IGNORE] * len(bos)
    if tools:
        offered = tokenizer.encode(f"tools:\n{json.dumps(tools, ensure_ascii=False)}", add_special_tokens=False) + eos
        ids, labels = ids + offered, labels + [IGNORE] * len(offered)
    for m in messages:
        head = tokenizer.encode(f"{m['role']}:\n", add_special_tokens=False)
        text = "\n".join(filter(None, [m["content"], toolcalls.plain_call_text(m.get("tool_calls", []))]))
        body = tokenizer.encode(text, add_special_tokens=False) + eos
        learn = m["role"] == "assistant"
        ids += head + body
        labels += [IGNORE] * len(head) + (body if learn else [IGNORE] * len(body))
    return ids, labels


def _chat_template_spans(messages: list[dict], tokenizer, tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Render the conversation up to each assistant turn (with its generation prompt) and through
    it; each assistant turn's new tokens are learned, everything else masked. Only an assistant
    turn's edges are rendered: a template may close a turn differently when another of the same
    role follows (Qwen2.5 joins consecutive tool answers into one user turn), so a prefix that
    ends between two such turns is not the start of the whole."""
    def render(upto: int, generation_prompt: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=True, return_dict=False,
                                                  add_generation_prompt=generation_prompt))
    def extended(rendered: list[int], ids: list[int], turns: int) -> list[int]:
        if rendered[:len(ids)] != ids:
            raise RowError("messages", f"the tokenizer's chat template renders the first {turns} turn(s) differently "
                                       f"from the start of the whole conversation (it rewrites earlier turns when "
                                       f"one is added, as Mistral's does with a system prompt), so the answer's "
                                       f"tokens cannot be told apart; use a template that only appends (model."
                                       f"tokenizer: a directory with its own chat_template.jinja), or drop the "
                                       f"system turn")
        return rendered

    ids, labels = [], []
    for i in [i for i, m in enumerate(messages) if m["role"] == "assistant"]:
        prompt = extended(render(i, True), ids, i)
        labels += [IGNORE] * (len(prompt) - len(ids))
        answered = extended(render(i + 1, False), prompt, i + 1)
        labels += answered[len(prompt):]
        ids = answered
    whole = extended(render(len(messages), False), ids, len(messages))  # turns after the last answer: prompt
    return whole, labels + [IGNORE] * (len(whole) - len(ids))


def check_tools_rendered(messages: list[dict], tools: list[dict] | None, ids: list[int], labels: list[int],
                         tokenizer) -> None:
    """A chat template without function calling drops `tool_calls` and `tools` without a word:
    the assistant turn would train as empty and the prompt would offer no tools. Each called
    function's name must be in the learned tokens, each offered one's in the conversation."""
    called = [c["function"]["name"] for m in messages for c in m.get("tool_calls", ())]
    offered = toolcalls.names_offered(tools)
    if not called and not offered:
        return
    learned = tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE])
    text = tokenizer.decode(ids)
    missing = [f"call {name}" for name in called if name not in learned] + \
        [f"tool {name}" for name in offered if name not in text]
    if missing:
        raise RowError("tool_calls" if called else "tools",
                       f"the tokenizer's chat template does not render function calling ({', '.join(missing[:3])} "
                       f"is not in what it made of the row); use the model's tool-calling template (model.tokenizer: "
                       f"a directory whose chat_template.jinja renders tool_calls and tools), or write the calls "
                       f"as the assistant's text")


def trained_chat_template(formats: tuple[str, ...], tokenizer, alpaca_template: str = "chat") -> str | None:
    """The chat template that prompts the model as `formats` rows trained it; None when the
    tokenizer's own template is that (rows rendered with it) or there is no prompt layout
    (text rows, or layouts mixed)."""
    if formats and set(formats) <= chat_formats(tokenizer, alpaca_template):
        return None if tokenizer.chat_template else PLAIN_CHAT_TEMPLATE
    if formats == ("alpaca",):
        return ALPACA_CHAT_TEMPLATE
    return None


def layouts(formats: tuple[str, ...], tokenizer, alpaca_template: str = "chat") -> str:
    """How the rows read were laid out, for the data line ("" for text rows alone)."""
    chat = [fmt for fmt in formats if fmt in chat_formats(tokenizer, alpaca_template)]
    how = "by the tokenizer's chat template" if tokenizer.chat_template else \
        "as `role:` lines (the tokenizer has no chat template)"
    said = [f"{'/'.join(chat)} rows {how}"] * bool(chat)
    return "; ".join(said + ["alpaca rows in the alpaca layout"] * ("alpaca" in formats and "alpaca" not in chat))


def stop_problem(tokenizer, formats: tuple[str, ...], generation_eos: set[int] = frozenset(),
                 alpaca_template: str = "chat") -> str | None:
    """Why a model trained on these rows would not stop generating, or None: the tokenizer has
    no EOS (answers are trained without an end, packed examples run into each other), or its
    chat template ends an assistant turn with a token that neither is EOS nor is one of the
    generation config's end tokens (`generation_eos`), so generation runs past the turn."""
    if tokenizer.eos_token_id is None:
        return ("the tokenizer has no EOS token: answers are trained without an end, so the model does not learn to "
                "stop, and packed examples run into each other; give it one (eos_token in tokenizer_config.json)")
    if not formats or not set(formats) <= chat_formats(tokenizer, alpaca_template) or not tokenizer.chat_template:
        return None  # the alpaca and `role:` layouts end every answer with EOS themselves
    try:
        ids, labels = _chat_template_spans([{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "Hello"}], tokenizer)
    except (RowError, TemplateError, ValueError):
        return None  # a template that refuses a plain exchange: its rows said so already
    learned = [t for t, label in zip(ids, labels) if label != IGNORE]
    if {tokenizer.eos_token_id, *generation_eos} & set(learned):
        return None
    return (f"the tokenizer's chat template ends an assistant turn with {tokenizer.decode(learned[-3:])!r}, never "
            f"with the EOS token {tokenizer.eos_token!r}: a model trained on it stops only where generation lists "
            f"its turn's end token; add that token's id to eos_token_id in the model's generation_config.json, or "
            f"set the tokenizer's eos_token to it")


# ------------------------------------------------------------------ packing/padding
def pack(examples: list[tuple[list[int], list[int]]], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate examples into seq_len rows; the tail that does not fill a row is dropped."""
    ids = np.fromiter((t for e in examples for t in e[0]), dtype=np.int64)
    labels = np.fromiter((t for e in examples for t in e[1]), dtype=np.int64)
    rows = len(ids) // seq_len
    return ids[: rows * seq_len].reshape(rows, seq_len), labels[: rows * seq_len].reshape(rows, seq_len)


def rows_of_whole_examples(examples: list[tuple[list[int], list[int]]], seq_len: int,
                           pad_id: int) -> tuple[list[tuple[list[int], list[int]]], np.ndarray]:
    """Packing of prompted examples (LLaMA-Factory's greedy knapsack for its sft stage, with
    neat_packing or without): whole examples, longest first, each into the fullest row it still
    fits (best fit), every row closed by padding; `pack` then cuts at the row ends. An example
    is never split (a tail in the next row would be learned without its prompt); none is longer
    than seq_len (`truncated` cut them). The order is the examples' own for equal
    lengths: the same data makes the same rows, laid out in the order of each row's first
    example in the data. Returns the examples as laid out (each row's padding one more) and
    each row's tokens before its padding."""
    rows: list[list[int]] = []           # example indices per row
    rows_with: dict[int, list[int]] = {}  # room left -> the rows with that much (a stack)
    rooms: list[int] = []                # the room values some row has, sorted: at most seq_len of them
    for index in sorted(range(len(examples)), key=lambda i: -len(examples[i][0])):
        length = len(examples[index][0])
        at = bisect.bisect_left(rooms, length)  # the least room that takes it: the fullest row it fits
        if at == len(rooms):
            room, row = seq_len, len(rows)
            rows.append([])
        else:
            room = rooms[at]
            row = rows_with[room].pop()
            if not rows_with[room]:
                del rooms[at]
        rows[row].append(index)
        if room > length:
            if not rows_with.setdefault(room - length, []):
                bisect.insort(rooms, room - length)
            rows_with[room - length].append(row)
    out, used = [], []
    for row in sorted(rows, key=min):  # in data order: an eval cap takes the data's first examples, not its longest
        members = [examples[i] for i in row]
        out += members + [tail_padding(members, seq_len, pad_id)]
        used.append(sum(len(e_ids) for e_ids, _ in members))
    return out, np.array(used, dtype=np.int64)


def tail_padding(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> tuple[list[int], list[int]]:
    """The padding that fills the examples' last packed row (nothing learned in it): packed
    after them, it is one more example to isolate_examples, so no token attends to it."""
    missing = -sum(len(e_ids) for e_ids, _ in examples) % seq_len
    return [pad_id] * missing, [IGNORE] * missing


def isolate_examples(examples: list[tuple[list[int], list[int]]], labels: np.ndarray) -> np.ndarray:
    """data.neat_packing over `pack`'s rows: per token its position in its example, restarting
    at every example and at every row (rows_of_whole_examples lays them out so that none
    crosses a row end; were one to, its tail would start again, and positions never pass
    seq_len: learned position tables hold no more). transformers reads a fall in the position
    ids as a new sequence and masks attention across it (masking_utils.find_packed_sequence_indices,
    when use_cache is off, as engine.build_model sets). `labels` loses each example's first label in place: token t
    predicts t + 1, and an example's first token is not predicted from the one before it."""
    rows, seq_len = labels.shape
    lengths = np.array([len(e_ids) for e_ids, _ in examples], dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    flat = np.arange(rows * seq_len)
    in_example = flat - np.repeat(starts, lengths)[: rows * seq_len]
    labels.flat[starts[starts < rows * seq_len]] = IGNORE
    return np.minimum(in_example, flat % seq_len).reshape(rows, seq_len)


def truncated(examples: list[tuple[list[int], list[int]]], seq_len: int,
              how: str) -> tuple[list[tuple[list[int], list[int]]], tuple[int, int, int]]:
    """The examples cut to seq_len (data.truncation), and what that cost: (examples cut, answer
    tokens lost, prompt tokens lost)."""
    out, cut, answer_lost, prompt_lost = [], 0, 0, 0
    for ids, labels in examples:
        if len(ids) > seq_len:
            kept = head_of(len(ids), seq_len) if how == "head" else balanced_cut(labels, seq_len)
            lost_answer = sum(label != IGNORE for label in labels) - sum(labels[i] != IGNORE for i in kept)
            cut, answer_lost, prompt_lost = cut + 1, answer_lost + lost_answer, \
                prompt_lost + len(ids) - len(kept) - lost_answer
            ids, labels = [ids[i] for i in kept], [labels[i] for i in kept]
        out.append((ids, labels))
    return out, (cut, answer_lost, prompt_lost)


def head_of(length: int, seq_len: int) -> list[int]:
    return list(range(min(length, seq_len)))


def balanced_cut(labels: list[int], seq_len: int) -> list[int]:
    """The token indices an over-long example keeps under LLaMA-Factory's cutoff_len
    (data/processor/supervised.py, _encode_data_example): turn by turn, in order, each (prompt,
    answer) pair is cut to what is left of seq_len by `cutoff_shares`, each keeping its head."""
    kept, start, room = [], 0, seq_len
    for prompt, answer in turns_of(labels):
        if room <= 0:
            break
        keep_prompt, keep_answer = cutoff_shares(prompt, answer, room)
        kept += [*range(start, start + keep_prompt), *range(start + prompt, start + prompt + keep_answer)]
        start, room = start + prompt + answer, room - keep_prompt - keep_answer
    return kept


def turns_of(labels: list[int]) -> list[tuple[int, int]]:
    """(prompt tokens, answer tokens) per turn: a run of unlearned labels, then the learned run
    after it (a text row is one turn with no prompt; a template's tail after the last answer one
    with no answer)."""
    turns, prompt = [], 0
    for learned, run in itertools.groupby(labels, key=lambda label: label != IGNORE):
        length = sum(1 for _ in run)
        if learned:
            turns.append((prompt, length))
            prompt = 0
        else:
            prompt = length
    return turns + [(prompt, 0)] if prompt else turns


def cutoff_shares(prompt: int, answer: int, room: int) -> tuple[int, int]:
    """(prompt, answer) tokens kept of a turn within `room` (LLaMA-Factory's infer_seqlen,
    data/processor/processor_utils.py): an answer under half the room is kept whole and the
    prompt cut; else a prompt under half is kept whole and the answer cut; else both shrink in
    proportion to their lengths."""
    if answer * 2 < room:
        most_answer = room
    elif prompt * 2 < room:
        most_answer = room - prompt
    else:
        most_answer = int(room * answer / (prompt + answer))
    kept_answer = min(most_answer, answer)
    return min(max(room - kept_answer, 0), prompt), kept_answer


def pad(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """One example per row, truncated to seq_len, padded with pad_id / IGNORE."""
    ids = np.full((len(examples), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(examples), seq_len), IGNORE, dtype=np.int64)
    for row, (e_ids, e_labels) in enumerate(examples):
        n = min(len(e_ids), seq_len)
        ids[row, :n], labels[row, :n] = e_ids[:n], e_labels[:n]
    return ids, labels


def read_examples(files: list[Path], cfg: DataConfig, tokenizer) -> tuple[list, int, list[str], tuple[str, ...]]:
    """Tokenized (input_ids, labels) per row, the rows skipped with why, and the formats read."""
    examples, skipped, reasons, formats = [], 0, [], {}
    for file in files:
        rows, line_numbers, bad_lines = read_rows(file, cfg.skip_bad_rows)
        skipped, reasons = skipped + len(bad_lines), reasons + bad_lines
        if not len(rows):  # every line skipped: nothing to tell a format by
            continue
        found, usual = row_formats(rows, file) if cfg.format == "auto" else ([cfg.format] * len(rows), cfg.format)
        for index, row in enumerate(rows):
            fmt = found[index] or usual
            try:
                examples.append(tokenize_row(row, fmt, tokenizer, cfg.alpaca_template))
                formats[fmt] = True
            except RowError as e:
                line = f"line {line_numbers[index]}" if line_numbers else line_of_row(file, index)
                where = f"{file}, {line}: {e} ({fmt} format)"
                if not cfg.skip_bad_rows:
                    raise DataError(f"{where}; fix the row, or set data.skip_bad_rows=true to skip such rows") from None
                skipped += 1
                reasons.append(where)
    if skipped and not examples:
        raise DataError(f"every row was bad ({skipped} skipped under data.skip_bad_rows), e.g. {reasons[0]}; "
                        f"fix the data, or point data.path (data.eval_path) at the right files")
    return examples, skipped, reasons[:10], tuple(formats)


def to_sequences(examples: list, cfg: DataConfig, tokenizer, seq_len: int, skipped: int = 0,
                 reasons: list[str] = (), formats: tuple[str, ...] = (), keep_tail: bool = False) -> Sequences:
    """Packed or padded rows of the examples (packing_layout). Concatenating drops the tail that
    does not fill a row, unless `keep_tail` (an eval set: a small one would otherwise vanish),
    which pads it."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    longest = max((len(e_ids) for e_ids, _ in examples), default=0)
    layout = packing_layout(cfg, formats)
    cut = (0, 0, 0)  # concatenating splits an example, cuts none
    if layout != "concatenated":
        examples, cut = truncated(examples, seq_len, cfg.truncation)
    lengths = None  # concatenated rows: every token real
    if layout == "whole":
        examples, lengths = rows_of_whole_examples(examples, seq_len, pad_id)
    elif layout == "concatenated" and keep_tail:
        examples = examples + [tail_padding(examples, seq_len, pad_id)]
    ids, labels = pad(examples, seq_len, pad_id) if layout == "padded" else pack(examples, seq_len)
    positions = isolate_examples(examples, labels) if cfg.neat_packing else None
    # A row must hold a learned token past its first: the loss predicts token t+1 from t, so a label
    # at position 0 (an answer's last token spilled into the next packed row) is never counted,
    # and a row without another would make the mean loss 0/0, a NaN.
    learnable = targets(labels, per_row=True) > 0
    if layout == "padded":
        lengths = np.minimum([len(e_ids) for e_ids, _ in examples], seq_len).astype(np.int64)
    return Sequences(ids[learnable], labels[learnable], skipped, list(reasons), int((~learnable).sum()),
                     longest, formats,
                     lengths[learnable] if lengths is not None else None,
                     positions[learnable] if positions is not None else None, cut, layout, cfg.truncation)


def packing_layout(cfg: DataConfig, formats: tuple[str, ...]) -> str:
    """How examples become seq_len rows: `padded` (data.packing off: one per row); `whole` (packed
    whole, best fit: neat packing, and any data with prompts, as LLaMA-Factory's sft stage packs,
    so that no answer is learned in a row without its prompt); `concatenated` (plain text, as a
    pretraining stage packs: one document runs on into the next row, none cut)."""
    if not cfg.packing:
        return "padded"
    return "whole" if cfg.neat_packing or set(formats) - {"text"} else "concatenated"


def build_sequences(files: list[Path], cfg: DataConfig, tokenizer, seq_len: int, keep_tail: bool = False) -> Sequences:
    examples, skipped, reasons, formats = read_examples(files, cfg, tokenizer)
    return to_sequences(examples, cfg, tokenizer, seq_len, skipped, reasons, formats, keep_tail)


def synthetic_sequences(n: int, seq_len: int, vocab_size: int, seed: int) -> Sequences:
    """Random tokens, every one learned: for throughput benchmarks, not for learning."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, size=(n, seq_len), dtype=np.int64)
    return Sequences(ids, ids.copy(), layout="synthetic")


def load_splits(cfg: DataConfig, tokenizer, seq_len: int, seed: int, vocab_size: int) -> tuple[Sequences, Sequences]:
    """(train, eval) sequences. Eval is data.eval_path, else a seeded eval_fraction of the
    rows, split before packing so no example straddles the two."""
    if cfg.path == "synthetic":
        full = synthetic_sequences(cfg.synthetic_samples, seq_len, vocab_size, seed)
        n_eval = int(len(full) * cfg.eval_fraction)
        return Sequences(full.input_ids[n_eval:], full.labels[n_eval:], layout=full.layout), \
            Sequences(full.input_ids[:n_eval], full.labels[:n_eval], layout=full.layout)
    from zerofit.demo import DEMO_DATA

    files = [DEMO_DATA] if cfg.path == "demo" else data_files(cfg.path)
    examples, skipped, reasons, formats = read_examples(files, cfg, tokenizer)
    if cfg.eval_path:
        splits = (to_sequences(examples, cfg, tokenizer, seq_len, skipped, reasons, formats),
                  build_sequences(data_files(cfg.eval_path, "data.eval_path"), cfg, tokenizer, seq_len,
                                  keep_tail=True))
    else:
        order = np.random.default_rng(seed).permutation(len(examples))
        n_eval = int(len(examples) * cfg.eval_fraction)
        held, kept = np.sort(order[:n_eval]), np.sort(order[n_eval:])
        splits = (to_sequences([examples[i] for i in kept], cfg, tokenizer, seq_len, skipped, reasons, formats),
                  to_sequences([examples[i] for i in held], cfg, tokenizer, seq_len, formats=formats, keep_tail=True))
    check_vocabulary(splits, len(tokenizer), vocab_size)
    return splits


FINGERPRINT_SCHEME = "train:"  # before it, the eval split's tokens were hashed in too


def fingerprint(train_set: Sequences) -> str:
    """xxh3-128 of the training rows' token ids and labels: the same files, tokenizer and data
    settings give the same value, so a resume can tell that the data its position counts in
    changed (a few GB/s: seconds for a billion tokens). The eval split is not in it: another
    eval set leaves the position meaning what it did."""
    import xxhash

    digest = xxhash.xxh3_128()
    for array in (train_set.input_ids, train_set.labels):
        digest.update(np.ascontiguousarray(array).data)
    return FINGERPRINT_SCHEME + digest.hexdigest()


def check_vocabulary(splits: tuple[Sequences, ...], tokenizer_size: int, vocab_size: int) -> None:
    """Token ids the model's embedding has rows for: an id at or past vocab_size fails in the
    first forward ("index out of range"), after the model was built. zerofit does not resize
    embeddings (under ZeRO-3 the rows are partitioned, and new rows would need training)."""
    highest = max((int(s.input_ids.max()) for s in splits if s.input_ids.size), default=-1)
    if highest >= vocab_size:
        raise DataError(f"the data has token id {highest} but the model's vocabulary holds {vocab_size} "
                        f"(the tokenizer has {tokenizer_size} tokens): use the model's own tokenizer "
                        f"(model.tokenizer), or for a model built from a config give it vocab_size >= "
                        f"{tokenizer_size}")


# ------------------------------------------------------------------------ batches
def targets(labels: np.ndarray, per_row: bool = False):
    """The labels a causal-LM loss counts: each row's past its first (token t predicts t+1)."""
    counted = (labels[:, 1:] != IGNORE).sum(axis=1)
    return counted if per_row else int(counted.sum())


class MicroBatch(NamedTuple):
    """One forward's rows: token ids, labels, and per token its place in its example under
    data.neat_packing (None otherwise: positions 0..seq_len-1, the model's own)."""
    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray | None = None


def batch_of(seqs: Sequences, rows) -> MicroBatch:
    return MicroBatch(seqs.input_ids[rows], seqs.labels[rows],
                      seqs.positions[rows] if seqs.positions is not None else None)


class Batches:
    """Micro batches for one rank. Global micro batch j takes sequences
    [j*B*W, (j+1)*B*W) of the epoch's seeded permutation, rank r its slice r*B:(r+1)*B,
    so `position` (micro batches consumed) is all a resume on W ranks needs; on another
    number of ranks carried_position converts it."""

    def __init__(self, seqs: Sequences, micro_batch: int, rank: int, world: int, seed: int, position: int = 0):
        self.seqs, self.micro_batch, self.rank, self.world, self.seed = seqs, micro_batch, rank, world, seed
        self.per_epoch = len(seqs) // (micro_batch * world)
        if self.per_epoch == 0:
            dropped = seqs.dropped_note(seqs.input_ids.shape[-1])
            raise DataError(f"the data gives {len(seqs)} sequences, fewer than one micro batch on every rank "
                            f"({micro_batch} x {world}); " + (dropped or "add data, or lower train.micro_batch_size"))
        self.position = position
        self._order_epoch, self._order = -1, None
        self._targets = None  # per sequence, the labels the loss counts (targets)

    def _order_for(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.seqs))
            self._order_epoch = epoch
        return self._order

    @property
    def epoch(self) -> float:
        return self.position / self.per_epoch

    def _rows(self, position: int) -> np.ndarray:
        """Every rank's sequences of the global micro batch at `position`, this rank's the
        slice [rank x micro, (rank + 1) x micro)."""
        epoch, index = divmod(position, self.per_epoch)
        per_batch = self.micro_batch * self.world
        return self._order_for(epoch)[index * per_batch:(index + 1) * per_batch]

    def _mine(self, rows: np.ndarray) -> np.ndarray:
        return rows[self.rank * self.micro_batch:(self.rank + 1) * self.micro_batch]

    def tokens_between(self, start: int, stop: int) -> int:
        """Tokens, padding left out, of every rank's micro batches at positions [start, stop):
        what the run processed in that span (tokens/s counts these, not seq_len per row)."""
        if self.seqs.lengths is None:
            return (stop - start) * self.micro_batch * self.world * self.seqs.input_ids.shape[-1]
        return sum(int(self.seqs.lengths[self._rows(position)].sum()) for position in range(start, stop))

    def step_targets(self, accum: int) -> tuple[list[int], int]:
        """The tokens the loss counts (labels past each row's first) in this rank's next `accum`
        micro batches, and in every rank's: what one optimizer step's token-weighted mean divides
        by. The order is a pure function of (seed, position), so every rank knows every rank's
        count without a collective; the position does not move."""
        if self._targets is None:
            self._targets = targets(self.seqs.labels, per_row=True)
        batches = [self._rows(position) for position in range(self.position, self.position + accum)]
        return ([int(self._targets[self._mine(rows)].sum()) for rows in batches],
                sum(int(self._targets[rows].sum()) for rows in batches))

    def next(self) -> MicroBatch:
        rows = self._mine(self._rows(self.position))
        self.position += 1
        return batch_of(self.seqs, rows)


@dataclass(frozen=True)
class BatchShape:
    """What a Batches position counts in: ranks, sequences per micro batch, sequences per epoch."""
    world: int
    micro_batch: int
    sequences: int

    @property
    def per_epoch(self) -> int:
        return self.sequences // (self.micro_batch * self.world)


def carried_position(position: int, old: BatchShape, new: BatchShape) -> int:
    """The Batches position in `new` that continues where `position` in `old` stopped: the same
    epoch, the same share of its sequences consumed, rounded up to whole micro batches. With the
    same sequences (another rank count, an OOM retry's micro batch) that share is exactly the
    sequences already seen, so none is seen twice; with other sequences (seq_len, packing or the
    data changed) the epoch's permutation is another one, so only its share carries over."""
    epoch, index = divmod(position, old.per_epoch)
    consumed = index * old.micro_batch * old.world * new.sequences  # in units of 1 / old.sequences
    new_index = -(-consumed // (old.sequences * new.micro_batch * new.world))
    if new_index >= new.per_epoch:
        epoch, new_index = epoch + 1, 0
    return epoch * new.per_epoch + new_index


def eval_batches(seqs: Sequences, micro_batch: int, rank: int, world: int, limit: int | None = None):
    """This rank's micro batches of the eval set's first `limit` sequences (all of them when
    None), in file order: the same sequences however they are split into micro batches and
    ranks (the tail that did not fill a global batch was dropped: 1 and 2 ranks evaluated 4 and
    8 sequences of one set). A global batch's sequences are shared out evenly; a rank left
    without one runs a forward anyway (ZeRO-3's forward is collective) on a row whose labels are
    all ignored, which the token-weighted eval loss does not count."""
    total = len(seqs) if limit is None else min(len(seqs), limit)
    for start in range(0, total, micro_batch * world):
        share = -(-(min(start + micro_batch * world, total) - start) // world)
        lo = min(start + rank * share, total)
        hi = min(lo + share, start + micro_batch * world, total)
        if hi > lo:
            yield batch_of(seqs, slice(lo, hi))
        else:
            stand_in = batch_of(seqs, slice(0, 1))
            yield stand_in._replace(labels=np.full_like(stand_in.labels, IGNORE))
