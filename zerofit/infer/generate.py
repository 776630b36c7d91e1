"""`zerofit generate` / `zerofit chat`: greedy or sampled decoding of a model loaded within a
GPU budget (load.py), one prompt, a file of prompts in batches, or a chat with the chat template
the model trained."""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from zerofit.core.console import counted, say, warn
from zerofit.core.errors import ConfigError
from zerofit.infer.load import Loaded, describe, load


@dataclass
class Sampling:
    """Greedy unless temperature, top_p or top_k is set; temperature 0 is greedy whatever else is."""
    max_new_tokens: int = 128
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_new_tokens: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or (self.temperature is None and self.top_p is None and self.top_k is None)

    def generate_kwargs(self) -> dict:
        kwargs = {"max_new_tokens": self.max_new_tokens, "do_sample": not self.greedy}
        if self.min_new_tokens:
            kwargs["min_new_tokens"] = self.min_new_tokens
        if not self.greedy:
            kwargs.update({k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                                             ("top_k", self.top_k)) if v is not None})
        else:  # a generation_config.json with sampling defaults must not make greedy sample
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return kwargs



@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    seconds: float
    ended_at_eos: bool = False      # the model ended the sequence (else max_new_tokens did)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0



# ------------------------------------------------------------------------ generating
CACHE_BUCKET = 256  # static cache lengths are rounded up to this: one compiled graph serves many prompts


def run(loaded: Loaded, input_ids, sampling: Sampling, streamer=None, attention_mask=None) -> tuple[object, float]:
    """Generate after `input_ids` (left-padded where `attention_mask` says so); (output ids, seconds).
    A shape's first decode on a GPU compiles it: that warm-up is said and not timed."""
    import torch

    input_ids = input_ids.to(loaded.device)
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(loaded.device)
    warm_up(loaded, input_ids, attention_mask, sampling)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    started = time.perf_counter()
    with torch.no_grad():
        output = decode(loaded, input_ids, attention_mask, sampling, streamer)
    if loaded.device.startswith("cuda"):
        torch.cuda.synchronize()
    return output, time.perf_counter() - started


def decode(loaded: Loaded, input_ids, attention_mask, sampling: Sampling, streamer=None):
    """Greedy decoding of a whole model: fastdecode's loop (a static cache, compiled on a GPU);
    sampling, streamed layers and models that loop cannot serve: transformers' generate."""
    from zerofit.infer import fastdecode

    pad = loaded.tokenizer.pad_token_id
    pad = loaded.tokenizer.eos_token_id if pad is None else pad
    length = input_ids.shape[1] + sampling.max_new_tokens
    model = loaded.model.get_base_model() if hasattr(loaded.model, "get_base_model") else loaded.model
    if loaded.static_cache and loaded.fast_decode and sampling.greedy and fastdecode.unsupported(model) is None:
        shape = (int(input_ids.shape[0]), cache_length(loaded, length))
        if shape not in loaded.decoders:
            loaded.decoders.clear()  # one cache at a time: the KV reserve holds one
            loaded.decoders[shape] = fastdecode.GreedyDecoder(loaded.model, *shape,
                                                              compile_step=loaded.device.startswith("cuda"))
        return loaded.decoders[shape].run(input_ids, attention_mask, sampling.max_new_tokens,
                                          sampling.min_new_tokens, sorted(eos_ids(loaded)), pad, streamer)
    kwargs = {**sampling.generate_kwargs(), "disable_compile": True}
    if loaded.static_cache:  # transformers compiles its decode step on a GPU
        kwargs.update(disable_compile=False, cache_implementation="static", max_cache_len=cache_length(loaded, length))
    return loaded.model.generate(input_ids=input_ids, attention_mask=attention_mask, pad_token_id=pad,
                                 streamer=streamer, **kwargs)


