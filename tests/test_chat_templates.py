"""Chat templates (models.py, chatlayout.py, chat_templates/): the bundled ones as LLaMA-Factory lays rows out."""
import json

import pytest
from conftest import CHATML, decode_learned, write_jsonl

from zerofit.config.load import validate
from zerofit.core.errors import ConfigError
from zerofit.data import chatlayout, tokenize
from zerofit.data import pipeline as data
from zerofit.data.conversations import RowError
from zerofit.data.tokenize import IGNORE
from zerofit.models import BUNDLED_TEMPLATES as BUNDLED


def test_the_chat_templates_written_for_exports_render_what_training_read(tokenizer):
    """chat / transformers / vLLM prompt an export with its tokenizer's template: for alpaca
    rows and for messages rows without a template it is the layout tokenize_row trained on,
    token for token (chat used the tokenizer's unrelated template and `role: text` lines)."""
    row = {"instruction": "Reverse the word. abc", "output": "cba"}
    ids, labels = tokenize.tokenize_row(row, "alpaca", tokenizer, "alpaca")
    template = chatlayout.trained_chat_template(("alpaca",), tokenizer, "alpaca")
    conversation = [{"role": "user", "content": row["instruction"]}, {"role": "assistant", "content": "cba"}]
    render = lambda turns, prompt: list(tokenizer.apply_chat_template(  # noqa: E731
        turns, chat_template=template, tokenize=True, return_dict=False, add_generation_prompt=prompt))
    assert render(conversation, False) == ids
    assert render(conversation[:1], True) == [t for t, label in zip(ids, labels) if label == IGNORE]
    tokenizer.chat_template = None
    messages = {"messages": conversation}
    ids, labels = tokenize.tokenize_row(messages, "messages", tokenizer)
    template = chatlayout.trained_chat_template(("messages",), tokenizer)
    assert render(conversation, False) == ids
    assert render(conversation[:1], True) == [t for t, label in zip(ids, labels) if label == IGNORE]
    assert chatlayout.trained_chat_template(("text",), tokenizer) is None
    assert chatlayout.trained_chat_template(("alpaca", "messages"), tokenizer) is None


def test_a_model_that_would_not_learn_to_stop_is_named(tokenizer):
    """A ChatML template ends a turn with <|im_end|>: with EOS </s> and no generation config
    that lists <|im_end|>, the trained model talks past its turn; a tokenizer without EOS trains
    answers without an end. The demo's own layouts end every answer with EOS."""
    assert chatlayout.stop_problem(tokenizer, ("messages",)) is None and chatlayout.stop_problem(tokenizer, ("alpaca",)) is None
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    problem = chatlayout.stop_problem(tokenizer, ("messages",))
    assert problem.startswith("the tokenizer's chat template ends an assistant turn with") and "'</s>'" in problem
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert chatlayout.stop_problem(tokenizer, ("messages",), generation_eos={end_of_turn}) is None
    tokenizer.eos_token = "<|im_end|>"
    assert chatlayout.stop_problem(tokenizer, ("sharegpt",)) is None
    tokenizer.eos_token = None
    assert chatlayout.stop_problem(tokenizer, ("text",)).startswith("the tokenizer has no EOS token")


def test_model_chat_template_renders_the_rows_and_a_broken_one_is_named(tmp_path):
    """model.chat_template: a base model's tokenizer (or one whose template is not the one wanted)
    renders the conversations with the file's template; a template that does not parse is said
    with its line before any row is rendered."""
    from zerofit import models
    from zerofit.config.schema import ModelConfig

    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    tokenizer = models.load_tokenizer(ModelConfig(config="tiny", chat_template=str(template)))
    assert tokenizer.chat_template == CHATML
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ids, labels = tokenize.tokenize_row({"messages": turns}, "messages", tokenizer)
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfor")
    with pytest.raises(ConfigError, match=r"chatml.jinja, line 2: .*fix the template"):
        models.load_tokenizer(ModelConfig(config="tiny", chat_template=str(template)))
    with pytest.raises(ConfigError, match=r"model.chat_template='nowhere.jinja' is neither a file \(a relative "
                                          r"path is read from the working directory, .*\) nor a bundled template's "
                                          r"name; .* or one of alpaca, chatml, "):
        models.load_tokenizer(ModelConfig(config="tiny", chat_template="nowhere.jinja"))


