"""OpenAI-style function calling in `messages` rows, as HF chat templates take it.

An assistant turn may carry `tool_calls` ([{type: function, id?, function: {name, arguments}}],
its content null or empty), a `tool` turn answers one (`tool_call_id`, `name`), and a row may
list the `tools` offered (JSON schemas, or LLaMA-Factory's JSON string of them). ShareGPT rows
call in a `function_call` turn whose value is the call's JSON and answer in an `observation`
turn (LLaMA-Factory's dataset layout): read as the same assistant tool_calls and tool turns.
Templates read `arguments` as a mapping (transformers' chat-templating docs; Llama 3.1's
template writes `arguments | tojson`, so OpenAI's JSON string would be quoted twice): a string
is parsed.

Rows come through HF datasets, which gives a column one Arrow type: the dicts of every row are
unified into one struct, and a key another row has reads as null in this one (`{"city": "Paris"}`
next to `{"query": "x"}` becomes `{"city": "Paris", "query": None}`). Null values are dropped
from arguments and schemas for that reason; a real null argument is dropped with them (write
`arguments` as the JSON string OpenAI uses to keep one).
"""
from __future__ import annotations

import json

WRITTEN_SHAPE = '{"name": str, "arguments": object} or a list of them'
CALL_SHAPE = "a list of {type: function, function: {name: str, arguments: object or JSON string}}"


class ToolCallError(ValueError):
    """A malformed tool call or tools list: (field, problem), as conversations.RowError takes them."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(problem)
        self.field_name, self.problem = field_name, problem


def without_nulls(value):
    """`value` with every mapping's null-valued keys dropped, at any depth (Arrow's filled-in keys)."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def calls_of(message: dict, where: str) -> list[dict]:
    """The message's tool calls in the chat-template shape; [] when it has none."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list) or not calls:
        raise ToolCallError(f"{where}.tool_calls", f"expected {CALL_SHAPE}")
    shaped = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolCallError(f"{where}.tool_calls[{i}]", f"expected {CALL_SHAPE}")
        shaped_call = {"type": "function",
                       "function": {"name": function["name"],
                                    "arguments": arguments_of(function.get("arguments"), f"{where}.tool_calls[{i}]")}}
        if isinstance(call.get("id"), str):
            shaped_call["id"] = call["id"]
        shaped.append(shaped_call)
    return shaped


def calls_written(text: str, where: str) -> list[dict]:
    """A ShareGPT `function_call` turn's value (LLaMA-Factory's layout: the JSON of one
    {name, arguments} or of a list of them, for parallel calls) as the chat-template shape."""
    try:
        written = json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(where, f"a function_call turn holds the call as JSON ({WRITTEN_SHAPE}), and this is "
                                   f"not JSON ({e.msg} at character {e.pos}); write a plain answer as a gpt "
                                   f"turn") from None
    written = written if isinstance(written, list) else [written]
    if not written or not all(isinstance(call, dict) and isinstance(call.get("name"), str) for call in written):
        raise ToolCallError(where, f"a function_call turn holds the call as JSON ({WRITTEN_SHAPE})")
    return calls_of({"tool_calls": [{"type": "function", "function": call} for call in written]}, where)


def arguments_of(arguments, where: str) -> dict:
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolCallError(f"{where}.function.arguments", f"not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(arguments, dict):
        raise ToolCallError(f"{where}.function.arguments", f"expected an object, got {type(arguments).__name__}")
    return without_nulls(arguments)


def tools_of(row: dict) -> list[dict] | None:
    """The row's `tools` as a list of schemas (None without them)."""
    tools = row.get("tools")
    if tools is None or tools == "":
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ToolCallError("tools", f"not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ToolCallError("tools", "expected a list of tool schemas ({type: function, function: {name, "
                                     "description, parameters}}) or a JSON string of one")
    return without_nulls(tools) or None


def names_offered(tools: list[dict] | None) -> list[str]:
    """The function names a tools list offers (OpenAI's {type, function: {name}} or a bare {name})."""
    return [(tool.get("function") or tool).get("name") for tool in tools or () if
            isinstance((tool.get("function") or tool).get("name"), str)]


def plain_call_text(calls: list[dict]) -> str:
    """Tool calls as the `role:` layout writes them (no chat template): one JSON object a line."""
    return "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                ensure_ascii=False) for c in calls)
