"""Rows -> examples (tokenizing.py, conversations.py, toolcalls.py): each format, chat-template turns, tool calls."""
import json

import pytest
from conftest import CHATML, decode_learned, write_jsonl

from zerofit.config.data import DataConfig
from zerofit.data import chatlayout, tokenize
from zerofit.data import pipeline as data
from zerofit.data.conversations import RowError
from zerofit.data.files import DataError
from zerofit.data.tokenize import IGNORE


def test_text_rows_learn_every_token(tokenizer):
    ids, labels = tokenize.tokenize_row({"text": "hello"}, "text", tokenizer)
    assert ids == labels
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[1:-1]) == "hello"


def test_alpaca_masks_the_prompt(tokenizer):
    row = {"instruction": "Reverse the word.", "input": "abc", "output": "cba"}
    ids, labels = tokenize.tokenize_row(row, "alpaca", tokenizer, "alpaca")
    assert len(ids) == len(labels)
    assert decode_learned(tokenizer, ids, labels) == "cba</s>"
    prompt = tokenizer.decode([t for t, l in zip(ids, labels) if l == IGNORE])
    assert prompt == "<s>### Instruction:\nReverse the word.\n\n### Input:\nabc\n\n### Response:\n"


def test_alpaca_without_input(tokenizer):
    ids, labels = tokenize.tokenize_row({"instruction": "Say hi.", "output": "hi"}, "alpaca", tokenizer, "alpaca")
    assert "### Input" not in tokenizer.decode(ids)
    assert decode_learned(tokenizer, ids, labels) == "hi</s>"


def test_alpaca_rows_take_the_tokenizers_chat_template(tokenizer):
    """data.alpaca_template chat (the default): an alpaca row is the conversation LLaMA-Factory's
    converter makes of it (system, history pairs, instruction + input as the user's turn),
    rendered by the tokenizer's template, which then stays the exported one; a tokenizer
    without a template keeps the alpaca layout, and with it the alpaca chat template."""
    row = {"system": "be brief", "history": [["Say hi.", "hi"]], "instruction": "Reverse the word.",
           "input": "abc", "output": "cba"}
    conversation = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say hi."},
                                 {"role": "assistant", "content": "hi"},
                                 {"role": "user", "content": "Reverse the word.\nabc"},
                                 {"role": "assistant", "content": "cba"}]}
    assert tokenize.tokenize_row(row, "alpaca", tokenizer) == tokenize.tokenize_row(conversation, "messages", tokenizer)
    assert chatlayout.trained_chat_template(("alpaca",), tokenizer) is None  # the tokenizer's own
    assert chatlayout.trained_chat_template(("alpaca", "messages"), tokenizer) is None
    assert chatlayout.trained_chat_template(("alpaca",), tokenizer, "alpaca") == chatlayout.ALPACA_CHAT_TEMPLATE
    assert chatlayout.trained_chat_template(("alpaca", "messages"), tokenizer, "alpaca") is None  # layouts mixed
    assert chatlayout.layouts(("alpaca", "messages"), tokenizer) == "alpaca/messages rows by the tokenizer's chat template"
    assert chatlayout.layouts(("alpaca", "messages"), tokenizer, "alpaca") == \
        "messages rows by the tokenizer's chat template; alpaca rows in the alpaca layout"
    assert chatlayout.layouts(("text",), tokenizer) == ""
    tokenizer.chat_template = None
    ids, labels = tokenize.tokenize_row(row, "alpaca", tokenizer)
    assert tokenizer.decode(ids).startswith("<s>be brief\n\n### Instruction:\nSay hi.")
    assert chatlayout.trained_chat_template(("alpaca",), tokenizer) == chatlayout.ALPACA_CHAT_TEMPLATE
    assert chatlayout.layouts(("alpaca",), tokenizer) == "alpaca rows in the alpaca layout"


def test_messages_learn_only_assistant_turns_with_chat_template(tokenizer):
    row = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
                        {"role": "assistant", "content": "6"}]}
    ids, labels = tokenize.tokenize_row(row, "messages", tokenizer)
    assert ids == list(tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False))
    assert decode_learned(tokenizer, ids, labels) == "4</s>\n6</s>\n"


MISTRAL_LIKE = ("{{ bos_token }}{% for m in messages if m.role != 'system' %}{% if m.role == 'user' %}[INST] "
                "{% if loop.last or (loop.revindex == 2 and messages[-1].role == 'assistant') %}"
                "{% for s in messages if s.role == 'system' %}{{ s.content }}\n\n{% endfor %}{% endif %}"
                "{{ m.content }} [/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")


