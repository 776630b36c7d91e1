"""Rows -> examples: each row's token ids and labels, by its format (text, alpaca, messages,
sharegpt). Prompt tokens get label IGNORE, so only answers are learned (rowlayout.relabelled
learns others after the cut, which reads prompt and answer off these labels); conversations
(conversations.py reads them off a row) go through the tokenizer's chat template, whose layout
the run then keeps for chat (chatlayout.py)."""
from __future__ import annotations

import contextlib
import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from jinja2.exceptions import TemplateError

from zerofit.config.data import FORMAT_FIELDS, DataConfig
from zerofit.core.console import HIDDEN, CountProgress, Shown
from zerofit.data import toolcalls
from zerofit.data import workers as tokenworkers
from zerofit.data.conversations import (
    RowError,
    alpaca_messages,
    conversation_named,
    history_pairs,
    openai_messages,
    sharegpt_messages,
    text_field,
)
from zerofit.data.files import DataError, line_of_row, read_rows, with_columns
from zerofit.machine.hardware import cpu_cores

IGNORE = -100  # the label value HF causal-LM losses skip
TOO_LONG_WARNING = "sequence-length-is-longer-than-the-specified-maximum"  # transformers' once-flag of that warning
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
CHAT_FORMATS = {"messages", "sharegpt"}  # the row formats read as conversations of chat messages


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
                        f"(sharegpt); name the columns that hold them with data.columns (e.g. {{prompt: question, "
                        f"response: answer}}, as dataset_info.json's columns), or set data.format")
    return found, counts.most_common(1)[0][0]


# --------------------------------------------------------------------- tokenizing
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
        ids = text_ids(tokenizer, text_field(row, "text")) + eos
        return ids, list(ids)
    if fmt not in ("alpaca", *CHAT_FORMATS):
        raise ValueError(f"unknown format {fmt}")
    try:
        tools = toolcalls.tools_of(row)
        if fmt == "alpaca" and fmt not in chat_formats(tokenizer, alpaca_template):
            if tools:
                raise RowError("tools", "the alpaca layout has no place for tools: give the run a tokenizer whose "
                                        "chat template renders them (model.tokenizer), with data.alpaca_template: chat")
            return _tokenize_alpaca(row, tokenizer, bos, eos)
        messages = {"alpaca": alpaca_messages, "messages": openai_messages, "sharegpt": sharegpt_messages}[fmt](row)
    except toolcalls.ToolCallError as e:
        raise RowError(e.field_name, e.problem) from None
    with conversation_named({"alpaca": ALPACA_AS_CHAT, "sharegpt": "conversations"}.get(fmt, "messages")):
        return _tokenize_messages(messages, tokenizer, bos, eos, tools)


ALPACA_AS_CHAT = "instruction/output as a conversation (data.alpaca_template: chat; `alpaca` renders the alpaca layout)"


def _tokenize_alpaca(row: dict, tokenizer, bos: list[int], eos: list[int]) -> tuple[list[int], list[int]]:
    """LLaMA-Factory's alpaca row: the system text opens the prompt, each `history` pair is an
    earlier instruction and response (learned, as every assistant turn of a conversation is),
    then the row's own instruction (with its input) and output."""
    instruction, extra = text_field(row, "instruction"), text_field(row, "input", required=False)
    turns = [(ALPACA_PROMPT.format(instruction=q), a) for q, a in history_pairs(row)]
    turns.append(((ALPACA_PROMPT_WITH_INPUT if extra else ALPACA_PROMPT).format(instruction=instruction, input=extra),
                  text_field(row, "output")))
    system = text_field(row, "system", required=False)
    ids, labels = list(bos), [IGNORE] * len(bos)
    for n, (prompt_text, answer_text) in enumerate(turns):
        prompt = tokenizer.encode((f"{system}\n\n" if system and n == 0 else "") + prompt_text,
                                  add_special_tokens=False)
        answer = tokenizer.encode(answer_text, add_special_tokens=False) + eos
        ids += prompt + answer
        labels += [IGNORE] * len(prompt) + answer
    return ids, labels


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
        if messages[0]["role"] == "system" and messages[0]["content"] and not renders_system(tokenizer):
            raise RowError("messages", "the tokenizer's chat template leaves a system turn out (its text is not in "
                                       "what it renders), so this row would train without its system prompt; use a "
                                       "template that renders it (model.chat_template), or drop the system turn "
                                       "(a `system` column: data.columns {system: null})")
        try:
            ids, labels = chat_template_spans(messages, tokenizer, tools)
        except RowError:
            raise
        except (TemplateError, ValueError) as e:  # the template's raise_exception: Gemma's "System role not supported"
            raise RowError("messages", f"the tokenizer's chat template refused it: {e}") from None
        except Exception as e:  # a template is code: what else it raises (1/0, str + int) is its fault on this row
            raise RowError("messages", f"the tokenizer's chat template failed on it ({type(e).__name__}: {e})") from None
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