# A system, two exchanges, as LLaMA-Factory's Template._encode lays them out: its register_template
# slots (src/llamafactory/data/template.py) written out by hand, the demo tokenizer's <s> and </s>
# for LLaMA-Factory's bos_token and eos_token slots.
LLAMAFACTORY_LAYOUTS = {
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
              "\n\nhello<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nbye<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nsee you<|eot_id|>",
    # Llama2Template: the system opens the first user turn
    "mistral": "<s>[INST] Be brief.\n\nhi[/INST] hello</s>[INST] bye[/INST] see you</s>",
    "llama2": "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nhi [/INST]hello</s><s>[INST] bye [/INST]see you</s>",
    "qwen": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
            "hello<|im_end|>\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\nsee you<|im_end|>\n",
    "alpaca": "Be brief.### Instruction:\nhi\n\n### Response:\nhello</s>\n\n### Instruction:\nbye\n\n"
              "### Response:\nsee you</s>\n\n",
}


@pytest.mark.parametrize("name", sorted(LLAMAFACTORY_LAYOUTS))
def test_a_bundled_template_lays_rows_out_as_llamafactory_does(name):
    """model.chat_template: llama3 (a base model's tokenizer has none): the rows train in
    LLaMA-Factory's layout of that name, its answers and their turn ends learned."""
    from zerofit import models
    from zerofit.config.schema import ModelConfig

    tokenizer = models.load_tokenizer(ModelConfig(config="tiny", chat_template=name))
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
             {"role": "assistant", "content": "see you"}]
    ids, labels = tokenize.tokenize_row({"messages": turns}, "messages", tokenizer)
    assert tokenizer.decode(ids) == LLAMAFACTORY_LAYOUTS[name]
    learned = tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE])
    ends = {"llama3": "<|eot_id|>", "mistral": "</s>", "llama2": "</s>", "qwen": "<|im_end|>\n", "alpaca": "</s>\n\n"}
    start = " " if name == "mistral" else ""
    assert learned == f"{start}hello{ends[name]}{start}see you{ends[name]}"