def test_a_chat_template_that_rewrites_earlier_turns_is_a_bad_row(tmp_path, tokenizer):
    """Mistral's template puts the system prompt into the last user turn: a conversation's
    prefixes do not render as prefixes of it, so answer spans cannot be found. The row is
    refused by line (labels once slid off their tokens for every later packed example), and
    under skip_bad_rows skipped while single-turn rows still train."""
    tokenizer.chat_template = MISTRAL_LIKE
    single = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4"}]}
    multi = {"messages": single["messages"] + [{"role": "user", "content": "3+3?"},
                                               {"role": "assistant", "content": "6"}]}
    ids, labels = tokenize.tokenize_row(single, "messages", tokenizer)
    assert len(ids) == len(labels) and decode_learned(tokenizer, ids, labels) == "4</s>"
    path = write_jsonl(tmp_path / "d.jsonl", [single] * 30 + [multi])
    with pytest.raises(DataError, match=r"line 31: field `messages`: the tokenizer's chat template renders the first "
                                        r"4 turn\(s\) differently"):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 32)
    seqs = data.build_sequences([path], DataConfig(path=str(path), skip_bad_rows=True), tokenizer, 32)
    assert seqs.skipped_rows == 1
    learned = seqs.input_ids[seqs.labels != IGNORE]
    assert (learned == seqs.labels[seqs.labels != IGNORE]).all()  # every label sits on its own token


# A row with a system turn in each chat format, and the field a problem with its conversation is named by
SYSTEM_ROWS = [
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                   {"role": "assistant", "content": "a"}]}, r"messages"),
    ({"system": "s", "conversations": [{"from": "human", "value": "u"}, {"from": "gpt", "value": "a"}]},
     r"conversations"),
    ({"system": "s", "instruction": "u", "output": "a"},
     r"instruction/output as a conversation \(data.alpaca_template: chat; `alpaca` renders the alpaca layout\)"),
]


def assert_bad_row(tmp_path, tokenizer, row: dict, problem: str) -> None:
    """`row`, alone in a file, is refused as a bad row on its line with `problem` (a pattern)."""
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(DataError, match=rf"line 1: {problem}"):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 32)


@pytest.mark.parametrize("row, field_name", SYSTEM_ROWS, ids=["messages", "sharegpt", "alpaca"])
def test_a_chat_template_that_raises_is_a_bad_row_named_by_its_own_field(tmp_path, tokenizer, row, field_name):
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role "
                               "not supported') }}{% endif %}{{ m.content }}{% endfor %}")
    assert_bad_row(tmp_path, tokenizer, row, rf"field `{field_name}`: the tokenizer's chat template refused it: "
                                             r"System role not supported")


@pytest.mark.parametrize("row, field_name", SYSTEM_ROWS, ids=["messages", "sharegpt", "alpaca"])
def test_a_chat_template_that_leaves_the_system_turn_out_is_a_bad_row(tmp_path, tokenizer, row, field_name):
    """A template that renders only user and assistant turns trained every row without its
    system prompt, without a word; rows without one still train."""
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role != 'system' %}{{ m.role }}: {{ m.content }}\n"
                               "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    assert_bad_row(tmp_path, tokenizer, row, rf"field `{field_name}`: the tokenizer's chat template leaves a system "
                                             r"turn out .* use a template that renders it \(model.chat_template\)")
    no_system = {key: value[1:] if key == "messages" else value for key, value in row.items() if key != "system"}
    ids, labels = tokenize.tokenize_row(no_system, tokenize.row_format(no_system), tokenizer)
    assert tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE]).startswith("a")
    # the same rows under a template that writes the system turn train with it
    tokenizer.chat_template = tokenizer.chat_template.replace("{% if m.role != 'system' %}", "{% if true %}")
    ids, _ = tokenize.tokenize_row(row, tokenize.row_format(row), tokenizer)
    assert tokenizer.decode(ids).startswith("system: s\nuser: u")


def test_messages_without_chat_template(tokenizer):
    tokenizer.chat_template = None
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ids, labels = tokenize.tokenize_row(row, "messages", tokenizer)
    assert decode_learned(tokenizer, ids, labels) == "yo</s>"
    assert tokenizer.decode(ids) == "<s>user:\nhi</s>assistant:\nyo</s>"