SYSTEM_PROBE = "zerofit probe system prompt"
_renders_system: dict[str, bool] = {}  # per chat template's text: a tokenizing worker forked with it knows too


def renders_system(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes an opening system turn's text (Gemma's folds it
    into the first user turn; one that refuses it raises on each row, said as its refusal)."""
    template = tokenizer.chat_template
    if template not in _renders_system:
        probe = [{"role": "system", "content": SYSTEM_PROBE}, {"role": "user", "content": "hi"},
                 {"role": "assistant", "content": "hello"}]
        try:
            _renders_system[template] = SYSTEM_PROBE in tokenizer.apply_chat_template(probe, tokenize=False)
        except Exception:  # noqa: BLE001 - a template is code; what it raises here it raises on the row too
            _renders_system[template] = True
    return _renders_system[template]


def chat_template_spans(messages: list[dict], tokenizer, tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Render the conversation up to each assistant turn (with its generation prompt) and through
    it; each assistant turn's new tokens are learned, everything else masked. Only an assistant
    turn's edges are rendered: a template may close a turn differently when another of the same
    role follows (Qwen2.5 joins consecutive tool answers into one user turn), so a prefix that
    ends between two such turns is not the start of the whole. The whole text's tokens are those
    chat prompts get at inference; where the tokenizer joins or splits tokens across a turn's
    edge, the row is tokenized turn by turn instead (_turn_by_turn)."""
    def render(upto: int, generation_prompt: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=True, return_dict=False,
                                                  add_generation_prompt=generation_prompt))
    def extended(rendered: list[int], ids: list[int]) -> list[int]:
        if rendered[:len(ids)] != ids:
            raise _EdgeMoved
        return rendered

    ids, labels = [], []
    try:
        for i in [i for i, m in enumerate(messages) if m["role"] == "assistant"]:
            prompt = extended(render(i, True), ids)
            labels += [IGNORE] * (len(prompt) - len(ids))
            answered = extended(render(i + 1, False), prompt)
            labels += answered[len(prompt):]
            ids = answered
        if messages and messages[-1]["role"] == "assistant" and ids:
            return ids, labels  # the last render was the whole conversation
        whole = extended(render(len(messages), False), ids)  # turns after the last answer: prompt
    except _EdgeMoved:
        return _turn_by_turn(messages, tokenizer, tools)
    return whole, labels + [IGNORE] * (len(whole) - len(ids))


class _EdgeMoved(Exception):
    """A render's tokens are not the start of the next's."""