def test_a_row_whose_turns_the_tokenizer_joins_is_tokenized_turn_by_turn():
    """LLaMA-Factory's `empty` template puts the answer right after the question: a tokenizer
    that merges across that edge (vicuna's `ASSISTANT:` before a Llama-3 tokenizer's `:Hello`)
    leaves no token where the answer starts, and every such row was refused. Tokenized turn by
    turn instead, as LLaMA-Factory tokenizes every row; a row that needs no such cut keeps the
    whole text's tokens, which chat prompts get."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as token_models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(token_models.WordLevel(vocab={"<unk>": 0, "</s>": 1, "hi": 2, "ho": 3, "hiho": 4, "hohi": 5},
                                            unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = (BUNDLED / "empty.jinja").read_text()
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]
    assert tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False) == [4]  # 'hiho', one token
    assert tokenize.tokenize_row({"messages": turns}, "messages", tokenizer) == ([2, 3], [IGNORE, 3])
    # two exchanges and a question after them: every edge cut, only the answers learned
    turns += [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}, {"role": "user", "content": "hi"}]
    assert tokenize.tokenize_row({"messages": turns}, "messages", tokenizer) == \
        ([2, 3, 2, 3, 2], [IGNORE, 3, IGNORE, 3, IGNORE])


@pytest.mark.parametrize("name", ["alpaca", "chatml", "default", "empty", "gemma", "llama2", "llama3", "mistral", "phi",
                                  "qwen", "qwen3_nothink", "vicuna"])
def test_every_bundled_template_trains_plain_and_tool_rows(name):
    """Each name the config's doc lists is bundled (the package ships it) and renders a plain
    exchange, a call with the tool's answer and a tools list (the eight without a tool format of
    their own in LLaMA-Factory's `default` one: they refused tool rows); a role no template
    renders fails naming the template (tokenize_row refuses such a role before: ROLES)."""
    from jinja2.exceptions import TemplateError

    from zerofit import models
    from zerofit.config.schema import ModelConfig

    assert name in models.bundled_chat_templates() and name in ModelConfig.model_fields["chat_template"].description
    tokenizer = models.load_tokenizer(ModelConfig(config="tiny", chat_template=name))
    ids, labels = tokenize.tokenize_row({"instruction": "hi", "output": "hello"}, "alpaca", tokenizer)
    assert "hello" in tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE])
    ids, labels = tokenize.tokenize_row(WEATHER_CALL_ROW, "messages", tokenizer)
    assert "get_weather" in decode_learned(tokenizer, ids, labels) and "sunny" in tokenizer.decode(ids)
    with pytest.raises(TemplateError, match=f"the {name} template renders system, user, assistant and tool turns, "
                                            f"not narrator"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "narrator", "content": "x"}],
                                      tokenize=False)


WEATHER_SCHEMA = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                   "parameters": {"type": "object", "properties": {
                                                       "city": {"type": "string"}}}}}
WEATHER_CALL_ROW = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                                 {"role": "assistant", "content": None, "tool_calls": [
                                     {"type": "function", "function": {"name": "get_weather",
                                                                       "arguments": '{"city": "Paris"}'}}]},
                                 {"role": "tool", "content": "sunny"},
                                 {"role": "assistant", "content": "It is sunny."}],
                    "tools": [WEATHER_SCHEMA]}
# LLaMA-Factory 0.9.5's layouts of that row, written out from its source (data/template.py's
# llama3 and qwen slots; tool_utils.py's LLAMA3_TOOL_PROMPT / QWEN_TOOL_PROMPT and the
# function_formatters): the tools' JSON joins the system text, a call is the function slot, the
# tool's answer the observation slot (ipython header; <tool_response> in a user turn).
SCHEMA_INDENTED = """{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {
                    "type": "string"
                }
            }
        }
    }
}"""
LLAMA3_TOOL_LAYOUT = (
    "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
    "You have access to the following functions. To call a function, please respond with JSON for a function call. "
    'Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. '
    "Do not use variables.\n\n" + SCHEMA_INDENTED.replace("{", "{{").replace("}", "}}") + "\n\n<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
    '<|start_header_id|>assistant<|end_header_id|>\n\n{{"name": "get_weather", "parameters": {{"city": "Paris"}}}}<|eot_id|>'
    "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    "It is sunny.<|eot_id|>")
QWEN_TOOL_LAYOUT = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    "It is sunny.<|im_end|>\n")

# mistral (LF's Llama2Template): the tools after the system text, both inside the first [INST];
# calls always a JSON list; the tool's answer put in unquoted, as LF's observation slot does.
MISTRAL_TOOL_LAYOUT = (
    '[INST] [AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", "description": '
    '"Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]'
    '[/AVAILABLE_TOOLS]\n\nWeather in Paris?[/INST][TOOL_CALLS] [{"name": "get_weather", "arguments": '
    '{"city": "Paris"}}]</s>[TOOL_RESULTS] {"content": sunny}[/TOOL_RESULTS] It is sunny.</s>')


@pytest.mark.parametrize("name", ["llama3", "qwen", "mistral"])
def test_bundled_templates_render_tool_calls_as_llamafactory_does(name):
    """A call, the tool's answer and the tools offered, under the llama3, qwen and mistral templates, in
    LLaMA-Factory's layout (they were refused as bad rows). Learned: the call (LLaMA-Factory's
    function turn is a response) and the answer after it, not the tool's answer (its observation
    turn is prompt)."""
    from datetime import datetime

    from zerofit import models
    from zerofit.config.schema import ModelConfig

    tokenizer = models.load_tokenizer(ModelConfig(config="tiny", chat_template=name))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>",
                                                                "<|eot_id|>", "<|im_start|>", "<|im_end|>"]})
    ids, labels = tokenize.tokenize_row(WEATHER_CALL_ROW, "messages", tokenizer)
    today = datetime.now().strftime("%d %b %Y")  # LLaMA-Factory's Llama3ToolUtils dates the prompt so
    expected = {"llama3": tokenizer.bos_token + LLAMA3_TOOL_LAYOUT.format(date=today), "qwen": QWEN_TOOL_LAYOUT,
                "mistral": tokenizer.bos_token + MISTRAL_TOOL_LAYOUT}[name]
    assert tokenizer.decode(ids) == expected
    call = {"llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
            "qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
            "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>'}
    answer = {"llama3": "It is sunny.<|eot_id|>", "qwen": "It is sunny.<|im_end|>\n", "mistral": " It is sunny.</s>"}
    assert decode_learned(tokenizer, ids, labels) == call[name] + answer[name]  # "sunny" alone: the tool's, not learned
    parallel = json.loads(json.dumps(WEATHER_CALL_ROW))
    parallel["messages"][1]["tool_calls"].append({"type": "function", "function": {"name": "get_weather",
                                                                                    "arguments": {"city": "Rome"}}})
    learned = decode_learned(tokenizer, *tokenize.tokenize_row(parallel, "messages", tokenizer))
    parallel_call = {"llama3": '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                               '{"name": "get_weather", "parameters": {"city": "Rome"}}]<|eot_id|>',
                     "qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
                             '<|im_end|>\n',
                     "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                '{"name": "get_weather", "arguments": {"city": "Rome"}}]</s>'}
    assert learned == parallel_call[name] + answer[name]


# LLaMA-Factory 0.9.5's `default` tool format (tool_utils.py DefaultToolUtils), which its templates
# naming no tool format take (alpaca, chatml, default, empty, gemma, llama2, phi, vicuna): the texts
# below are its Template.encode_multiturn output for these rows, copied as they came (decoded), with
# the demo tokenizer. The tools' prompt ends the system text (alpaca's default one; gemma's system
# opens the first user turn, LF's Llama2Template), joined to it without a separator.
FORECAST_SCHEMA = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
DEFAULT_TOOL_PROMPT = (
    "You have access to the following tools:\n> Tool Name: get_weather\nTool Description: Weather of a city\n"
    "Tool Args:\n  - city (string, required): The city\n  - unit (string): , should be one of [C, F]\n\n"
    "Use the following format if using a tool:\n```\nAction: tool name (one of [get_weather])\n"
    'Action Input: the input to the tool, in a JSON format representing the kwargs (e.g. ```{"input": "hello world", '
    '"num_beams": 5}```)\n```\n')
DEFAULT_TOOL_LAYOUTS = {
    "alpaca": "Below is an instruction that describes a task. Write a response that appropriately completes the "
              "request.\n\n" + DEFAULT_TOOL_PROMPT + "### Instruction:\nWeather in Paris?\n\n### Response:\n"
              'Action: get_weather\nAction Input: {"city": "Paris"}</s>\n\n### Instruction:\nsunny\n\n'
              "### Response:\nIt is sunny.</s>\n\n",
    "gemma": "<s><start_of_turn>user\nBe brief." + DEFAULT_TOOL_PROMPT + "\n\nWeather in Paris?<end_of_turn>\n"
             '<start_of_turn>model\nAction: get_weather\nAction Input: {"city": "Paris"}<end_of_turn>\n'
             "<start_of_turn>tool\nsunny<end_of_turn>\n<start_of_turn>model\nIt is sunny.<end_of_turn>\n",
}


def learned_runs(tokenizer, ids, labels) -> list[str]:
    """Each run of learned tokens, decoded."""
    runs, run = [], []
    for token, label in zip(ids + [None], labels + [IGNORE]):
        if label != IGNORE:
            run.append(token)
        elif run:
            runs, run = runs + [tokenizer.decode(run)], []
    return runs


@pytest.mark.parametrize("name", sorted(DEFAULT_TOOL_LAYOUTS))
def test_templates_without_a_tool_format_render_llamafactorys_default_one(name):
    """alpaca and gemma (as the other six without a tool format of their own) render a call, the
    tool's answer and the tools offered as LLaMA-Factory does (they refused such rows): the call's
    `Action:` lines learned with the assistant turn's end, the tool's answer (its observation turn:
    the user's slot under alpaca, gemma's own `tool` turn) not; parallel calls one pair a line; a
    ShareGPT function_call / observation row trains the same."""
    from zerofit import models
    from zerofit.config.schema import ModelConfig

    tokenizer = models.load_tokenizer(ModelConfig(config="tiny", chat_template=name))
    row = json.loads(json.dumps(WEATHER_CALL_ROW))
    row["tools"] = [FORECAST_SCHEMA]
    if name == "gemma":
        row["messages"].insert(0, {"role": "system", "content": "Be brief."})
    ids, labels = tokenize.tokenize_row(row, "messages", tokenizer)
    assert tokenizer.decode(ids) == DEFAULT_TOOL_LAYOUTS[name]
    end = {"alpaca": "</s>\n\n", "gemma": "<end_of_turn>\n"}[name]
    call = 'Action: get_weather\nAction Input: {"city": "Paris"}'
    assert learned_runs(tokenizer, ids, labels) == [call + end, "It is sunny." + end]  # the observation between: prompt
    share = {"conversations": [{"from": m["role"], "value": m["content"]} for m in row["messages"]], "tools": row["tools"]}
    share["conversations"][-3] = {"from": "function_call", "value": json.dumps({"name": "get_weather",
                                                                                "arguments": {"city": "Paris"}})}
    share["conversations"][-2]["from"] = "observation"
    assert tokenize.tokenize_row(share, "sharegpt", tokenizer) == (ids, labels)
    row["messages"][-3]["tool_calls"].append({"type": "function", "function": {"name": "get_weather",
                                                                               "arguments": {"city": "Rome"}}})
    parallel = learned_runs(tokenizer, *tokenize.tokenize_row(row, "messages", tokenizer))
    assert parallel[0] == f'{call}\nAction: get_weather\nAction Input: {{"city": "Rome"}}{end}'


def test_the_default_tool_format_is_one_block_in_the_eight_templates():
    """The eight templates taking LLaMA-Factory's default tool format carry the same Jinja for it
    (a template is one self-contained file: the run's tokenizer and exports carry it)."""
    blocks = {}
    for file in BUNDLED.glob("*.jinja"):
        text = file.read_text()
        if "default_tool_prompt" in text:
            blocks[file.stem] = text[text.index("{#- Tool rows:"):text.rindex("{%- endmacro -%}")]
    assert sorted(blocks) == ["alpaca", "chatml", "default", "empty", "gemma", "llama2", "phi", "vicuna"]
    assert len(set(blocks.values())) == 1


@pytest.mark.parametrize("text, message", [
    ("", "is empty"),
    ("  \n", "is empty"),
    ("{{ 1/0 }}", r"fails on a user and an assistant turn \(ZeroDivisionError"),
    ("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}<|end|>{% endfor %}",
     "without the assistant's content, so nothing of it would be learned"),
    ("{\"chat_template\": 3}", None),  # written as .json below: not a template
])
def test_a_chat_template_that_cannot_train_is_named_before_any_row(tmp_path, text, message):
    """An empty file dropped the tokenizer's template for none; a template failing at render
    time, or leaving the answers out, failed (or learned only markup) row by row."""
    from zerofit import models
    from zerofit.config.schema import ModelConfig

    file = tmp_path / ("t.json" if message is None else "t.jinja")
    file.write_text(text)
    with pytest.raises(ConfigError, match=message or r'a \.json template holds \{"chat_template": "\.\.\."\}'):
        models.load_tokenizer(ModelConfig(config="tiny", chat_template=str(file)))


def test_chat_templates_as_transformers_compiles_them_and_json_files_are_read(tmp_path):
    """{% generation %} (transformers' assistant-mask tag) and {% continue %} (loop controls) are
    transformers' syntax: a plain jinja2 parse refused them. A chat_template.json is read."""
    from zerofit import models
    from zerofit.config.schema import ModelConfig

    generation = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                  "{% endgeneration %}{% else %}{% if m.role == 'tool' %}{% continue %}{% endif %}{{ m.content }}"
                  "{% endif %}\n{% endfor %}")
    (tmp_path / "g.jinja").write_text(generation)
    assert models.load_tokenizer(ModelConfig(config="tiny", chat_template=str(tmp_path / "g.jinja"))).chat_template \
        == generation
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": CHATML}))
    assert models.load_tokenizer(ModelConfig(config="tiny", chat_template=str(tmp_path / "chat_template.json"))
                                 ).chat_template == CHATML
    (tmp_path / "latin1.jinja").write_bytes(b'{{ "\xe9" }}')
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        models.load_tokenizer(ModelConfig(config="tiny", chat_template=str(tmp_path / "latin1.jinja")))