def test_alpaca_system_and_history_are_trained_as_llama_factory_reads_them(tokenizer):
    row = {"instruction": "And times 3?", "input": "", "output": "0", "system": "You are a calculator.",
           "history": [["What is 0*2?", "0"]]}
    ids, labels = tokenize.tokenize_row(row, "alpaca", tokenizer, "alpaca")
    assert tokenizer.decode(ids) == ("<s>You are a calculator.\n\n### Instruction:\nWhat is 0*2?\n\n### Response:\n0</s>"
                                     "### Instruction:\nAnd times 3?\n\n### Response:\n0</s>")
    assert decode_learned(tokenizer, ids, labels) == "0</s>0</s>"  # both answers, prompts and system masked
    conversation = [{"role": "system", "content": row["system"]}, {"role": "user", "content": "What is 0*2?"},
                    {"role": "assistant", "content": "0"}, {"role": "user", "content": row["instruction"]},
                    {"role": "assistant", "content": "0"}]
    rendered = tokenizer.apply_chat_template(conversation, chat_template=chatlayout.ALPACA_CHAT_TEMPLATE, tokenize=True,
                                             return_dict=False)
    assert list(rendered) == ids  # the exported template prompts as training read it
    with pytest.raises(RowError, match="history.*pairs"):
        tokenize.tokenize_row(row | {"history": ["What is 0*2?"]}, "alpaca", tokenizer)


def test_sharegpt_rows_are_conversations(tmp_path, tokenizer):
    """LLaMA-Factory's sharegpt: {conversations: [{from, value}], system?}, human/gpt/observation/
    function_call; the same speaker names inside `messages` are read the same way."""
    share = {"system": "be brief", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                                                      {"from": "human", "value": "3+3?"}, {"from": "gpt", "value": "6"}]}
    plain = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
                          {"role": "assistant", "content": "6"}]}
    assert tokenize.tokenize_row(share, "sharegpt", tokenizer) == tokenize.tokenize_row(plain, "messages", tokenizer)
    named = {"messages": [{"role": "human", "content": "2+2?"}, {"role": "gpt", "content": "4"}]}
    assert decode_learned(tokenizer, *tokenize.tokenize_row(named, "messages", tokenizer)) == "4</s>\n"
    path = write_jsonl(tmp_path / "d.jsonl", [share] * 3)
    seqs = data.build_sequences([path], DataConfig(path=str(path), packing=False), tokenizer, 64)
    assert len(seqs) == 3 and seqs.formats == ("sharegpt",)
    tools = {"messages": [{"role": "user", "content": "weather?"},
                          {"role": "function_call", "content": '{"name": "get", "arguments": {}}'},
                          {"role": "observation", "content": "sun"}, {"role": "assistant", "content": "sunny"}]}
    tokenizer.chat_template = None
    assert decode_learned(tokenizer, *tokenize.tokenize_row(tools, "messages", tokenizer)) == \
        '{"name": "get", "arguments": {}}</s>sunny</s>'


def test_turns_are_read_under_either_naming(tokenizer):
    """Published datasets mix the namings: `conversations` of {role, content}, `messages` of
    {from, value} (LLaMA-Factory maps them with dataset_info.json's role_tag / content_tag);
    each turn is read under the keys it holds. A turn with neither is a bad row naming the
    format's own."""
    tokenizer.chat_template = CHATML
    plain = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    expected = tokenize.tokenize_row(plain, "messages", tokenizer)
    conversations = {"conversations": plain["messages"]}
    assert tokenize.row_format(conversations) == "sharegpt"
    assert tokenize.tokenize_row(conversations, "sharegpt", tokenizer) == expected
    shared = {"messages": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}
    assert tokenize.tokenize_row(shared, "messages", tokenizer) == expected
    mixed = {"messages": [{"from": "human", "value": "2+2?"}, {"role": "assistant", "content": "4"}]}
    assert tokenize.tokenize_row(mixed, "messages", tokenizer) == expected
    with pytest.raises(RowError, match=r"messages\[1\]`: expected \{role: str, content: str\}"):
        tokenize.tokenize_row({"messages": [plain["messages"][0], {"speaker": "gpt", "text": "4"}]}, "messages",
                          tokenizer)
    with pytest.raises(RowError, match=r"conversations\[0\].role`: unknown speaker 'model'"):
        tokenize.tokenize_row({"conversations": [{"role": "model", "content": "4"}]}, "sharegpt", tokenizer)


