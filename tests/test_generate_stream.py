"""Greedy generation is HF's eager `generate`, token for token, in every placement zerofit
uses: the whole model (static cache, fastdecode's loop), half the layers streamed through two
buffers with the input embedding in host RAM, the offloaded layers run on the CPU, and
batched prompts of different lengths (left padding). On the CPU with the demo's model shape;
the GPU speed is bench/generate_bench.py's."""
import json

import pytest
import torch

from zerofit.core.errors import ConfigError
from zerofit.infer import generate as infer
from zerofit.infer import load as loading
from zerofit.infer import streaming

PROMPTS = ["Add the two numbers.", "hi", "Reverse the word: banana", "Sort the letters of zebra quickly"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from zerofit.demo import build_tokenizer
    from zerofit.models import config_from_name

    directory = tmp_path_factory.mktemp("demo-model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config_from_name("demo")).save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def reference(model_dir):
    """The model as a user loads it, decoded by transformers' eager generate."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def hf_greedy(reference, tokenizer, ids: list[list[int]], new: int, min_new: int) -> list[list[int]]:
    """generate's greedy tokens for left-padded `ids` (one batch), each cut after its first EOS."""
    width, pad = max(map(len, ids)), tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in ids])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids])
    with torch.no_grad():
        out = reference.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=min_new,
                                 do_sample=False, pad_token_id=pad)
    ends = infer.eos_ids(loading.Loaded(reference, tokenizer, "cpu", "fp32"))
    rows = []
    for row in out[:, width:].tolist():
        cut = next((k + 1 for k, t in enumerate(row) if t in ends), len(row))
        rows.append(row[:cut])
    return rows


def placed(model_dir, how: str) -> loading.Loaded:
    """The demo model loaded by zerofit and placed `how`: whole (static cache), streamed (the
    last two of four layers through LayerStream, the embedding in host RAM) or cpu_layers."""
    loaded = loading.load(model_dir)
    if how == "whole":
        loaded.static_cache = True
        return loaded
    names = ["model.layers.2", "model.layers.3"]
    loading.spread(loaded.model, {"streamed_layer_names": names, "host_embedding_bytes": 1}, "cpu")
    layers = [loaded.model.get_submodule(name) for name in names]
    loaded.offload = streaming.LayerStream(layers, "cpu") if how == "streamed" else streaming.CpuLayers(layers, "cpu")
    return loaded


@pytest.mark.parametrize("how", ["whole", "streamed", "cpu_layers"])
def test_greedy_tokens_are_hf_generates_in_every_placement(model_dir, reference, how):
    loaded = placed(model_dir, how)
    ids = [infer.prompt_ids(loaded, p) for p in PROMPTS]
    for new, min_new in ((24, 24), (5, 0)):
        sampling = infer.Sampling(max_new_tokens=new, min_new_tokens=min_new)
        alone = infer.generate(loaded, PROMPTS[0], sampling)
        assert alone.token_ids == hf_greedy(reference, loaded.tokenizer, ids[:1], new, min_new)[0]
        # batched with padding: one batch of four lengths, longest first, as generate_many orders them
        results, seconds = infer.generate_many(loaded, PROMPTS, sampling, batch_size=len(PROMPTS))
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        expected = hf_greedy(reference, loaded.tokenizer, [ids[i] for i in order], new, min_new)
        assert [results[i].token_ids for i in order] == expected and seconds > 0
        assert len({len(row) for row in ids}) == len(ids)  # every row padded differently
    if how == "whole":
        assert list(loaded.decoders) == [(len(PROMPTS), infer.CACHE_BUCKET)]  # fastdecode served it, one cache
    if how == "streamed":
        # between forwards every streamed parameter is its host copy again, and the model's device is the compute's
        for packed in loaded.offload.packed:
            start = packed.host.data_ptr()
            for module, name, is_param, *_ in packed.entries:
                tensor = module._parameters[name] if is_param else module._buffers[name]
                assert start <= tensor.data_ptr() < start + packed.nbytes
        assert type(loaded.model.get_input_embeddings()) is streaming.HostEmbedding
        assert loaded.model.device.type == "cpu" and loaded.offload.consumed % 2 == 0


def test_an_ended_row_stops_where_generate_stops(model_dir, reference):
    """Rows that reach EOS early are cut there, in fastdecode's loop as in generate, alone and batched."""
    loaded = placed(model_dir, "whole")
    sampling = infer.Sampling(max_new_tokens=12)
    free = infer.generate(loaded, PROMPTS[1], sampling).token_ids
    ends = loaded.model.generation_config.eos_token_id
    loaded.model.generation_config.eos_token_id = free[2]
    reference.generation_config.eos_token_id = free[2]
    try:
        ids = [infer.prompt_ids(loaded, p) for p in PROMPTS]
        results, _ = infer.generate_many(loaded, PROMPTS, sampling, batch_size=4)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        assert [results[i].token_ids for i in order] == hf_greedy(reference, loaded.tokenizer,
                                                                   [ids[i] for i in order], 12, 0)
        assert results[1].ended_at_eos and results[1].token_ids == free[:free.index(free[2]) + 1]
    finally:
        loaded.model.generation_config.eos_token_id = ends
        reference.generation_config.eos_token_id = ends