def cache_length(loaded: Loaded, length: int) -> int:
    """`length` rounded up to CACHE_BUCKET (at most the model's context): one compiled graph
    serves every prompt of a bucket."""
    limit = getattr(loaded.model.config, "max_position_embeddings", None) or length
    return min(max(limit, length), -(-length // CACHE_BUCKET) * CACHE_BUCKET)


def warm_up(loaded: Loaded, input_ids, attention_mask, sampling: Sampling) -> None:
    """On a GPU, the first decode of a shape compiles it: do that once per shape, said and
    timed, before the timed run. Where compiling zerofit's loop fails, say why in one line and
    try transformers' compiled generate; where that fails too, decode eagerly from then on."""
    import torch

    shape = (int(input_ids.shape[0]), cache_length(loaded, input_ids.shape[1] + sampling.max_new_tokens))
    if not (loaded.static_cache and loaded.device.startswith("cuda")) or shape in loaded.warmed:
        return
    say(f"compiling the decode step for batch {shape[0]}, cache {shape[1]} tokens (once per shape)...")
    started = time.perf_counter()
    short = Sampling(**{**sampling.__dict__, "max_new_tokens": 4, "min_new_tokens": 4})
    try:
        with torch.no_grad():
            for _ in range(2):  # the second run captures the CUDA graph
                decode(loaded, input_ids, attention_mask, short)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any compiler failure: eager still works
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        torch._dynamo.reset()
        loaded.decoders.clear()
        if loaded.fast_decode:
            warn(f"compiling the decode loop failed ({type(e).__name__}: {reason}); trying transformers' generate")
            loaded.fast_decode = False
            return warm_up(loaded, input_ids, attention_mask, sampling)
        warn(f"compiling the decode step failed ({type(e).__name__}: {reason}); decoding eagerly")
        loaded.static_cache = False
        return
    loaded.warmed.add(shape)
    loaded.placement.setdefault("warm_up_seconds", {})[f"{shape[0]}x{shape[1]}"] = round(
        time.perf_counter() - started, 1)
    say(f"compiled in {time.perf_counter() - started:.1f} s")


def generate(model: str | Path | Loaded, prompt: str, sampling: Sampling = Sampling(),
             gpu_mem: str | int | None = None, dtype: str = "auto", trust_remote_code: bool = False) -> Generation:
    """Complete `prompt` (as raw text: no chat template; BOS first, as training began every example)."""
    loaded = model if isinstance(model, Loaded) else load(model, gpu_mem, dtype, trust_remote_code=trust_remote_code)
    return generate_many(loaded, [prompt], sampling, batch_size=1)[0][0]


def prompt_ids(loaded: Loaded, prompt: str) -> list[int]:
    from zerofit.data.tokenize import text_ids

    ids = text_ids(loaded.tokenizer, prompt)
    if ids == text_ids(loaded.tokenizer, ""):  # nothing but the BOS (the check saw the BOS as text)
        raise ConfigError("--prompt is empty after tokenization; give some text")
    return ids


def generate_many(loaded: Loaded, prompts: list[str], sampling: Sampling = Sampling(),
                  batch_size: int = 8) -> tuple[list[Generation], float]:
    """Complete every prompt, `batch_size` at a time: prompts of similar length batched together
    (longest first), left-padded. ([Generation per prompt, in order], seconds of generating)."""
    import torch

    ids = [prompt_ids(loaded, p) for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    pad = loaded.tokenizer.pad_token_id
    pad = loaded.tokenizer.eos_token_id if pad is None else pad
    ends, results, total = eos_ids(loaded), [None] * len(ids), 0.0
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = max(len(ids[i]) for i in chunk)
        input_ids = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in chunk])
        mask = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in chunk])
        output, seconds = run(loaded, input_ids, sampling, attention_mask=mask)
        total += seconds
        for row, i in enumerate(chunk):
            new = output[row, width:].tolist()
            cut = next((k + 1 for k, t in enumerate(new) if t in ends and k + 1 >= sampling.min_new_tokens), len(new))
            new = new[:cut]
            results[i] = Generation(loaded.tokenizer.decode(new, skip_special_tokens=True), new, len(ids[i]), seconds,
                                    ended_at_eos=bool(new) and new[-1] in ends)
    return results, total


def eos_ids(loaded: Loaded) -> set[int]:
    """The token ids that end generation: the generation config's (one or a list), else the tokenizer's."""
    eos = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


# ------------------------------------------------------------------------------ chat
def chat_input_ids(tokenizer, history: list[dict], limit: int):
    """The conversation as model input: the tokenizer's chat template (a zerofit export's is
    the layout its data trained), else the layout messages rows train on without one
    (chatlayout.PLAIN_CHAT_TEMPLATE); the oldest turns go first when it outgrows `limit` tokens. A
    last message that alone outgrows it is refused: cut to fit, it lost the template's opening
    (the model saw the middle of a message, not a prompt)."""
    from zerofit.data.chatlayout import PLAIN_CHAT_TEMPLATE

    while True:
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True,
                                            chat_template=getattr(tokenizer, "chat_template", None)
                                            or PLAIN_CHAT_TEMPLATE)["input_ids"]
        if ids.shape[1] <= limit:
            return ids
        if len(history) <= 1:
            raise ConfigError(f"the message is {ids.shape[1]} tokens with its template, and the model takes {limit} "
                              f"(its context less --max-new-tokens): shorten it, or lower --max-new-tokens")
        del history[:2]


