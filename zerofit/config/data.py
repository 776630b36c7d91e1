"""The data section of the config (`data:`): which files are read, in which format and columns,
how examples become seq_len rows, and how they are tokenized and cached. The column and format
tables here are what datafiles.py, tokenizing.py and lfdata.py read rows by; datacache.py hashes
this module's text into the data cache's key."""
from __future__ import annotations

import difflib
from typing import Literal

from pydantic import Field, field_validator, model_validator

from zerofit.config.section import Section

# data.columns' keys: LLaMA-Factory's dataset_info.json names, and zerofit's own, to the field read
COLUMN_FIELDS = {"prompt": "instruction", "query": "input", "response": "output", "messages": "messages",
                 **{name: name for name in ("instruction", "input", "output", "conversations", "text", "system",
                                            "history", "tools")}}


# the fields a row may go without, which data.columns may leave unread (null)
OPTIONAL_FIELDS = ("input", "system", "history", "tools")
# the columns a file read in a format cannot do without
FORMAT_FIELDS = {"text": ("text",), "alpaca": ("instruction", "output"), "messages": ("messages",),
                 "sharegpt": ("conversations",)}


def column_fields(fmt: str) -> dict[str, str]:
    """data.columns' keys to the fields they name under data.format `fmt`: LLaMA-Factory's
    `messages` column (the conversation of its sharegpt formatting) is read as zerofit's sharegpt
    where data.format says so, else in the messages format (either naming of turns)."""
    return {**COLUMN_FIELDS, "messages": "conversations"} if fmt == "sharegpt" else COLUMN_FIELDS


