"""`zerofit generate` / `zerofit chat` on the CPU with a tiny random Llama saved as a
Hugging Face directory (the GPU placement is measured by bench/generate_bench.py)."""
import io

import pytest
import torch
from conftest import ROOT

from zerofit.core.console import counted
from zerofit.core.errors import ConfigError
from zerofit.infer.generate import Sampling, chat, chat_input_ids, generate, sampling_from
from zerofit.infer.load import kv_cache_bytes, load


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from zerofit.demo import build_tokenizer
    from zerofit.models import config_from_name

    directory = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config_from_name("tiny")).save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load(model_dir)


def greedy_chain(model, input_ids, steps: int, eos: int, min_new: int) -> list[int]:
    """Greedy decoding by hand: argmax of the last position, EOS barred for min_new steps."""
    ids, out = input_ids, []
    with torch.no_grad():
        for i in range(steps):
            logits = model(ids).logits[0, -1]
            if i < min_new:
                logits[eos] = -float("inf")
            token = int(logits.argmax())
            out.append(token)
            if token == eos:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def test_greedy_generation_is_the_argmax_chain(loaded):
    result = generate(loaded, "Add the two numbers.", Sampling(max_new_tokens=10, min_new_tokens=10))
    # the prompt begins with BOS, as every training example did (this tokenizer adds none itself)
    assert result.new_tokens == 10 and result.tokens_per_s > 0 and result.prompt_tokens == 21
    input_ids = torch.tensor([[loaded.tokenizer.bos_token_id] + loaded.tokenizer.encode("Add the two numbers.")])
    assert result.token_ids == greedy_chain(loaded.model, input_ids, 10, loaded.tokenizer.eos_token_id, 10)
    assert result.text == loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_sampling_follows_its_seed(loaded):
    def sample(seed):
        return generate(loaded, "Reverse the word.", Sampling(max_new_tokens=12, min_new_tokens=12,
                                                              temperature=1.0, top_k=50, seed=seed)).token_ids

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)
    greedy = generate(loaded, "Reverse the word.", Sampling(max_new_tokens=12, min_new_tokens=12)).token_ids
    assert greedy == generate(loaded, "Reverse the word.", Sampling(max_new_tokens=12, min_new_tokens=12)).token_ids