def chat(model: str | Path | Loaded, sampling: Sampling = Sampling(), gpu_mem: str | int | None = None,
         dtype: str = "auto", stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout,
         trust_remote_code: bool = False) -> list[dict]:
    """Read a line, stream the answer, keep the history; /exit or end of input quits,
    /reset forgets the conversation. Returns the history."""
    from transformers import TextIteratorStreamer

    loaded = model if isinstance(model, Loaded) else load(model, gpu_mem, dtype, trust_remote_code=trust_remote_code)
    limit = max(16, getattr(loaded.model.config, "max_position_embeddings", 4096) - sampling.max_new_tokens)
    interactive = stdin.isatty()
    say(f"chat: {describe(loaded)}; /exit or Ctrl-D quits, /reset clears the history")
    history: list[dict] = []
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            break
        text = line.strip()
        if text == "/reset":
            history.clear()
            say("(history cleared)")
            continue
        if not text:
            continue
        kept = history + [{"role": "user", "content": text}]
        try:
            input_ids = chat_input_ids(loaded.tokenizer, kept, limit)
        except ConfigError as e:  # the conversation so far is kept, without the message
            say(f"({e})")
            continue
        if len(kept) <= len(history):
            say(f"(the oldest {len(history) + 1 - len(kept)} turns were dropped: the conversation outgrew the "
                f"{limit} tokens the model takes)")
        history[:] = kept
        streamer = TextIteratorStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True)
        done: dict = {}

        def work():
            try:
                done["output"], done["seconds"] = run(loaded, input_ids, sampling, streamer)
            except BaseException as e:  # surfaced in the main thread
                done["error"] = e
                streamer.end()

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        pieces = []
        for piece in streamer:
            stdout.write(piece)
            stdout.flush()
            pieces.append(piece)
        thread.join()
        if "error" in done:
            raise done["error"]
        stdout.write("\n")
        stdout.flush()
        history.append({"role": "assistant", "content": "".join(pieces)})
        new_tokens = int(done["output"].shape[1] - input_ids.shape[1])
        say(f"[{counted(new_tokens, 'token')}, {new_tokens / done['seconds']:.1f} tokens/s]")
    return history


# ------------------------------------------------------------------- prompts files
def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line; JSONL rows ({"prompt": ...}) where the file is JSON lines."""
    import json

    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ConfigError(f"--prompts-file {path} holds no prompts")
    if not lines[0].lstrip().startswith("{"):
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--prompts-file {path} line {number} is not JSON ({e})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ConfigError(f"--prompts-file {path} line {number} has no \"prompt\" string")
        prompts.append(row["prompt"])
    return prompts


def cmd_generate_prompts(args) -> int:
    """`zerofit generate --prompts-file F`: every prompt completed, in batches; a JSONL row per
    prompt, in the file's order (to --out or stdout); the aggregate tokens/s said."""
    import json

    prompts = read_prompts(args.prompts_file)
    loaded = load(args.model_dir, args.gpu_mem, args.dtype, trust_remote_code=args.trust_remote_code)
    say(f"generate: {len(prompts)} prompts, batch {args.batch_size}; {describe(loaded)}")
    results, seconds = generate_many(loaded, prompts, sampling_from(args), args.batch_size)
    rows = [json.dumps({"prompt": p, "completion": r.text, "prompt_tokens": r.prompt_tokens,
                        "new_tokens": r.new_tokens, "ended_at_eos": r.ended_at_eos}, ensure_ascii=False)
            for p, r in zip(prompts, results)]
    if args.out:
        Path(args.out).write_text("".join(row + "\n" for row in rows))
    else:
        print("\n".join(rows))
    tokens = sum(r.new_tokens for r in results)
    say(f"{counted(len(prompts), 'prompt')}, {counted(tokens, 'new token')} in {seconds:.2f} s: "
        f"{tokens / seconds if seconds else 0:.1f} tokens/s (batch {args.batch_size})"
        + (f" -> {args.out}" if args.out else ""))
    return 0


def sampling_from(args) -> Sampling:
    """The sampling the generate and chat flags ask for."""
    return Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, min_new_tokens=args.min_new_tokens, seed=args.seed)