def test_a_template_failing_on_one_row_names_that_row(tokenizer):
    tokenizer.chat_template = CHATML.replace("{% endfor %}", "{% if m.content == 'boom' %}{{ 1/0 }}{% endif %}"
                                                             "{% endfor %}")
    turns = [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]
    with pytest.raises(RowError, match=r"failed on it \(ZeroDivisionError"):
        tokenize.tokenize_row({"messages": turns}, "messages", tokenizer)


def test_a_chat_template_counts_by_its_text_on_resume(tmp_path):
    """The run's numbers depend on the template's text: one edited in place is a change (it said
    nothing for text rows), one moved is none."""
    from zerofit.config.schema import changed_settings

    (tmp_path / "a.jinja").write_text(CHATML)
    (tmp_path / "b.jinja").write_text(CHATML)
    config = {"model": {"config": "tiny", "chat_template": str(tmp_path / "a.jinja")}, "train": {"max_steps": 1}}
    before = validate(config).fingerprinted()
    moved = validate({**config, "model": {"config": "tiny", "chat_template": str(tmp_path / "b.jinja")}})
    assert changed_settings(before, moved.fingerprinted()) == []
    (tmp_path / "a.jinja").write_text(CHATML.replace("im_", "IM_"))
    changes = changed_settings(before, validate(config).fingerprinted())
    assert len(changes) == 1 and changes[0].startswith("model.chat_template sha256 ")