def test_chat_keeps_the_history_and_uses_the_template(loaded, capsys):
    out = io.StringIO()
    history = chat(loaded, Sampling(max_new_tokens=6, min_new_tokens=6),
                   stdin=io.StringIO("hello\n\n/reset\nhi there\nand again?\n/exit\nnever read\n"), stdout=out)
    assert [turn["role"] for turn in history] == ["user", "assistant", "user", "assistant"]
    assert [turn["content"] for turn in history[::2]] == ["hi there", "and again?"]
    assert capsys.readouterr().err.count("(history cleared)") == 1  # /reset says it did
    assert (counted(1, "token"), counted(6, "token")) == ("1 token", "6 tokens")  # was "1 tokens"
    # three answers streamed, one line each; /reset forgot the first exchange
    assert out.getvalue().endswith(f"\n{history[1]['content']}\n{history[3]['content']}\n")
    # The second answer is what greedy decoding gives for the whole conversation so far.
    prompt = loaded.tokenizer.apply_chat_template(history[:3], add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"]
    assert prompt.shape[1] > len("hi there") + len("and again?")
    tokens = greedy_chain(loaded.model, prompt, 6, loaded.tokenizer.eos_token_id, 6)
    assert history[3]["content"] == loaded.tokenizer.decode(tokens, skip_special_tokens=True)


def test_long_history_drops_the_oldest_turns(loaded):
    history = [{"role": r, "content": f"turn {i} " + "x" * 40} for i, r in enumerate(["user", "assistant"] * 3)]
    history.append({"role": "user", "content": "last"})
    ids = chat_input_ids(loaded.tokenizer, history, limit=160)
    assert ids.shape[1] <= 160
    # the oldest exchanges went, a whole one at a time; the newest kept, in order
    assert [turn["content"].split()[1] for turn in history[:-1]] == ["4", "5"] and history[-1]["content"] == "last"
    # a message that alone outgrows the context is refused: cut to fit, it lost the template's opening
    with pytest.raises(ConfigError, match="the message is .* tokens with its template, and the model takes 80"):
        chat_input_ids(loaded.tokenizer, [{"role": "user", "content": "y" * 200}], limit=80)


def test_chat_says_what_it_drops_and_refuses(loaded, capsys):
    """Older turns were deleted without a word, and a message longer than the context was cut
    from the left (the model saw no prompt): said, and refused keeping the conversation."""
    sampling = Sampling(max_new_tokens=4, min_new_tokens=4)
    limit = loaded.model.config.max_position_embeddings - 4
    turns = "\n".join(["x" * (limit // 3)] * 4 + ["y" * (2 * limit), "z", "/exit"]) + "\n"
    history = chat(loaded, sampling, stdin=io.StringIO(turns), stdout=io.StringIO())
    said = " ".join(capsys.readouterr().err.split())
    assert "turns were dropped: the conversation outgrew the" in said
    assert "the message is" in said and "shorten it, or lower --max-new-tokens" in said
    assert history[-2]["content"] == "z" and all("y" * 10 not in m["content"] for m in history if m["role"] == "user")


@pytest.mark.e2e
def test_chat_answers_through_a_pipe(model_dir):
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "zerofit", "chat", str(model_dir), "--max-new-tokens", "5",
                           "--min-new-tokens", "5"], input="hello\nwhat now?\n", capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("[5 tokens, ") == 2 and "tokens/s]" in done.stderr
    assert done.stdout.count("\n") >= 2  # two streamed answers


def test_gpu_budget_without_a_gpu_runs_on_the_cpu(model_dir, capsys):
    loaded = load(model_dir, gpu_mem="12GiB")
    assert loaded.device == "cpu" and "no GPU visible" in capsys.readouterr().err


def test_kv_cache_reserve_of_llama_8b():
    from zerofit.models import config_from_name

    # 32 layers x (keys + values) x 8 KV heads x 128 dims x 4096 tokens x 2 bytes = 512 MiB
    assert kv_cache_bytes(config_from_name("llama-8b"), torch.bfloat16, 4096) == 512 << 20


def test_placement_of_an_8b_model_in_12_and_24_gib():
    """accelerate's device map on a weightless skeleton: what `--gpu-mem` puts where."""
    from zerofit.core.errors import ConfigError
    from zerofit.infer.load import plan_placement
    from zerofit.models import config_from_name

    config = config_from_name("llama-8b")
    _, small = plan_placement(config, torch.bfloat16, 12 << 30, host_bytes=64 << 30)
    total = small["gpu_weight_bytes"] + small["cpu_weight_bytes"]
    assert 15.9e9 < total < 16.2e9  # 8.03e9 bf16 parameters
    assert small["reserve_bytes"] == (512 << 20) * 2  # KV cache for 4096 tokens + runtime
    assert 6e9 < small["gpu_weight_bytes"] <= (12 << 30) - small["reserve_bytes"]
    assert small["cpu_weight_bytes"] > 4e9 and small["modules_per_device"]["cpu"] > 0
    _, large = plan_placement(config, torch.bfloat16, 24 << 30, host_bytes=64 << 30)
    assert large["cpu_weight_bytes"] == 0 and large["gpu_weight_bytes"] == total
    with pytest.raises(ConfigError, match="leaves no room for weights"):
        plan_placement(config, torch.bfloat16, 1 << 30, host_bytes=64 << 30)


def test_inference_and_planning_numbers_are_checked_as_usage(capsys):
    """--temperature 0 asks for greedy decoding (as most tools read it); numbers no run can take
    (a negative temperature, no new tokens, zero ranks) are usage errors naming the flag, exit 2,
    not a traceback from transformers or the planner."""
    from zerofit import cli

    parser = cli.build_parser()
    assert sampling_from(parser.parse_args(["generate", "m", "--prompt", "p", "--temperature", "0"])).greedy
    sampled = sampling_from(parser.parse_args(["generate", "m", "--prompt", "p", "--temperature", "0.7"]))
    assert not sampled.greedy and sampled.temperature == 0.7
    # 0 stays greedy beside --top-k / --top-p (it was read as unset there: top-k sampled at temperature 1)
    zero_with_top_k = sampling_from(parser.parse_args(["generate", "m", "--prompt", "p", "--temperature", "0",
                                                             "--top-k", "50", "--top-p", "0.9"]))
    assert zero_with_top_k.greedy and zero_with_top_k.generate_kwargs()["do_sample"] is False
    for argv, said in ((["generate", "m", "--prompt", "p", "--temperature", "-1"], "--temperature: -1 is below 0.0"),
                       (["generate", "m", "--prompt", "p", "--top-p", "2"], "--top-p: 2 is not in (0, 1]"),
                       (["chat", "m", "--top-p", "0"], "--top-p: 0 is not in (0, 1]"),
                       (["generate", "m", "--prompt", "p", "--max-new-tokens", "0"], "--max-new-tokens: 0 is below 1"),
                       (["plan", "--model", "tiny", "--world-size", "0"], "--world-size: 0 is below 1"),
                       (["lint", "ds.json", "--world-size", "x"], "--world-size: 'x' is not a number")):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(argv)
        assert exited.value.code == 2 and said in capsys.readouterr().err


def test_a_damaged_weights_file_is_named_with_the_fix(model_dir, tmp_path):
    """A model.safetensors cut short (a copy interrupted, a full disk) gave safetensors' traceback."""
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(model_dir, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ConfigError, match="cannot be read .*truncated or damaged; export the model again"):
        load(damaged)


def test_an_empty_prompt_is_refused(loaded):
    """With the BOS every prompt now starts with, the empty check saw one token and let it pass."""
    with pytest.raises(ConfigError, match="--prompt is empty after tokenization"):
        generate(loaded, "", Sampling(max_new_tokens=2))


def test_a_completion_the_model_ended_says_so(loaded):
    """An empty completion read as a broken model: the result says when the model ended the
    sequence (here: its first greedy token made the end-of-sequence token) and when the token
    budget did."""
    budget = generate(loaded, "Reverse the word.", Sampling(max_new_tokens=3, min_new_tokens=3))
    assert not budget.ended_at_eos and budget.new_tokens == 3
    config = loaded.model.generation_config
    eos = config.eos_token_id
    config.eos_token_id = budget.token_ids[0]
    try:
        ended = generate(loaded, "Reverse the word.", Sampling(max_new_tokens=3))
    finally:
        config.eos_token_id = eos
    assert ended.ended_at_eos and ended.token_ids == budget.token_ids[:1]


def test_a_config_json_transformers_cannot_read_is_named(tmp_path):
    """A directory whose config.json has no model_type (or is not JSON) ended generate and chat in
    transformers' ValueError traceback."""
    for text, reason in (('{"a": 1}', "Should have a `model_type` key"), ("{oops", "is not a valid JSON file")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ConfigError, match=f"config.json is not a model config transformers can read .*{reason}"):
            load(tmp_path)


CUSTOM_CODE = '''import pathlib
pathlib.Path(r"{marker}").write_text("the model's code ran")
from transformers import LlamaConfig, LlamaForCausalLM


class CustomConfig(LlamaConfig):
    model_type = "zerofit_custom"


class CustomModel(LlamaForCausalLM):
    config_class = CustomConfig
'''


def custom_code_model(model_dir, directory, marker: str):
    """The tiny model as a model with its own code (auto_map): importing it writes `marker`."""
    import json
    import shutil

    shutil.copytree(model_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="zerofit_custom", architectures=["CustomModel"],
                  auto_map={"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"})
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "custom.py").write_text(CUSTOM_CODE.format(marker=marker))
    return directory


@pytest.mark.e2e
def test_a_models_own_code_runs_only_with_the_flag(model_dir, tmp_path):
    """An adapter directory's adapter_config.json said trust_remote_code: true and its base's
    code ran. Only --trust-remote-code runs it; without it generate names the flag."""
    import json

    from conftest import run_zerofit

    marker = tmp_path / "pwned"
    custom = custom_code_model(model_dir, tmp_path / "custom", str(marker))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
        "base_model_name_or_path": str(custom), "trust_remote_code": True}))
    for directory in (custom, adapter):
        done = run_zerofit(["generate", str(directory), "--prompt", "hi", "--max-new-tokens", "2"], check=False,
                           input_text="y\n")
        assert done.returncode == 1 and "pass --trust-remote-code" in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr and not marker.exists()
    done = run_zerofit(["generate", str(custom), "--prompt", "hi", "--max-new-tokens", "2", "--trust-remote-code"])
    assert marker.read_text() == "the model's code ran" and "new token" in done.stderr


def test_a_run_directory_says_export_it_first(tmp_path):
    run = tmp_path / "my run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("run_dir: x\n")
    with pytest.raises(ConfigError) as refused:
        load(run)
    assert "is a training run directory, not a model: export it first" in str(refused.value)
    assert f"`zerofit export '{run}' --out '{tmp_path / 'my run-model'}'`" in str(refused.value)