class DataConfig(Section):
    path: str | list[str] = "demo"
    """Training data: local .jsonl/.json/.parquet file(s) or directories of them (or of a
    `datasets` save_to_disk); `demo` for the bundled synthetic instruction set; `synthetic`
    for random tokens (throughput benchmarks)."""
    format: Literal["auto", "text", "alpaca", "messages", "sharegpt"] = "auto"
    """Row format: `text` {text}; `alpaca` {instruction, input?, output, system?, history?:
    [[instruction, output], ...]}; `messages` {messages: [{role, content}]}; `sharegpt`
    {conversations: [{from, value}], system?} (LLaMA-Factory's: human/gpt/observation/
    function_call); `auto` picks per row by its fields."""
    alpaca_template: Literal["chat", "alpaca"] = "chat"
    """How alpaca rows are laid out: `chat` renders them with the tokenizer's chat template
    (system, history, then the instruction and its input as the user's turn and the output
    as the answer, as LLaMA-Factory does), in the alpaca layout where the tokenizer has
    none; `alpaca` always in the alpaca layout ("### Instruction: ... ### Response:"),
    which then becomes the exported tokenizer's chat template."""
    columns: dict[str, str | None] = {}
    """The files' column for a field whose name differs, keyed as LLaMA-Factory's
    dataset_info.json `columns` are (prompt, query, response, system, history, messages,
    tools) or by zerofit's own field names (instruction, input, output, conversations, text):
    e.g. {prompt: question, response: answer}. `messages` is the conversation column, read in
    the messages format: turns {role, content} (OpenAI's, tool_calls kept) or {from, value}
    (ShareGPT's), a `system` column as its first turn (under data.format: sharegpt, as
    sharegpt). A file holding a format's mapped column must hold that format's other required
    ones; files holding none keep their names (a directory may mix formats); a file holding a
    field under its own name too has that column left out (said at the start), as LLaMA-Factory
    reads only the column named. null: an optional field (query/input, system, history, tools) is
    not read, its column in any file left out, as LLaMA-Factory leaves out a column its
    dataset_info.json entry does not name."""
    eval_path: str | list[str] | None = None
    """Held-out data file(s) or directories. Default: `eval_fraction` (or `eval_examples`) of the
    training rows."""
    eval_fraction: float = Field(0.05, ge=0.0, lt=0.5)
    """Fraction of training rows held out for eval when neither eval_path nor eval_examples is given."""
    eval_examples: int | None = Field(None, ge=1)
    """Hold out exactly this many training rows for eval (seeded, as eval_fraction's are
    chosen), instead of eval_fraction (LLaMA-Factory's val_size given as an integer). Not with
    eval_path, nor with eval_fraction set to other than its default."""
    max_samples: int | None = Field(None, ge=1)
    """Read only the first max_samples rows of each data.path entry (a file, or a directory's
    files in name order), and of each data.eval_path entry, before the eval split
    (LLaMA-Factory's max_samples, for debugging). A bad row among them counts and is skipped,
    not replaced (LLaMA-Factory cuts before converting rows). Not for `synthetic` (set
    synthetic_samples)."""
    packing: bool = True
    """Pack examples into seq_len rows (True) or pad each to its own row (False). Examples
    with a prompt (alpaca, messages, sharegpt) are packed whole, best fit, rows closed by
    padding (LLaMA-Factory's sft packing: no answer learned without its prompt); plain
    `text` rows are concatenated, one running into the next row (a pretraining stage's)."""
    neat_packing: bool = False
    """With packing: each example attends only to itself (LLaMA-Factory's neat_packing).
    Examples are packed whole (best fit, rows padded; none split across rows), position
    ids restart at every example, transformers builds a block-diagonal causal
    mask from them, and an example's first token is not predicted from the one before it.
    Costs a micro batch x seq_len^2 mask in memory (the planner counts it)."""
    truncation: Literal["balanced", "head"] = "balanced"
    """How an example longer than train.seq_len is cut to it (padded or packed whole; text
    concatenated runs on into the next row, none cut). `balanced`: LLaMA-Factory's cutoff_len,
    turn by turn, each prompt and answer keep their heads in proportion to their lengths (an
    answer shorter than half of what is left is kept whole), so a long prompt still leaves its
    answer to learn; `head`: the first seq_len tokens (a long prompt leaves none)."""
    train_on_prompt: bool = False
    """Learn the prompt tokens too (system and user turns, tool results, the template's
    markup), not only the answers (LLaMA-Factory's train_on_prompt). Plain `text` rows learn
    every token either way."""
    mask_history: bool = False
    """Learn only the last answer of each conversation (an alpaca row's history pairs are
    earlier turns), as LLaMA-Factory's mask_history; a balanced cut then keeps the last turns
    first and drops the oldest, as theirs does."""
    skip_bad_rows: bool = False
    """Skip and count malformed rows instead of failing on the first one."""
    num_workers: int | None = Field(None, ge=1)
    """Processes that tokenize a data file's rows (LLaMA-Factory's preprocessing_num_workers),
    at most the machine's cores (its first rank tokenizes for all of its ranks). Default: those
    cores, up to 16, for a file of 1,000 rows or more, else 1 (the training process alone). The rows and
    their order come out the same whatever the count; a resume reads them from the data cache."""
    cache_dir: str | None = None
    """Where the tokenized rows are kept for a later start. Default: RUN_DIR/data-cache, for this
    run's next start (a resume, an OOM retry), an older tokenization of its data replaced. A
    directory named here may be shared by runs (LLaMA-Factory's tokenized_path, kept up to date):
    a run of the same files (path, size, time), data keys and tokenizer reads what another
    tokenized; anything changed is tokenized again beside it, and nothing there is removed."""
    synthetic_samples: int = Field(4096, ge=1)
    """Number of random-token sequences when path is `synthetic`."""

    @field_validator("path", "eval_path")
    @classmethod
    def _names_files(cls, value: str | list[str] | None, info) -> str | list[str] | None:
        """An empty list or name reads nothing: said here, not as a run of 0 sequences."""
        if value is not None and (not value or any(not entry for entry in value if isinstance(value, list))):
            unset = "drop the key for the bundled demo data" if info.field_name == "path" else \
                "drop the key to hold rows of data.path out (data.eval_fraction)"
            raise ValueError(f"data.{info.field_name} {value!r} names no file: give the files or directories to "
                             f"read, or {unset}")
        return value

    @field_validator("columns")
    @classmethod
    def _known_columns(cls, columns: dict[str, str | None]) -> dict[str, str | None]:
        unknown = sorted(set(columns) - set(COLUMN_FIELDS))
        if unknown:
            near = [f"{key} (did you mean {match[0]}?)" if (match := difflib.get_close_matches(key, COLUMN_FIELDS, 1))
                    else key for key in unknown]
            raise ValueError(f"data.columns names {', '.join(near)}: the keys are the fields "
                             f"{', '.join(dict.fromkeys(COLUMN_FIELDS.values()))}, or LLaMA-Factory's "
                             f"{', '.join(k for k in COLUMN_FIELDS if k not in COLUMN_FIELDS.values())}")
        required = [key for key, column in columns.items() if column is None and COLUMN_FIELDS[key] not in OPTIONAL_FIELDS]
        if required:
            raise ValueError(f"data.columns {', '.join(f'{key}: null' for key in required)}: only an optional field "
                             f"({', '.join(OPTIONAL_FIELDS)}) can be left unread; name the column that holds it")
        fields, named = [COLUMN_FIELDS[key] for key in columns], [c for c in columns.values() if c is not None]
        if len(set(fields)) < len(fields) or len(set(named)) < len(named):
            raise ValueError(f"data.columns {columns} maps two keys to one field or one column; "
                             f"give each field one column")
        return columns

    @model_validator(mode="after")
    def _one_eval_set(self) -> "DataConfig":
        if self.eval_examples is not None and self.eval_path:
            raise ValueError(f"data.eval_examples {self.eval_examples} holds training rows out for eval, but "
                             f"data.eval_path names the eval set: drop one of the two")
        # the default as well is no choice: a run's config.yaml writes every key, and must load back
        if self.eval_examples is not None and self.eval_fraction != type(self).model_fields["eval_fraction"].default:
            raise ValueError(f"data.eval_examples {self.eval_examples} and data.eval_fraction {self.eval_fraction} "
                             f"both say how many rows to hold out: drop data.eval_fraction (a count replaces it)")
        return self

    @model_validator(mode="after")
    def _one_way_to_learn(self) -> "DataConfig":
        if self.mask_history and self.train_on_prompt:  # LLaMA-Factory's data_args.py refuses the two as well
            raise ValueError("data.mask_history learns only the last answer, data.train_on_prompt every prompt as "
                             "well: LLaMA-Factory refuses the two together; drop one")
        if self.mask_history and self.truncation == "head":
            raise ValueError("data.mask_history learns the last answer, which a head cut drops first: set "
                             "data.truncation: balanced (which keeps the last turns first under mask_history, as "
                             "LLaMA-Factory does)")
        return self

    @model_validator(mode="after")
    def _max_samples_reads_files(self) -> "DataConfig":
        if self.max_samples is not None and self.path == "synthetic":
            raise ValueError(f"data.max_samples {self.max_samples} keeps the first rows of each data file, but "
                             f"data.path synthetic reads none (it draws data.synthetic_samples random sequences): "
                             f"set data.synthetic_samples: {self.max_samples} instead")
        return self

    @model_validator(mode="after")
    def _neat_needs_packing(self) -> "DataConfig":
        if self.neat_packing and not self.packing:
            raise ValueError("data.neat_packing isolates the examples packed into one row, but data.packing is "
                             "false (one example per row, nothing to isolate): set data.packing: true, or drop "
                             "neat_packing")
        return self
