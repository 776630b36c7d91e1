"""Compare zerofit's bundled chat templates (tokenize_row) with LLaMA-Factory 0.9.5's
Template.encode_multiturn: text, token ids and learned tokens, on six offline tokenizers
(character-level, byte-level BPE with GPT-2's and Llama-3's split, SentencePiece-like ones).
LLaMA-Factory in a venv of its own, beside this environment's packages:
  python -m venv --system-site-packages /tmp/lfvenv && /tmp/lfvenv/bin/pip install --no-deps llamafactory==0.9.5
  # (or the wheel's path in place of llamafactory==0.9.5, offline)
  # its import wants torchaudio (for audio data only): an empty module stands in where no wheel fits torch
  mkdir -p /tmp/lfvenv/lib/python3.11/site-packages/torchaudio && touch $_/__init__.py
  /tmp/lfvenv/bin/python bench/lf_templates.py > bench/results/lf_templates.txt
Rows with tool calls, observations and a tools list (TOOL_CONVS) are compared as well: every bundled
template renders them (llama3, mistral, qwen, qwen3_nothink in their own tool formats, the other eight in
LLaMA-Factory's `default` one); a row zerofit refuses shows as "zerofit RowError" with its reason.
The summary at the end says per tokenizer and template: identical, or what differs."""
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llamafactory.data.template import TEMPLATES
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as tkm
from transformers import PreTrainedTokenizerFast

from zerofit import models as zmodels
from zerofit.data.conversations import RowError
from zerofit.data.tokenize import IGNORE, tokenize_row
from zerofit.demo import build_tokenizer

NAMES = ["alpaca", "chatml", "default", "empty", "gemma", "llama2", "llama3", "mistral", "phi", "qwen",
         "qwen3_nothink", "vicuna"]
MARKERS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<start_of_turn>", "<end_of_turn>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>",
           "[INST]", "[/INST]"]
BASE_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]

CORPUS = [
    "Hi there", "Hello! How can I help?", "You are terse.", "What is 2+2?", "It is 4.",
    "Thanks.\n\nBye.", "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n", "### Instruction:\n", "\n\n### Response:\n", "Human: ", "\nAssistant:",
    "System: ", "USER: ", " ASSISTANT:", "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions.",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", "<<SYS>>\n", "\n<</SYS>>\n\n",
    "user\n", "assistant\n", "system\n", "model\n", "\n\n", " Hello", " It", "line one\n\nline two\n",
    "The quick brown fox jumps over the lazy dog. " * 3, "Sure.\n", "ASSISTANT:Hello", "Assistant:Hello",
    "\n\n\n", ".\n\n", "!\n\n", "?\n\n", "[INST] x [/INST] y", "More?", "Mmm",
]


def wrap(core, name, markers=MARKERS):
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": markers})
    tok.name_for_report = name
    return tok


def char_tok():
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.name_for_report = "char (zerofit demo)"
    return tok


def bpe(pre, decoder, name, normalizer=None, markers=MARKERS):
    core = Tokenizer(tkm.BPE(unk_token="<unk>"))
    if pre is not None:
        core.pre_tokenizer = pre
    core.decoder = decoder
    if normalizer is not None:
        core.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=BASE_SPECIALS + markers, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
                                  if isinstance(pre, (pre_tokenizers.ByteLevel, pre_tokenizers.Sequence)) else [])
    core.train_from_iterator(CORPUS * 50, trainer=trainer)
    return wrap(core, name, markers)


QWEN_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
              r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def tokenizers_to_try():
    yield char_tok()
    yield bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), "BPE gpt2-bytelevel")
    yield bpe(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_REGEX), behavior="isolated"),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
              decoders.ByteLevel(), "BPE qwen2/llama3-regex bytelevel")
    yield bpe(pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first"),
              decoders.Metaspace(replacement="\u2581", prepend_scheme="first"), "BPE metaspace (sentencepiece-like)")
    # Llama-2 / Mistral-v0.1 hub tokenizer.json style ("legacy"): normalizer Prepend(▁)+Replace, no pre-tokenizer;
    # once with [INST]/[/INST] as special tokens, once as plain text (as in the real Llama-2 vocabulary)
    from tokenizers import normalizers
    llama_dec = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    for markers, tag in ((MARKERS, "[INST] special"), ([m for m in MARKERS if "INST" not in m], "[INST] plain text")):
        yield bpe(None, llama_dec, f"BPE llama2-legacy normalizer, {tag}",
                  normalizer=normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]),
                  markers=markers)