def _turn_by_turn(messages: list[dict], tokenizer, tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """The text between an assistant turn's edges, each piece tokenized on its own, as LLaMA-
    Factory tokenizes every row (slot by slot): for a tokenizer that joins tokens across an edge
    (vicuna's `ASSISTANT:` then a Llama-3 tokenizer's `:Hello`) or splits them (`\n\n` at the
    end of Llama-3's header, `\n` `\n` before a word). A template whose earlier turns' text
    changes as turns are added has no edges to cut at: a bad row."""
    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    edges = [edge for i in answers for edge in ((i, True, False), (i + 1, False, True))]  # (upto, prompt?, learned)
    if not (messages and messages[-1]["role"] == "assistant"):
        edges.append((len(messages), False, False))  # turns after the last answer: prompt
    ids, labels, done = [], [], ""
    for upto, generation_prompt, learned in edges:
        text = render(upto, generation_prompt)
        if not text.startswith(done):
            raise RowError("messages", f"the tokenizer's chat template renders the first {upto} turn(s) differently "
                                       f"from the start of the whole conversation (it rewrites earlier turns when "
                                       f"one is added, as Mistral's does with a system prompt), so the answer's "
                                       f"tokens cannot be told apart; use a template that only appends "
                                       f"(model.chat_template: a .jinja file), or drop the system turn")
        tokens = tokenizer.encode(text[len(done):], add_special_tokens=False) if len(text) > len(done) else []
        ids, labels, done = ids + tokens, labels + (tokens if learned else [IGNORE] * len(tokens)), text
    return ids, labels


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
                       f"is not in what it made of the row); use the model's tool-calling template (model."
                       f"chat_template: a .jinja file that renders tool_calls and tools), or write the calls as the "
                       f"assistant's text")


def check_format_fields(rows, fmt: str, file: Path, renames: dict[str, str]) -> None:
    """A file read in data.format `fmt` holds that format's columns: named with the file's columns
    (as the file names them, before with_columns' `renames`), not row by row (`sharegpt` over
    OpenAI-style `messages` said every row lacked `conversations`)."""
    missing = [name for name in FORMAT_FIELDS.get(fmt, ()) if name not in rows.column_names]
    if missing:
        column_of = {field: column for column, field in renames.items()}
        own = sorted(column_of.get(name, name) for name in rows.column_names)
        raise DataError(f"{file} has no {', '.join(missing)} column for data.format {fmt}; its columns are "
                        f"{', '.join(own)}: set data.format: auto (each row's format told by "
                        f"its fields), or name the column with data.columns")


def as_in_file(error: RowError, renames: dict[str, str]) -> RowError:
    """The row's error with its field named as the file names it (with_columns' renames)."""
    column_of = {field: column for column, field in renames.items()}
    head = re.match(r"[^\[.]*", error.field_name or "").group()
    if head not in column_of:
        return error
    return RowError(column_of[head] + error.field_name[len(head):], error.problem)


class Read(NamedTuple):
    """What `read_examples` read: the examples, the rows skipped (how many, the first reasons),
    the formats read, whether data.max_samples cut some entry (it read that many rows), and the
    columns not read (data.columns names another column for their field)."""
    examples: list
    skipped: int
    reasons: list[str]
    formats: tuple[str, ...]
    capped: bool
    unread: list[str]


def read_examples(files: list[Path] | list[list[Path]], cfg: DataConfig, tokenizer, shown: Shown = HIDDEN,
                  ranks_tokenizing: int | None = None) -> Read:
    """What the files hold (a Read): tokenized (input_ids, labels) per row, the rows skipped
    with why, the formats read, whether max_samples cut, the columns left out. `files`: paths,
    or per data.path entry a list of them (datafiles.data_entries); under data.max_samples only
    each entry's first rows are read (a lone path is an entry). `ranks_tokenizing`: the ranks
    of this node tokenizing at once, who share its cores (None: every one, LOCAL_WORLD_SIZE)."""
    with no_model_length_warning(tokenizer):
        return _read_examples(files, cfg, tokenizer, shown, ranks_tokenizing)


