"""A row -> its conversation: the chat messages ({role, content}; an assistant's tool_calls, a
tool turn's tool_call_id and name) that tokenizing lays out by the tokenizer's chat template (or
as `role:` lines where it has none). Alpaca rows as LLaMA-Factory's alpaca converter makes them
(system, history, instruction with its input, output); OpenAI's `messages` and ShareGPT's
`conversations`, ShareGPT's speaker names read as roles and either naming of a turn's keys taken,
OpenAI's text parts joined. RowError is a row's bad field, named: raised here and by tokenizing,
which says it with the row's file and line (a tokenizing worker sends it back)."""
from __future__ import annotations

import contextlib
import difflib

from zerofit.data import toolcalls


class RowError(ValueError):
    def __init__(self, field_name: str | None, problem: str):
        super().__init__(f"field `{field_name}`: {problem}" if field_name else problem)
        self.field_name, self.problem = field_name, problem

    def __reduce__(self):  # sent back by a tokenizing worker process (tokenworkers)
        return type(self), (self.field_name, self.problem)


def text_field(row: dict, key: str, required: bool = True) -> str:
    """The row's string column `key` ("" when absent and not required); RowError naming the key otherwise."""
    value = row.get(key)
    if value is None:
        if required:
            raise RowError(key, "missing" + misspelt_hint(row, key))
        return ""
    if not isinstance(value, str):
        raise RowError(key, f"expected a string, got {type(value).__name__}")
    return value


def misspelt_hint(row: dict, key: str) -> str:
    """A field of the row that is a near spelling of the missing `key` (`outptu` for `output`)."""
    held = [name for name, value in row.items() if value is not None and name != key]
    close = difflib.get_close_matches(key, held, n=1, cutoff=0.75)
    return f" (the row has `{close[0]}`: misspelt?)" if close else ""


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
    instruction, extra = text_field(row, "instruction"), text_field(row, "input", required=False)
    system = text_field(row, "system", required=False)
    turns = [*history_pairs(row), ("\n".join(part for part in (instruction, extra) if part), text_field(row, "output"))]
    return [{"role": "system", "content": system}] * bool(system) + \
        [{"role": role, "content": text} for pair in turns for role, text in zip(("user", "assistant"), pair)]


def history_pairs(row: dict) -> list[tuple[str, str]]:
    """An alpaca row's earlier exchanges (its `history` column: [instruction, response] pairs)."""
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


def openai_messages(row: dict) -> list[dict]:
    """An OpenAI-style row ({messages: [{role, content, tool_calls?}], system?}) as chat messages."""
    return with_system(row, _turns(row, "messages", "role", "content", tool_calls=True))


def sharegpt_messages(row: dict) -> list[dict]:
    """A ShareGPT row ({conversations: [{from, value}], system?}) as chat messages."""
    return with_system(row, _turns(row, "conversations", "from", "value"))


def with_system(row: dict, messages: list[dict]) -> list[dict]:
    """The row's `system` column as the conversation's first turn, unless the conversation opens
    with a system turn of its own, which wins (LLaMA-Factory's sharegpt converter)."""
    system = text_field(row, "system", required=False)
    if not system or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system}] + messages


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