def test_unknown_speakers_are_bad_rows_and_text_parts_are_joined(tokenizer):
    """A chat template renders the roles it knows and skips any other without a word (a typo's
    turn vanished from training): a bad row naming the roles. OpenAI's content parts are text."""
    tokenizer.chat_template = CHATML
    typo = {"conversations": [{"from": "human", "value": "q1"}, {"from": "model", "value": "a1"},
                              {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]}
    with pytest.raises(RowError, match=r"conversations\[1\].from`: unknown speaker 'model'.*use system, user"):
        tokenize.tokenize_row(typo, "sharegpt", tokenizer)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]},
                          {"role": "assistant", "content": "4"}]}
    plain = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    assert tokenize.tokenize_row(parts, "messages", tokenizer) == tokenize.tokenize_row(plain, "messages", tokenizer)
    parts["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": "x.png"}})
    with pytest.raises(RowError, match=r"messages\[0\].content`: only text parts .* not image_url"):
        tokenize.tokenize_row(parts, "messages", tokenizer)


# A tool-calling template in the way Qwen2.5's and Llama 3.1's are: tools offered in a system
# turn, calls as tagged JSON after the assistant's text, a tool's answer in its own turn.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
    "<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                                   "parameters": {"type": "object",
                                                                  "properties": {"city": {"type": "string"}}}}}]


def tool_row(arguments, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                           "arguments": arguments}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                         {"role": "assistant", "content": "It is sunny."}], **extra}


def test_a_mapped_conversation_column_keeps_tool_calls_system_and_tools(tmp_path, tokenizer):
    """OpenAI-style messages under another column name (data.columns {messages: chat}) read as
    the messages format: tool calls learned as they are under `messages` (they were dropped:
    the column was read as ShareGPT turns); a `system` column opens the conversation unless it
    opens with its own system turn; an alpaca row's tools column is offered by the template."""
    tokenizer.chat_template = TOOL_TEMPLATE
    row = tool_row('{"city": "Paris"}', tools=WEATHER_TOOLS)
    path = write_jsonl(tmp_path / "o.jsonl", [{"chat": row["messages"], "tools": WEATHER_TOOLS}])
    read = tokenize.read_examples([path], DataConfig(path="x", columns={"messages": "chat"}), tokenizer)[0]
    assert read == [tokenize.tokenize_row(row, "messages", tokenizer)]
    assert "<tool_call>get_weather" in decode_learned(tokenizer, *read[0])
    with_system = tokenize.tokenize_row({**row, "system": "be brief"}, "messages", tokenizer)
    assert tokenizer.decode(with_system[0]).count("<|im_start|>system\nbe brief<|im_end|>") == 1
    own_turn = {"role": "system", "content": "mine"}
    ids, _ = tokenize.tokenize_row({"messages": [own_turn, *row["messages"]], "system": "theirs"}, "messages",
                                     tokenizer)
    assert "mine" in tokenizer.decode(ids) and "theirs" not in tokenizer.decode(ids)
    alpaca = {"instruction": "weather in Paris?", "output": "sunny", "tools": WEATHER_TOOLS}
    assert "Tools: get_weather" in tokenizer.decode(tokenize.tokenize_row(alpaca, "alpaca", tokenizer)[0])
    with pytest.raises(RowError, match="the alpaca layout has no place for tools"):
        tokenize.tokenize_row(alpaca, "alpaca", tokenizer, alpaca_template="alpaca")
    # data.format sharegpt (LLaMA-Factory's formatting) over OpenAI-style rows: the file's columns said
    with pytest.raises(DataError, match=r"o\.jsonl has no conversations column for data\.format sharegpt; its "
                                        r"columns are chat, tools: set data\.format: auto"):
        tokenize.read_examples([path], DataConfig(path="x", format="sharegpt"), tokenizer)
    # ... as the file names them, where data.columns renamed some (they were said by the fields' names)
    renamed = write_jsonl(tmp_path / "q.jsonl", [{"q": "hi", "a": "ho"}])
    with pytest.raises(DataError, match=r"q\.jsonl has no conversations column for data\.format sharegpt; its "
                                        r"columns are a, q: set data\.format: auto"):
        tokenize.read_examples([renamed], DataConfig(path="x", format="sharegpt",
                                                       columns={"prompt": "q", "response": "a"}), tokenizer)