U, A = "user", "assistant"
CONVS = {
    "one exchange, no system": (None, [(U, "Hi there"), (A, "Hello! How can I help?")]),
    "with system": ("You are terse.", [(U, "Hi there"), (A, "Hello! How can I help?")]),
    "two exchanges, no system": (None, [(U, "Hi there"), (A, "Hello!"), (U, "What is 2+2?"), (A, "It is 4.")]),
    "two exchanges, system": ("You are terse.", [(U, "Hi there"), (A, "Hello!"), (U, "What is 2+2?"),
                                                  (A, "It is 4.")]),
    "empty-string system": ("", [(U, "Hi there"), (A, "Hello! How can I help?")]),
    "answers end in newline": (None, [(U, "Hi"), (A, "Sure.\n"), (U, "More?"), (A, "line one\n\nline two\n")]),
}
# Function calling, in LLaMA-Factory's roles (function: the call's JSON, learned; observation: the
# tool's answer, prompt) with a tools list; zerofit gets them as OpenAI tool_calls / tool turns.
F, O = "function", "observation"
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOOL_CONVS = {
    "tool call, observation, answer; tools": (None, [(U, "Weather in Paris?"), (F, [CALL]), (O, '{"temp_c": 21}'),
                                                     (A, "It is sunny.")], [WEATHER_TOOL]),
    "tool call with system and a bare tool schema": ("You are terse.", [(U, "Weather in Paris?"), (F, [CALL]),
                                                                         (O, "sunny"), (A, "It is sunny.")],
                                                     [WEATHER_TOOL["function"]]),
    "two parallel calls": (None, [(U, "Weather in Paris and Rome?"),
                                  (F, [CALL, {"name": "get_weather", "arguments": {"city": "Rome"}}]),
                                  (O, "sunny"), (A, "Both sunny.")], [WEATHER_TOOL]),
    "tool call, no tools list": (None, [(U, "Weather in Paris?"), (F, [CALL]), (O, "sunny"), (A, "It is sunny.")],
                                 None),
    # the default tool prompt's branches (required, enum, items, descriptions, a tool without arguments),
    # calls in two exchanges, non-ASCII text and arguments
    "two tools, a call in each of two exchanges": (
        "Sé breve.", [(U, "Météo à Zürich?"), (F, [{"name": "get_weather", "arguments": {"city": "Zürich",
                                                                                         "days": [1, 2]}}]),
                      (O, "sonnig"), (A, "Sonnig."), (U, "Und die Zeit?"), (F, [{"name": "get_time", "arguments": {}}]),
                      (O, "12:00"), (A, "Mittag.")],
        [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "description": "The city"},
                                             "unit": {"type": "string", "enum": ["C", "F"]},
                                             "days": {"type": "array", "items": {"type": "integer"},
                                                      "description": "Days ahead"}},
            "required": ["city", "days"]}}},
         {"name": "get_time", "description": "Time now", "parameters": {"type": "object", "properties": {}}}]),
}

ALL_CONVS = {**{c: (system, turns, None) for c, (system, turns) in CONVS.items()}, **TOOL_CONVS}


def lf_encode(template, tok, system, turns, tools=None):
    msgs = [{"role": r, "content": json.dumps(c[0] if len(c) == 1 else c) if r == F else c} for r, c in turns]
    pairs = template.encode_multiturn(tok, msgs, system, json.dumps(tools) if tools else None)
    ids, labels = [], []
    for p, r in pairs:
        ids += p + r
        labels += [IGNORE] * len(p) + r
    return ids, labels


