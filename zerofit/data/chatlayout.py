"""The chat layout a run trains and keeps, once its rows are tokenized: the chat template that
prompts the model as the rows trained it (the alpaca layout's or the `role:` lines', written into
the run's tokenizer and so into every export, where the tokenizer's own template is not what
the rows were laid out by), the layouts the data line names, the special token that ends an
assistant turn (listed among the generation config's end tokens), and why a model trained so
would not stop generating. Read off tokenizing, which lays the rows out: the formats it renders
as chat (chat_formats) and what an answer learns under the chat template (chat_template_spans);
tokenizing imports nothing from here."""
from __future__ import annotations

from jinja2.exceptions import TemplateError

from zerofit.data.conversations import RowError
from zerofit.data.tokenize import IGNORE, chat_formats, chat_template_spans

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


def turn_end_id(tokenizer, formats: tuple[str, ...], alpaca_template: str = "chat") -> int | None:
    """The special token that ends an assistant turn of the chat template the rows are laid out
    by, where that is not EOS (Llama-3's <|eot_id|>, ChatML's <|im_end|>): LLaMA-Factory makes it
    the tokenizer's EOS (its templates' replace_eos); zerofit lists it among the generation
    config's end tokens. None where the rows are not laid out by a template, or its turn learns
    EOS, or no special token."""
    learned = _answer_learned(tokenizer, formats, alpaca_template)
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special} - {tokenizer.pad_token_id}
    ends = [t for t in learned or () if t in special]
    return None if not ends or tokenizer.eos_token_id in learned else ends[-1]


def _answer_learned(tokenizer, formats: tuple[str, ...], alpaca_template: str) -> list[int] | None:
    """The tokens a plain exchange's answer learns under the chat template the rows are laid out
    by; None where they are not laid out by one, or it refuses the exchange (its rows said so)."""
    if not formats or not set(formats) <= chat_formats(tokenizer, alpaca_template) or not tokenizer.chat_template:
        return None
    try:
        ids, labels = chat_template_spans([{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "Hello"}], tokenizer)
    except (RowError, TemplateError, ValueError):
        return None
    return [t for t, label in zip(ids, labels) if label != IGNORE]


def stop_problem(tokenizer, formats: tuple[str, ...], generation_eos: set[int] = frozenset(),
                 alpaca_template: str = "chat") -> str | None:
    """Why a model trained on these rows would not stop generating, or None: the tokenizer has
    no EOS (answers are trained without an end, packed examples run into each other), or its
    chat template ends an assistant turn with a token that neither is EOS nor is one of the
    generation config's end tokens (`generation_eos`), so generation runs past the turn."""
    if tokenizer.eos_token_id is None:
        return ("the tokenizer has no EOS token: answers are trained without an end, so the model does not learn to "
                "stop, and packed examples run into each other; give it one (eos_token in tokenizer_config.json)")
    learned = _answer_learned(tokenizer, formats, alpaca_template)
    if learned is None:
        return None  # the alpaca and `role:` layouts end every answer with EOS themselves
    if {tokenizer.eos_token_id, *generation_eos} & set(learned):
        return None
    return (f"the tokenizer's chat template ends an assistant turn with {tokenizer.decode(learned[-3:])!r}, never "
            f"with the EOS token {tokenizer.eos_token!r}: a model trained on it stops only where generation lists "
            f"its turn's end token; add that token's id to eos_token_id in the model's generation_config.json, or "
            f"set the tokenizer's eos_token to it")
