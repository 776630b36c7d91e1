"""`zerofit config --from-llamafactory`: LLaMA-Factory's training YAMLs as zerofit's config."""
import json

import pytest
import yaml

from zerofit import cli
from zerofit.config import ConfigError, load

from conftest import read_jsonl, run_zerofit, write_jsonl

# LLaMA-Factory's examples/train_full/llama3_full_sft.yaml, as shipped (its eval block uncommented)
LLAMA3_FULL_SFT = """\
### model
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: full
deepspeed: examples/deepspeed/ds_z3_config.json

### dataset
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/llama3-8b/full/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 2
learning_rate: 1.0e-5
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### eval
val_size: 0.1
per_device_eval_batch_size: 1
eval_strategy: steps
eval_steps: 500
"""
# LLaMA-Factory's data/dataset_info.json, the entries its examples use
DATASET_INFO = {
    "identity": {"file_name": "identity.json"},
    "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
    "glaive_toolcall_en_demo": {"file_name": "glaive_toolcall_en_demo.json", "formatting": "sharegpt",
                                "columns": {"messages": "conversations", "tools": "tools"}},
    "openai_chat": {"file_name": "chat.jsonl", "formatting": "sharegpt", "columns": {"messages": "dialog"},
                    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                             "assistant_tag": "assistant", "system_tag": "system"}},
    "odd_tags": {"file_name": "odd.json", "formatting": "sharegpt",
                 "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "q", "assistant_tag": "a"}},
    "alpaca_en": {"hf_hub_url": "llamafactory/alpaca_en", "ms_hub_url": "llamafactory/alpaca_en"},
    "dpo_en_demo": {"file_name": "dpo_en_demo.json", "ranking": True, "formatting": "sharegpt",
                    "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
}


def translated(tmp_path, monkeypatch, capsys, text: str, *extra: str) -> tuple[dict, str, str]:
    """(the printed YAML as a dict, its text, stderr) of translating `text` in a LLaMA-Factory layout."""
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps(DATASET_INFO))
    (tmp_path / "lf.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["config", "--from-llamafactory", "lf.yaml", *extra]) == 0
    out = capsys.readouterr()
    return yaml.safe_load(out.out), out.out, out.err


def test_llamafactorys_full_sft_example_trains_as_theirs(tmp_path, monkeypatch, capsys):
    config, text, err = translated(tmp_path, monkeypatch, capsys, LLAMA3_FULL_SFT)
    assert config["run_dir"] == "saves/llama3-8b/full/sft"
    assert config["model"] == {"path": "meta-llama/Meta-Llama-3-8B-Instruct", "trust_remote_code": True}
    assert "lora" not in config
    assert config["data"] == {"path": ["data/identity.json", "data/alpaca_en_demo.json"], "format": "alpaca",
                              "eval_fraction": 0.1, "packing": False, "max_samples": 1000}
    assert config["train"] == {"global_batch_size": 2, "seq_len": 2048, "lr": 1e-5, "epochs": 3.0,
                               "warmup_ratio": 0.1, "lr_schedule": "cosine", "min_lr_ratio": 0.0,
                               "adam_betas": [0.9, 0.999], "precision": "bf16"}
    assert config["checkpoint"] == {"every_steps": 500}
    assert config["eval"] == {"every_steps": 500}
    assert config["log"] == {"every_steps": 10}
    # every key is accounted for: carried over (commented with its name) or left out with why, but
    # those whose value is what zerofit does anyway (stage sft, full, report to none, eval by steps)
    silent = {key for key in yaml.safe_load(LLAMA3_FULL_SFT)
              if f"# {key}" not in text and f"#   {key}:" not in text and f"{key} " not in text}
    assert silent == {"stage", "finetuning_type", "report_to", "eval_strategy"}
    assert "#   template: llama3 -- conversations are rendered by the tokenizer's own chat template" in text
    assert "#   deepspeed: examples/deepspeed/ds_z3_config.json -- zerofit writes DeepSpeed's config" in text
    # what stops the run is said, on stderr, not in the YAML a user redirects
    assert "hf download meta-llama/Meta-Llama-3-8B-Instruct --local-dir DIR" in err
    assert "data/identity.json, data/alpaca_en_demo.json not found here" in err


def test_their_defaults_are_written_where_zerofits_differ(tmp_path, monkeypatch, capsys):
    """A LoRA config that leaves everything at LLaMA-Factory's and HF's defaults: lora rank 8, alpha
    2 x rank, dropout 0, target all; lr 5e-5, 3 epochs, linear to 0, Adam's beta2 0.999, fp32, micro
    batch 8, no hold-out, no packing, a save every 500 steps, LLaMA-Factory's cutoff_len 2048."""
    config, _, _ = translated(tmp_path, monkeypatch, capsys, "model_name_or_path: m\ndataset: identity\n"
                                                            "template: llama3\nlora_rank: 4\n")
    assert config["lora"] == {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["all"]}
    assert config["train"] == {"global_batch_size": 8, "seq_len": 2048, "lr": 5e-5, "epochs": 3.0,
                               "lr_schedule": "linear", "min_lr_ratio": 0.0, "adam_betas": [0.9, 0.999],
                               "precision": "fp32"}
    assert config["data"] == {"path": "data/identity.json", "format": "alpaca", "eval_fraction": 0.0,
                              "packing": False}
    assert config["checkpoint"] == {"every_steps": 500}


@pytest.mark.parametrize("extra, expected", [
    ("dataset: glaive_toolcall_en_demo\n", {"format": "sharegpt", "columns": {"messages": "conversations"}}),
    ("dataset: openai_chat\n", {"format": "messages", "columns": {"messages": "dialog"}}),
    ("dataset: identity,openai_chat\n", {"columns": {"messages": "dialog"}}),  # two formats: auto, per row
    ("stage: pt\ndataset: identity\n", {"format": "text"}),
    ("dataset: identity\nval_size: 200\n", {"eval_examples": 200}),  # an integer val_size is a count
    ("dataset: identity\ntrain_on_prompt: true\nmask_history: true\n", {"train_on_prompt": True,
                                                                        "mask_history": True}),
])
def test_dataset_info_entries_become_format_and_columns(tmp_path, monkeypatch, capsys, extra, expected):
    config, _, _ = translated(tmp_path, monkeypatch, capsys, "model_name_or_path: m\nfinetuning_type: full\n" + extra)
    assert expected.items() <= config["data"].items(), config["data"]
    if "," in extra:
        assert "format" not in config["data"]


@pytest.mark.parametrize("text, message", [
    ("stage: dpo\ndataset: identity\n", "stage: dpo -- zerofit trains sft"),
    ("dataset: alpaca_en\n", "dataset alpaca_en: a hub dataset (llamafactory/alpaca_en)"),
    ("dataset: dpo_en_demo\n", "dataset dpo_en_demo: preference data"),
    ("dataset: odd_tags\n", "zerofit reads turns as {from, value}"),
    ("dataset: nowhere\n", "dataset nowhere: not in data/dataset_info.json"),
    ("dataset: identity\nquantization_bit: 4\n", "quantization_bit: QLoRA (a quantized base) is not offered"),
    ("dataset: identity\nlr_scheduler_type: polynomial\n", "lr_scheduler_type: polynomial -- zerofit offers"),
])
def test_a_run_zerofit_cannot_do_is_refused_naming_why(tmp_path, monkeypatch, capsys, text, message):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps(DATASET_INFO))
    (tmp_path / "lf.yaml").write_text("model_name_or_path: m\n" + text)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["config", "--from-llamafactory", "lf.yaml"]) == 1
    out = capsys.readouterr()
    assert message in out.err
    assert out.out == ""  # no half a config to redirect into a file