def zf_message(role, content):
    if role == F:
        return {"role": A, "content": None, "tool_calls": [{"type": "function", "function": call} for call in content]}
    return {"role": "tool" if role == O else role, "content": content}


def zf_encode(tok, system, turns, tools=None):
    msgs = ([{"role": "system", "content": system}] if system is not None else []) + \
           [zf_message(r, c) for r, c in turns]
    return tokenize_row({"messages": msgs, **({"tools": tools} if tools else {})}, "messages", tok)


def learned_text(tok, ids, labels):
    """Learned spans, each decoded, as a list."""
    spans, cur = [], []
    for t, l in zip(ids, labels):
        if l != IGNORE:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur)); cur = []
    if cur:
        spans.append(tok.decode(cur))
    return spans


def main():
    summary = {}
    for base in tokenizers_to_try():
        tname = base.name_for_report
        print(f"\n#################### tokenizer: {tname} (vocab {len(base)})")
        for name in NAMES:
            template = TEMPLATES[name]
            lf_tok = copy.deepcopy(base)
            before = (lf_tok.eos_token, lf_tok.eos_token_id, lf_tok.pad_token, len(lf_tok))
            template.fix_special_tokens(lf_tok)
            after = (lf_tok.eos_token, lf_tok.eos_token_id, lf_tok.pad_token, len(lf_tok))
            fix_note = "" if before == after else f"fix_special_tokens: (eos, eos_id, pad, len) {before} -> {after}"
            zf_tok = zmodels.with_chat_template(copy.deepcopy(base), name)
            for cname, (system, turns, tools) in ALL_CONVS.items():
                key = (tname, name, cname)
                lf_ids, lf_labels = lf_encode(template, lf_tok, system, turns, tools)
                try:
                    zf_ids, zf_labels = zf_encode(zf_tok, system, turns, tools)
                except RowError as e:
                    summary[key] = "zerofit RowError"
                    print(f"--- [{tname}] {name} / {cname}: zerofit REFUSED the row: {e}")
                    print(f"    LF text: {lf_tok.decode(lf_ids)!r}")
                    continue
                lf_text, zf_text = lf_tok.decode(lf_ids), zf_tok.decode(zf_ids)
                same_text, same_ids, same_labels = lf_text == zf_text, lf_ids == zf_ids, lf_labels == zf_labels
                if same_text and same_ids and same_labels:
                    summary[key] = "identical"
                    continue
                summary[key] = "differs: " + ", ".join(
                    w for w, ok in (("text", same_text), ("ids", same_ids), ("labels", same_labels)) if not ok)
                print(f"--- [{tname}] {name} / {cname}: {summary[key]}  {fix_note}")
                print(f"    LF text: {lf_text!r}")
                print(f"    ZF text: {zf_text!r}")
                if not same_ids:
                    k = next((i for i, (a, b) in enumerate(zip(lf_ids, zf_ids)) if a != b), min(len(lf_ids), len(zf_ids)))
                    print(f"    ids first differ at {k} (len LF {len(lf_ids)}, ZF {len(zf_ids)})")
                    print(f"      LF tokens from there: {lf_tok.convert_ids_to_tokens(lf_ids[k:k + 6])}")
                    print(f"      ZF tokens from there: {zf_tok.convert_ids_to_tokens(zf_ids[k:k + 6])}")
                print(f"    LF learned: {learned_text(lf_tok, lf_ids, lf_labels)!r}")
                print(f"    ZF learned: {learned_text(zf_tok, zf_ids, zf_labels)!r}")
            if fix_note:
                print(f"  [{tname}] {name}: {fix_note}")
    print("\n==================== SUMMARY")
    for tname in dict.fromkeys(k[0] for k in summary):
        print(f"\n{tname}")
        for name in NAMES:
            res = {c: summary[(tname, name, c)] for c in ALL_CONVS}
            if all(v == "identical" for v in res.values()):
                print(f"  {name:14s} identical ({len(res)} conversations)")
            else:
                for c, v in res.items():
                    if v != "identical":
                        print(f"  {name:14s} {c}: {v}")


if __name__ == "__main__":
    main()