def test_tool_calls_are_learned_through_the_chat_template(tmp_path, tokenizer):
    """OpenAI function calling in messages rows: the assistant's call is learned as the model's
    template writes it (arguments given as OpenAI's JSON string become the object templates
    expect), the tool's answer and the offered tools are prompt; a file mixing argument shapes
    (datasets unifies them into one struct, filling in null keys) trains each row's own."""
    tokenizer.chat_template = TOOL_TEMPLATE
    ids, labels = tokenize.tokenize_row(tool_row('{"city": "Paris"}', tools=WEATHER_TOOLS), "messages", tokenizer)
    assert decode_learned(tokenizer, ids, labels) == (
        '<tool_call>get_weather {"city": "Paris"}</tool_call><|im_end|>\nIt is sunny.<|im_end|>\n')
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nTools: get_weather<|im_end|>")
    assert "sunny<|im_end|>" in tokenizer.decode(ids)
    as_object = tokenize.tokenize_row(tool_row({"city": "Paris"}, tools=json.dumps(WEATHER_TOOLS)), "messages", tokenizer)
    assert as_object == (ids, labels)  # LLaMA-Factory's tools: a JSON string
    other = tool_row({"days": 3})
    other["messages"][1]["tool_calls"][0]["function"]["name"] = "get_forecast"
    path = write_jsonl(tmp_path / "d.jsonl", [tool_row({"city": "Paris"}, tools=WEATHER_TOOLS), other])
    seqs = data.build_sequences([path], DataConfig(path=str(path), packing=False), tokenizer, 256)
    learned = [decode_learned(tokenizer, i, l) for i, l in zip(seqs.input_ids, seqs.labels)]
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in learned[0]
    assert '<tool_call>get_forecast {"days": 3}</tool_call>' in learned[1] and "null" not in learned[1]


# Qwen2.5's way with tool answers: consecutive ones share one user turn, which the last closes.
GROUPED_TOOL_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
    "<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_parallel_tool_answers_a_template_groups_are_prompt(tokenizer):
    """Two calls in one turn answered by two tool turns, which the template joins into one user
    turn (the first answer alone would be closed, so a prefix ending there is not the whole's
    start): both answers are prompt, both calls and the final answer learned."""
    tokenizer.chat_template = GROUPED_TOOL_TEMPLATE
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": {}}} for name in ("get_weather", "get_time")]}
    row = {"messages": [{"role": "user", "content": "weather and time?"}, call,
                        {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "noon"},
                        {"role": "assistant", "content": "Sunny, at noon."}, {"role": "user", "content": "thanks"}]}
    ids, labels = tokenize.tokenize_row(row, "messages", tokenizer)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(row["messages"], tokenize=False)
    assert decode_learned(tokenizer, ids, labels) == (
        "<tool_call>get_weather</tool_call><tool_call>get_time</tool_call><|im_end|>\nSunny, at noon.<|im_end|>\n")
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon" in \
        tokenizer.decode(ids)


def test_sharegpt_function_calls_are_tool_calls(tokenizer):
    """LLaMA-Factory's ShareGPT tool rows (a function_call turn holding the call's JSON, one call
    or a list, an observation answering it, a `tools` column) train as the same OpenAI messages
    do: the model's template writes the call. A function_call turn that is not a call is a bad row."""
    tokenizer.chat_template = TOOL_TEMPLATE
    call = {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})}
    share = {"conversations": [{"from": "human", "value": "weather in Paris?"}, call,
                               {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "It is sunny."}],
             "tools": json.dumps(WEATHER_TOOLS)}
    assert tokenize.tokenize_row(share, "sharegpt", tokenizer) == \
        tokenize.tokenize_row(tool_row({"city": "Paris"}, tools=WEATHER_TOOLS), "messages", tokenizer)
    call["value"] = json.dumps([{"name": "get_weather", "arguments": {"city": c}} for c in ("Paris", "Rome")])
    learned = decode_learned(tokenizer, *tokenize.tokenize_row(share, "sharegpt", tokenizer))
    assert learned.startswith('<tool_call>get_weather {"city": "Paris"}</tool_call><tool_call>get_weather '
                              '{"city": "Rome"}</tool_call>')
    for value, problem in (("get_weather(Paris)", "not JSON"), ('{"city": "Paris"}', "holds the call as JSON")):
        call["value"] = value
        with pytest.raises(RowError, match=f"conversations\\[1\\].value`: .*{problem}"):
            tokenize.tokenize_row(share, "sharegpt", tokenizer)


