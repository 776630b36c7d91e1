"""The embedded default: a tiny Llama-architecture model, a character tokenizer built
locally with `tokenizers`, and a synthetic instruction set a tiny model can learn.
`zerofit train` with no arguments runs zerofit/demo/config.yaml on these."""
from __future__ import annotations

import json
import random
from pathlib import Path

DEMO_DIR = Path(__file__).parent
DEMO_DATA = DEMO_DIR / "data.jsonl"
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
# A chat template so that `messages` rows work with the demo tokenizer too.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}:\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:\n{% endif %}"
)


def build_tokenizer():
    """Character-level tokenizer: 4 specials + printable ASCII + newline (100 ids)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate(SPECIALS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 4096
    return tokenizer


# ------------------------------------------------------------------- synthetic tasks
# One line each, so that `zerofit chat` asks them as they were trained ("length: zerofit").
# A tiny model learns `length` within the demo's steps; the copying tasks need longer.
def _add(rng: random.Random) -> dict:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return {"instruction": f"add: {a} + {b}", "output": str(a + b)}


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 7)))


def _reverse(rng: random.Random) -> dict:
    w = _word(rng)
    return {"instruction": f"reverse: {w}", "output": w[::-1]}


def _upper(rng: random.Random) -> dict:
    w = _word(rng)
    return {"instruction": f"capitals: {w}", "output": w.upper()}


def _sort(rng: random.Random) -> dict:
    w = _word(rng)
    return {"instruction": f"sort: {w}", "output": "".join(sorted(w))}


def _count(rng: random.Random) -> dict:
    w = _word(rng)
    return {"instruction": f"length: {w}", "output": str(len(w))}


TASKS = (_add, _reverse, _upper, _sort, _count)


def make_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [rng.choice(TASKS)(rng) for _ in range(n)]


def write_data(path: Path = DEMO_DATA, n: int = 4000, seed: int = 0) -> Path:
    """Regenerate the bundled file: `python -m zerofit.demo`."""
    path.write_text("".join(json.dumps(row) + "\n" for row in make_rows(n, seed)))
    return path