def test_a_stream_interrupted_mid_forward_restarts_its_ring(model_dir, reference):
    """A forward that stopped part-way (an error in a layer) leaves the next forward's copies
    out of order: the next layer sees it and restarts the ring there."""
    loaded = placed(model_dir, "streamed")
    sampling = infer.Sampling(max_new_tokens=8, min_new_tokens=8)
    before = infer.generate(loaded, PROMPTS[0], sampling).token_ids
    third = loaded.model.get_submodule("model.layers.2")
    with torch.no_grad():
        third(torch.zeros(1, 1, third.hidden_size if hasattr(third, "hidden_size") else 128),
              position_embeddings=loaded.model.model.rotary_emb(torch.zeros(1, 1, 128), torch.zeros(1, 1).long()))
    assert loaded.offload.consumed % 2 == 1  # layer 3 now expected next: out of step with a new forward
    assert infer.generate(loaded, PROMPTS[0], sampling).token_ids == before


def test_the_plan_fills_the_budget_and_says_it_in_one_line():
    """llama-8b at 12 GiB: the embedding goes to host RAM, the layers that fit beside two
    buffers stay, ten are streamed; at 24 GiB it is whole; at 2 GiB nothing fits."""
    from zerofit.models import config_from_name

    config = config_from_name("llama-8b")
    _, p = loading.plan_placement(config, torch.bfloat16, 12 << 30, host_bytes=64 << 30)
    layer = p["streamed_bytes"] // len(p["streamed_layer_names"])
    assert p["streamed_layer_names"] == [f"model.layers.{i}" for i in range(22, 32)]
    assert p["stream_buffer_bytes"] == 2 * layer and p["host_embedding_bytes"] == 128256 * 4096 * 2
    used = p["gpu_weight_bytes"] + p["stream_buffer_bytes"] + p["reserve_bytes"]
    assert used <= 12 << 30 < used + layer  # one more resident layer would not fit
    line = loading.describe(loading.Loaded(None, None, "cuda:0", "torch.bfloat16", {**p, "offload": {"mode": "stream"}}))
    assert "\n" not in line and "10 layers of 32 streamed from pinned RAM through 2 GPU buffers" in line
    assert "the input embedding (1002.0MiB) looked up in CPU RAM" in line
    _, whole = loading.plan_placement(config, torch.bfloat16, 24 << 30, host_bytes=64 << 30)
    assert whole["streamed_layer_names"] == [] and not whole["host_embedding_bytes"]
    with pytest.raises(ConfigError, match="too small for this model"):
        loading.plan_placement(config, torch.bfloat16, 2 << 30, host_bytes=64 << 30)


def test_a_prompts_file_becomes_jsonl_in_its_order(model_dir, reference, tmp_path, capsys):
    from zerofit import cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", str(model_dir), "--prompts-file", str(prompts), "--out", str(out),
                     "--max-new-tokens", "6", "--min-new-tokens", "6", "--batch-size", "3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["prompt"] for row in rows] == PROMPTS and all(row["new_tokens"] == 6 for row in rows)
    said = capsys.readouterr().err
    assert "4 prompts, 24 new tokens in" in said and "tokens/s (batch 3)" in said
    plain = tmp_path / "prompts.txt"
    plain.write_text("\n".join(PROMPTS) + "\n\n")
    assert infer.read_prompts(plain) == PROMPTS
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ConfigError, match="line 2 has no \"prompt\" string"):
        infer.read_prompts(bad)


def test_chat_streams_through_the_compiled_loop_as_through_generate(model_dir):
    """chat's streamer gets fastdecode's tokens in chunks; the answers are generate's."""
    import io

    answers = []
    for whole in (True, False):
        loaded = loading.load(model_dir)
        loaded.static_cache = whole
        out = io.StringIO()
        history = infer.chat(loaded, infer.Sampling(max_new_tokens=20, min_new_tokens=20),
                             stdin=io.StringIO("hello\nand again?\n"), stdout=out)
        assert bool(loaded.decoders) == whole
        answers.append((history, out.getvalue()))
    assert answers[0] == answers[1]


def test_a_lora_adapter_decodes_through_the_compiled_loop_as_through_generate(model_dir, tmp_path):
    """An adapter directory runs on its base wrapped by peft; fastdecode's tokens are still generate's."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    reference = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config).eval()
    reference.save_pretrained(tmp_path / "adapter")
    adapter_config = tmp_path / "adapter" / "adapter_config.json"
    adapter_config.write_text(json.dumps({**json.loads(adapter_config.read_text()),
                                          "base_model_name_or_path": str(model_dir)}))
    loaded = loading.load(tmp_path / "adapter")
    loaded.static_cache = True
    ids = [infer.prompt_ids(loaded, p) for p in PROMPTS]
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    results, _ = infer.generate_many(loaded, PROMPTS, infer.Sampling(max_new_tokens=16, min_new_tokens=16), 4)
    expected = hf_greedy(reference, loaded.tokenizer, [ids[i] for i in order], 16, 16)
    assert [results[i].token_ids for i in order] == expected and loaded.decoders