def test_an_earlier_runs_template_does_not_stay_in_the_run_directory(tmp_path, tokenizer, capsys):
    from zerofit.models import hf_config
    from zerofit.train import runfiles

    config = validate({"run_dir": str(tmp_path), "model": {"config": "tiny"}, "train": {"max_steps": 1}})
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "chat_template.jinja").write_text(CHATML)  # an earlier run's
    tokenizer.chat_template = None
    runfiles.write_run_files(tmp_path, config, {}, tokenizer, hf_config(config.model), {})
    assert not (tmp_path / "model" / "chat_template.jinja").exists()


def test_a_chat_template_the_rows_do_not_use_is_said(tmp_path, tokenizer, capsys):
    from zerofit.train import datareport

    (tmp_path / "t.jinja").write_text(CHATML)
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": f"q {i}", "output": f"a {i}"} for i in range(20)])
    config = validate({"model": {"config": "tiny", "chat_template": str(tmp_path / "t.jinja")},
                       "train": {"max_steps": 1, "seq_len": 32},
                       "data": {"path": str(path), "alpaca_template": "alpaca"}})
    train_set, eval_set = data.load_splits(config.data, tokenizer, 32, 7, 4096)
    datareport.report_data(train_set, eval_set, config, tokenizer)
    assert "model.chat_template is not what the rows are laid out by (alpaca rows in the alpaca layout)" in \
        capsys.readouterr().err.replace("\n", " ")