def test_tool_calls_without_a_template_that_renders_them(tmp_path, tokenizer):
    """A template without function calling would drop the call (an empty turn learned): a bad row
    naming the fix. Without any template the `role:` layout writes calls as JSON lines."""
    tokenizer.chat_template = CHATML
    with pytest.raises(RowError, match="does not render function calling \\(call get_weather"):
        tokenize.tokenize_row(tool_row('{"city": "Paris"}'), "messages", tokenizer)
    with pytest.raises(RowError, match="tool get_weather"):
        tokenize.tokenize_row({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                           "tools": WEATHER_TOOLS}, "messages", tokenizer)
    tokenizer.chat_template = None
    ids, labels = tokenize.tokenize_row(tool_row('{"city": "Paris"}'), "messages", tokenizer)
    assert decode_learned(tokenizer, ids, labels) == '{"name": "get_weather", "arguments": {"city": "Paris"}}</s>' \
                                                     'It is sunny.</s>'
    for calls, where in (("get_weather()", "messages[1].tool_calls"), ([{"function": {}}], "tool_calls[0]")):
        row = tool_row("{}")
        row["messages"][1]["tool_calls"] = calls
        with pytest.raises(RowError, match=where.replace("[", "\\[")):
            tokenize.tokenize_row(row, "messages", tokenizer)
    with pytest.raises(RowError, match="arguments`: not JSON"):
        tokenize.tokenize_row(tool_row("{city: Paris}"), "messages", tokenizer)


def test_a_conversation_opening_with_the_assistant_is_a_bad_row(tmp_path, tokenizer):
    """With a chat template, nothing prompts an opening assistant turn (and templates add their
    default system prompt before it): a row error by line, not apply_chat_template's traceback."""
    good = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    odd = {"messages": [{"role": "assistant", "content": "Hi!"}] + good["messages"]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, odd])
    with pytest.raises(DataError, match=r"d.jsonl, line 3: field `messages`: the conversation opens with an assistant "
                                        r"turn.*\(messages format\); fix the row"):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 32)
    seqs = data.build_sequences([path], DataConfig(path=str(path), skip_bad_rows=True, packing=False), tokenizer, 32)
    assert (len(seqs), seqs.skipped_rows) == (2, 1)


def test_rows_of_several_formats_in_one_file(tmp_path, tokenizer):
    """Each row is read by its own fields; a row that fits none is read as the file's usual
    format, so the error names what it lacks (it named line 1, the first of the usual rows)."""
    alpaca = {"instruction": "i", "output": "o"}
    rows = [alpaca] * 5 + [{"text": "plain"}, {"messages": [{"role": "user", "content": "q"},
                                                             {"role": "assistant", "content": "a"}]}] + [alpaca] * 3
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    seqs = data.build_sequences([path], DataConfig(path=str(path), packing=False), tokenizer, 64)
    assert len(seqs) == 10 and seqs.formats == ("alpaca", "text", "messages")
    write_jsonl(path, rows + [{"instruction": "no answer"}])
    with pytest.raises(DataError, match=r"line 11: field `output`: missing \(alpaca format\)"):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 64)


def test_tokenizing_says_its_progress_on_rank_0_only(tmp_path, tokenizer, monkeypatch, capsys):
    """100k rows tokenized for half a minute with nothing on the screen: a plain line every 5 s
    where stderr is no terminal (rows done, rate, ETA); nothing from the other ranks."""
    from zerofit.core import console

    clock = iter(range(0, 10_000, 6))  # every look at the clock 6 s after the one before
    monkeypatch.setattr(console.time, "monotonic", lambda: next(clock))
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(3)])
    tokenize.read_examples([path], DataConfig(path=str(path)), tokenizer, console.Shown(True, bar=True))
    said = capsys.readouterr().err.splitlines()
    assert said[:3] == [f"tokenizing d.jsonl {n}/3 rows (0.17/s, ETA {console.clock(6 * (3 - n))})" for n in (1, 2, 3)]
    tokenize.read_examples([path], DataConfig(path=str(path)), tokenizer, console.Shown(False, bar=True))
    tokenize.read_examples([path], DataConfig(path=str(path)), tokenizer)
    assert capsys.readouterr().err == ""