def test_a_translation_train_would_refuse_is_refused_naming_the_key(tmp_path, monkeypatch, capsys):
    (tmp_path / "lf.yaml").write_text("model_name_or_path: m\nfinetuning_type: full\ncutoff_len: 4\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["config", "--from-llamafactory", "lf.yaml"]) == 1
    out = capsys.readouterr()
    assert "train.seq_len=4: Input should be greater than or equal to 8" in out.err
    assert out.out == ""


def test_a_llamafactory_config_given_to_train_points_to_the_translation(tmp_path):
    (tmp_path / "lf.yaml").write_text(LLAMA3_FULL_SFT)
    with pytest.raises(ConfigError) as refused:
        load(tmp_path / "lf.yaml")
    assert f"`zerofit config --from-llamafactory {tmp_path / 'lf.yaml'} > zerofit.yaml` translates it" \
        in str(refused.value)


def test_their_keys_that_need_no_counterpart_are_said_so_in_a_zerofit_config(tmp_path):
    (tmp_path / "c.yaml").write_text("model: {config: tiny}\ntrain: {max_steps: 1}\noverwrite_output_dir: true\n")
    with pytest.raises(ConfigError, match="overwrite_output_dir is not needed: a run directory resumes"):
        load(tmp_path / "c.yaml")


def test_a_translated_lora_config_trains(tmp_path):
    """LLaMA-Factory's layout end to end: a local model directory, a ShareGPT file under its own
    column name in dataset_info.json, a LoRA YAML -> zerofit's config -> `zerofit train`."""
    from transformers import AutoModelForCausalLM

    from zerofit.demo import build_tokenizer
    from zerofit.models import config_from_name

    model_dir = tmp_path / "base"
    AutoModelForCausalLM.from_config(config_from_name("tiny")).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "sums.jsonl", [{"dialog": [{"from": "human", "value": f"What is {i} plus {i}?"},
                                                  {"from": "gpt", "value": f"It is {2 * i}."}]} for i in range(64)])
    (data / "dataset_info.json").write_text(json.dumps({"sums": {"file_name": "sums.jsonl", "formatting": "sharegpt",
                                                                 "columns": {"messages": "dialog"}}}))
    (tmp_path / "lf.yaml").write_text(f"""\
model_name_or_path: {model_dir}
stage: sft
finetuning_type: lora
lora_target: all
dataset: sums
dataset_dir: {data}
cutoff_len: 64
output_dir: {tmp_path / 'run'}
per_device_train_batch_size: 4
gradient_accumulation_steps: 2
learning_rate: 1.0e-3
max_steps: 3
bf16: true
save_strategy: "no"
""")
    done = run_zerofit(["config", "--from-llamafactory", str(tmp_path / "lf.yaml"), "--set", "log.progress=false"])
    assert done.stderr == ""  # nothing left to do before training
    (tmp_path / "zerofit.yaml").write_text(done.stdout)
    run_zerofit(["train", "--config", str(tmp_path / "zerofit.yaml")])
    steps = [row for row in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2, 3]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    shape = plan["shape"]
    assert shape["micro_batch"] * shape["grad_accum"] * shape["world_size"] == 8  # their global batch, split
    assert plan["trainable_params"] < plan["params"] / 4  # adapters on every linear layer, the base frozen
    assert (tmp_path / "run" / "checkpoints" / "step-000003" / "MANIFEST.json").exists()