@contextlib.contextmanager
def no_model_length_warning(tokenizer):
    """transformers warns once per process of a row longer than the tokenizer's model_max_length
    (PreTrainedTokenizerBase._eventual_warn_about_too_long_sequence), which zerofit does not cut
    by: it cuts to train.seq_len and says how many rows it cut. Each forked worker said it again.
    Its once-flag is set for the reading and put back after."""
    flags = getattr(tokenizer, "deprecation_warnings", None)
    if not isinstance(flags, dict):
        yield
        return
    was = flags.get(TOO_LONG_WARNING)
    flags[TOO_LONG_WARNING] = True
    try:
        yield
    finally:
        if was is None:
            flags.pop(TOO_LONG_WARNING, None)
        else:
            flags[TOO_LONG_WARNING] = was


def _read_examples(files, cfg: DataConfig, tokenizer, shown: Shown, ranks_tokenizing: int | None) -> Read:
    examples, skipped, reasons, formats, capped, unread = [], 0, [], {}, False, []
    for entry in [file if isinstance(file, list) else [file] for file in files]:
        taken = 0  # the entry's rows read, bad ones too: LLaMA-Factory cuts each dataset before converting it
        for file in entry:
            left = None if cfg.max_samples is None else cfg.max_samples - taken
            if left == 0:
                break
            rows, line_numbers, bad_lines = read_rows(file, cfg.skip_bad_rows, left)
            taken += len(rows) + len(bad_lines)
            skipped, reasons = skipped + len(bad_lines), reasons + bad_lines
            if len(rows):  # not every line skipped (then there is nothing to tell a format by)
                more, bad_rows, read_formats, left_out = file_examples(rows, line_numbers, file, cfg, tokenizer,
                                                                          shown, ranks_tokenizing)
                examples, unread = examples + more, unread + left_out
                skipped, reasons = skipped + len(bad_rows), reasons + bad_rows
                formats.update(dict.fromkeys(read_formats, True))
        capped = capped or taken == cfg.max_samples
    if skipped and not examples:
        raise DataError(f"every row was bad ({skipped} skipped under data.skip_bad_rows), e.g. {reasons[0]}; "
                        f"fix the data, or point data.path (data.eval_path) at the right files")
    return Read(examples, skipped, reasons[:10], tuple(formats), capped, unread)


def file_examples(rows, line_numbers, file: Path, cfg: DataConfig, tokenizer, shown: Shown = HIDDEN,
                  ranks_tokenizing: int | None = None) -> tuple[list, list[str], tuple[str, ...], list[str]]:
    """One file's rows tokenized: the examples, the bad rows skipped (where and why), the formats
    read, the columns left out (with_columns). A long file shows its progress (`shown`)."""
    examples, bad, formats = [], [], {}
    rows, renames, unread = with_columns(rows, cfg.columns, file, cfg.format)
    check_format_fields(rows, cfg.format, file, renames)
    found, usual = row_formats(rows, file) if cfg.format == "auto" else ([cfg.format] * len(rows), cfg.format)
    row_formats_read = [fmt or usual for fmt in found]

    def tokenize_at(index: int):  # in this process or a forked worker (tokenworkers): a RowError comes back
        try:
            return tokenize_row(rows[index], row_formats_read[index], tokenizer, cfg.alpaca_template)
        except RowError as e:
            return e

    workers = tokenworkers.worker_count(cfg.num_workers, len(rows), cpu_cores(),
                                        ranks_tokenizing or int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    results = tokenworkers.tokenized(len(rows), tokenize_at, workers)
    with CountProgress(f"tokenizing {file.name}", len(rows), "rows", *shown) as progress, contextlib.closing(results):
        for index, result in enumerate(results):
            fmt = row_formats_read[index]
            if isinstance(result, RowError):
                line = f"line {line_numbers[index]}" if line_numbers else line_of_row(file, index)
                where = f"{file}, {line}: {as_in_file(result, renames)} ({fmt} format)"
                if not cfg.skip_bad_rows:
                    raise DataError(f"{where}; fix the row, or set data.skip_bad_rows=true to skip such rows") from None
                bad.append(where)
            else:
                examples.append(result)
                formats[fmt] = True
            progress.advance()
    return examples, bad, tuple(formats), unread
