"""`zerofit config --from-llamafactory`: LLaMA-Factory's training YAMLs as zerofit's config."""
import json

import pytest
import yaml
from conftest import read_jsonl, run_zerofit, write_jsonl

from zerofit import cli
from zerofit.config.load import load, validate
from zerofit.core.errors import ConfigError

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
    "mixed_tags": {"file_name": "mixed.json", "formatting": "sharegpt",
                   "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "user", "assistant_tag": "assistant"}},
    "openorca": {"file_name": "openorca.json", "columns": {"prompt": "question", "response": "response",
                                                           "system": "system_prompt"}},
    "openo1": {"file_name": "openo1.json", "columns": {"prompt": "prompt", "response": "response"}},
    "c4_demo": {"file_name": "c4_demo.jsonl", "columns": {"prompt": "content"}},
    "no_file": {"formatting": "alpaca"},
    "resampled": {"file_name": "identity.json", "num_samples": 100},
    "odd_tags": {"file_name": "odd.json", "formatting": "sharegpt",
                 "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "q", "assistant_tag": "a"}},
    "alpaca_en": {"hf_hub_url": "llamafactory/alpaca_en", "ms_hub_url": "llamafactory/alpaca_en"},
    "dpo_en_demo": {"file_name": "dpo_en_demo.json", "ranking": True, "formatting": "sharegpt",
                    "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
}


def lf_layout(tmp_path, monkeypatch, text: str, info=DATASET_INFO) -> None:
    """LLaMA-Factory's directory: data/dataset_info.json (`info`, or its text), lf.yaml; run from it."""
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "dataset_info.json").write_text(info if isinstance(info, str) else json.dumps(info))
    (tmp_path / "lf.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)


def translated(tmp_path, monkeypatch, capsys, text: str, *extra: str) -> tuple[dict, str, str]:
    """(the printed YAML as a dict, its text, stderr) of translating `text` in a LLaMA-Factory layout."""
    lf_layout(tmp_path, monkeypatch, text)
    assert cli.main(["config", "--from-llamafactory", "lf.yaml", *extra]) == 0
    out = capsys.readouterr()
    return yaml.safe_load(out.out), out.out, out.err


def refusal(tmp_path, monkeypatch, capsys, text: str, info=DATASET_INFO) -> str:
    """stderr of a translation that must exit 1, having printed no config to redirect."""
    lf_layout(tmp_path, monkeypatch, text, info)
    assert cli.main(["config", "--from-llamafactory", "lf.yaml"]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    return out.err


def test_llamafactorys_full_sft_example_trains_as_theirs(tmp_path, monkeypatch, capsys):
    config, text, err = translated(tmp_path, monkeypatch, capsys, LLAMA3_FULL_SFT)
    data_dir = tmp_path / "data"
    assert config["run_dir"] == "saves/llama3-8b/full/sft"
    assert config["model"] == {"path": "meta-llama/Meta-Llama-3-8B-Instruct", "trust_remote_code": True}
    assert "lora" not in config
    # paths absolute (the translation runs from anywhere); the optional columns their entries do not
    # name are not read (LLaMA-Factory's parser.py leaves them None)
    assert config["data"] == {"path": [str(data_dir / "identity.json"), str(data_dir / "alpaca_en_demo.json")],
                              "format": "alpaca", "columns": {"history": None, "system": None, "tools": None},
                              "eval_fraction": 0.1, "packing": False, "max_samples": 1000,
                              "num_workers": 16}
    assert config["train"] == {"global_batch_size": 2, "seq_len": 2048, "lr": 1e-5, "epochs": 3.0,
                               "warmup_ratio": 0.1, "lr_schedule": "cosine", "min_lr_ratio": 0.0,
                               "adam_betas": [0.9, 0.999], "precision": "bf16"}
    assert config["checkpoint"] == {"every_steps": 500}
    assert config["eval"] == {"every_steps": 500}
    assert config["log"] == {"every_steps": 10}
    # every key is accounted for: carried over (commented with its name) or left out with why, but
    # those whose value is what zerofit does anyway (stage sft, full, report to none, eval by steps,
    # a null: the default)
    silent = {key for key in yaml.safe_load(LLAMA3_FULL_SFT)
              if f"# {key}" not in text and f"#   {key}:" not in text and f"{key} " not in text}
    assert silent == {"stage", "finetuning_type", "report_to", "eval_strategy", "resume_from_checkpoint"}
    assert "#   template: llama3 -- zerofit renders conversations and alpaca rows with the tokenizer's own" in text
    assert "#   deepspeed: examples/deepspeed/ds_z3_config.json -- zerofit writes DeepSpeed's config" in text
    # what stops the run, and what trains otherwise, said on stderr too (the YAML is redirected)
    assert "hf download meta-llama/Meta-Llama-3-8B-Instruct --local-dir DIR" in err
    assert f"{data_dir / 'identity.json'}, {data_dir / 'alpaca_en_demo.json'} not found" in err
    assert "on N GPUs LLaMA-Factory steps on N x that, so set N x 2 for a run under torchrun" in err
    assert "zerofit's warmup is one step ahead" in err


def test_their_defaults_are_written_where_zerofits_differ(tmp_path, monkeypatch, capsys):
    """A LoRA config that leaves everything at LLaMA-Factory's and HF's defaults: lora rank 8, alpha
    2 x rank, dropout 0, target all; lr 5e-5, 3 epochs, linear to 0, Adam's beta2 0.999, fp32, micro
    batch 8, no hold-out (and so no eval), no packing, a save every 500 steps, cutoff_len 2048."""
    config, _, _ = translated(tmp_path, monkeypatch, capsys, "model_name_or_path: m\ndataset: identity\n"
                                                            "template: llama3\nlora_rank: 4\nlora_alpha: 0\n")
    assert config["lora"] == {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["all"]}
    assert config["train"] == {"global_batch_size": 8, "seq_len": 2048, "lr": 5e-5, "epochs": 3.0,
                               "lr_schedule": "linear", "min_lr_ratio": 0.0, "adam_betas": [0.9, 0.999],
                               "precision": "fp32"}
    assert config["data"]["eval_fraction"] == 0.0 and config["data"]["packing"] is False
    assert config["eval"] == {"at_end": False}  # no eval set: no "the eval set is empty" at every start
    assert config["checkpoint"] == {"every_steps": 500}


@pytest.mark.parametrize("extra, expected", [
    ("dataset: glaive_toolcall_en_demo\n", {"format": "sharegpt", "columns": {"system": None}}),
    ("dataset: openai_chat\n", {"format": "messages", "columns": {"messages": "dialog", "system": None,
                                                                   "tools": None}}),
    ("dataset: mixed_tags\n", {"format": "sharegpt"}),  # {from, value} turns with OpenAI's speaker names
    # named columns under zerofit's names are still mapped from LLaMA-Factory's keys (prompt -> instruction)
    ("dataset: openorca\n", {"columns": {"prompt": "question", "query": None, "response": "response",
                                         "history": None, "system": "system_prompt", "tools": None}}),
    ("dataset: openo1\n", {"columns": {"prompt": "prompt", "response": "response", "query": None,
                                       "history": None, "system": None, "tools": None}}),
    ("dataset: identity,openai_chat\n", {"columns": {"history": None, "system": None, "tools": None,
                                                      "messages": "dialog"}}),  # two formats: auto, per row
    ("stage: pt\ndataset: c4_demo\n", {"format": "text", "columns": {"text": "content"}}),
    ("dataset: identity\nval_size: 200\n", {"eval_examples": 200}),  # an integer val_size is a count
    ("dataset: identity\nneat_packing: true\n", {"packing": True, "neat_packing": True}),  # theirs sets packing
    ("dataset: identity\ntrain_on_prompt: true\n", {"train_on_prompt": True}),
    ("dataset: identity\nmask_history: true\n", {"mask_history": True}),
])
def test_dataset_info_entries_become_format_and_columns(tmp_path, monkeypatch, capsys, extra, expected):
    config, _, _ = translated(tmp_path, monkeypatch, capsys, "model_name_or_path: m\nfinetuning_type: full\n" + extra)
    assert expected.items() <= config["data"].items(), config["data"]
    if "," in extra:
        assert "format" not in config["data"]
    validate({**config, "model": {"config": "tiny"}})  # what train will read


@pytest.mark.parametrize("extra, expected", [
    # null is the default (LLaMA-Factory's WebUI writes these into every LoRA run)
    ("use_dora: false\nuse_rslora: false\npissa_init: false\nquantization_bit: null\nadditional_target: null\n"
     "save_total_limit: null\nadapter_name_or_path: null\n", {"lora.modules_to_save": None,
                                                               "checkpoint.keep_last": None}),
    ("warmup_steps: 1e2\nlearning_rate: 1e-4\n", {"train.warmup_steps": 100, "train.lr": 1e-4}),  # OmegaConf's
    ("warmup_steps: 0.1\n", {"train.warmup_ratio": 0.1}),  # transformers 5: a warmup_steps below 1 is a ratio
    ("lr_scheduler_type: constant\nwarmup_ratio: 0.1\n", {"train.lr_schedule": "constant",
                                                            "train.warmup_ratio": None}),  # HF's has none
    ("lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs: '{\"min_lr_rate\": 0.1}'\n",
     {"train.lr_schedule": "cosine", "train.min_lr_ratio": 0.1}),  # JSON text, as HF takes it
    ("save_strategy: epoch\n", {"checkpoint.every_steps": 0}),
    ("save_strategy: 'no'\n", {"checkpoint.every_steps": 0, "checkpoint.every_minutes": 0}),
    ("tokenized_path: cache/alpaca\npreprocessing_num_workers: '4'\n",
     {"data.cache_dir": "cache/alpaca", "data.num_workers": 4}),
])
def test_values_read_as_llamafactory_reads_them(tmp_path, monkeypatch, capsys, extra, expected):
    config, _, _ = translated(tmp_path, monkeypatch, capsys, "model_name_or_path: m\ndataset: identity\n" + extra)
    for key, value in expected.items():
        section, name = key.split(".")
        assert config.get(section, {}).get(name) == value, (key, config.get(section))


@pytest.mark.parametrize("text, message", [
    ("stage: dpo\ndataset: identity\n", "stage: dpo -- zerofit trains sft"),
    ("dataset: alpaca_en\n", "dataset alpaca_en: a hub dataset (llamafactory/alpaca_en) and nothing downloads at "
     "run time: download it once (`hf download llamafactory/alpaca_en --repo-type dataset --local-dir DIR`)"),
    ("dataset: dpo_en_demo\n", "dataset dpo_en_demo: preference data"),
    ("dataset: odd_tags\n", "zerofit reads turns as {from, value} or {role, content}"),
    ("dataset: nowhere\n", "dataset nowhere: not in"),
    ("dataset: no_file\n", "dataset no_file: its entry has no file_name"),
    ("dataset: resampled\n", "dataset resampled: num_samples 100 (LLaMA-Factory resamples"),
    ("dataset: identity\nquantization_bit: 4\n", "quantization_bit: 4 -- QLoRA (a quantized base) is not offered"),
    ("dataset: identity\nneftune_noise_alpha: 5\n", "neftune_noise_alpha: 5 -- NEFTune noise is not offered"),
    ("dataset: identity\noptim: sgd\n", "optim: sgd -- zerofit trains with AdamW"),
    ("dataset: identity,glaive_toolcall_en_demo\nmix_strategy: interleave_under\n",
     "mix_strategy: interleave_under -- zerofit concatenates"),
    ("dataset: identity\nlr_scheduler_type: polynomial\n", "lr_scheduler_type: polynomial -- zerofit offers"),
    ("dataset: identity\nlr_scheduler_type: cosine\nlr_scheduler_kwargs: {num_cycles: 2}\n",
     "lr_scheduler_kwargs: {'num_cycles': 2} -- zerofit's cosine schedule takes none of them"),
    ("dataset: identity\nsave_steps: 0.1\n", "save_steps: 0.1 -- a ratio of the run's steps is not offered"),
    ("dataset: identity\nval_size: 0.5\n", "val_size: 0.5 -- zerofit holds out less than half"),
    ("dataset: identity\neval_dataset: identity\nval_size: 0.1\n", "val_size: 0.1 beside eval_dataset"),
    ("eval_dataset: identity\ndo_predict: true\n", "dataset: missing -- name the training data"),
    ("stage: pt\ndataset: c4_demo\nneat_packing: true\n", "neat_packing: true -- LLaMA-Factory refuses it"),
])
def test_a_run_zerofit_cannot_do_is_refused_naming_why(tmp_path, monkeypatch, capsys, text, message):
    err = refusal(tmp_path, monkeypatch, capsys, "model_name_or_path: m\n" + text)
    assert message in err
    assert err.startswith("zerofit: error: lf.yaml cannot be trained as LLaMA-Factory would (")


@pytest.mark.parametrize("info, message", [
    ("[1, 2]", "must hold a mapping of dataset names to entries, got list"),
    ("{oops", "is not valid JSON"),
])
def test_a_broken_dataset_info_is_named(tmp_path, monkeypatch, capsys, info, message):
    assert message in refusal(tmp_path, monkeypatch, capsys, "model_name_or_path: m\ndataset: identity\n", info)


def test_set_on_top_replaces_the_keys_it_excludes_and_its_todo(tmp_path, monkeypatch, capsys):
    """--set train.max_steps replaced nothing ("set train.max_steps or train.epochs, not both");
    a model.path given still printed the download to do."""
    model = tmp_path / "base"
    model.mkdir()
    config, text, err = translated(tmp_path, monkeypatch, capsys, "model_name_or_path: hub/model\ndataset: identity\n"
                                   "warmup_ratio: 0.1\n", "--set", "train.max_steps=5", "--set", "train.warmup_steps=2",
                                   "--set", "data.eval_examples=3", "--set", f"model.path={model}")
    assert config["train"]["max_steps"] == 5 and "epochs" not in config["train"]
    assert config["train"]["warmup_steps"] == 2 and "warmup_ratio" not in config["train"]
    assert config["data"]["eval_examples"] == 3 and "eval_fraction" not in config["data"]
    assert "eval" not in config  # eval.at_end false (no eval set) went with the eval_fraction 0 it came with
    assert config["model"]["path"] == str(model)
    assert "hf download" not in err and "hf download" not in text


def test_a_tokenizer_without_a_chat_template_takes_the_bundled_one_or_is_a_todo(tmp_path, monkeypatch, capsys):
    """LLaMA-Factory rendered a base model's rows with its `qwen` template: zerofit bundles that
    one, so the translation sets it; one it does not bundle is a to-do (zerofit would lay the
    rows out as `role:` lines), said before training, not found in the data line after it. A
    tokenizer with its own template keeps it, the bundled one offered."""
    from zerofit.demo import build_tokenizer

    model = tmp_path / "base"
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(model)
    config, text, err = translated(tmp_path, monkeypatch, capsys, f"model_name_or_path: {model}\n"
                                                                   f"dataset: identity\ntemplate: qwen\n")
    assert config["model"]["chat_template"] == "qwen" and "# template: qwen (bundled; " in text
    assert "chat template" not in err and validate(config).model.chat_template == "qwen"
    config, _, err = translated(tmp_path, monkeypatch, capsys, f"model_name_or_path: {model}\ndataset: identity\n"
                                                              f"template: baichuan2\n")
    assert "chat_template" not in config["model"]
    assert f"model.chat_template: {model}'s tokenizer has no chat template" in err
    assert "(zerofit bundles alpaca, chatml, default, " in err
    build_tokenizer().save_pretrained(model)  # the demo tokenizer has one
    config, text, err = translated(tmp_path, monkeypatch, capsys, f"model_name_or_path: {model}\n"
                                                                   f"dataset: identity\ntemplate: qwen\n")
    assert "no chat template" not in err and "chat_template" not in config["model"]
    assert "for LLaMA-Factory's own layout set model.chat_template: qwen" in text


def test_a_translation_train_would_refuse_is_refused_naming_the_key(tmp_path, monkeypatch, capsys):
    err = refusal(tmp_path, monkeypatch, capsys, "model_name_or_path: m\nfinetuning_type: full\ndataset: identity\n"
                                                  "cutoff_len: 4\n")
    assert "train.seq_len=4: Input should be greater than or equal to 8" in err


def test_a_misspelt_key_is_refused_with_the_one_meant_and_their_unread_keys_are_listed(tmp_path, monkeypatch, capsys):
    """`learning_rat: 1e-5` was listed as "not read" and the translation wrote HF's default 5e-5:
    LLaMA-Factory stops on a key no argument class declares, and so does the translation where
    one is spelt like a key it reads. A real key zerofit has no use for stays a comment; a name
    no release declares is left out and said on stderr."""
    base = "model_name_or_path: m\ndataset: identity\n"
    err = refusal(tmp_path, monkeypatch, capsys, base + "learning_rat: 1.0e-5\nnum_train_epoch: 2\n")
    assert "learning_rat: 1e-05 -- not a LLaMA-Factory or HF TrainingArguments key" in err
    assert "did you mean learning_rate?" in err and "did you mean num_train_epochs?" in err
    config, text, err = translated(tmp_path, monkeypatch, capsys,
                                   base + "enable_liger_kernel: true\ngroup_by_length: true\nfrobnicate: 3\n")
    assert "#   enable_liger_kernel: true -- not read: zerofit has no such setting" in text
    assert "#   group_by_length: true -- not read" in text  # transformers 4's, gone from 5: not refused
    assert "frobnicate: not a LLaMA-Factory or HF TrainingArguments key that zerofit knows" in err
    assert "enable_liger_kernel" not in err


def test_the_trainer_keys_read_from_transformers_source_are_its_dataclass_fields():
    """The translation reads Seq2SeqTrainingArguments' fields from transformers' source, not by
    importing it (torch and accelerate with it: seconds): the same fields as the class has."""
    import dataclasses

    from transformers import Seq2SeqTrainingArguments

    from zerofit.integrations.llamafactory import keys

    assert keys.trainer_fields() == {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)}


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


@pytest.mark.e2e
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
    assert "before `zerofit train`" not in done.stderr  # nothing left to do
    (tmp_path / "zerofit.yaml").write_text(done.stdout)
    run_zerofit(["train", "--config", str(tmp_path / "zerofit.yaml")])
    steps = [row for row in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2, 3]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    shape = plan["shape"]
    assert shape["micro_batch"] * shape["grad_accum"] * shape["world_size"] == 8  # their global batch, split
    assert plan["trainable_params"] < plan["params"] / 4  # adapters on every linear layer, the base frozen
    assert (tmp_path / "run" / "checkpoints" / "step-000003" / "MANIFEST.json").exists()


@pytest.mark.parametrize("text, message", [
    ("max_steps: '100'\nper_device_train_batch_size: '4'\nlora_rank: '8'\n", None),  # HF's parser types them
    ("max_steps: [1]\n", "max_steps: [1] -- expected a number"),
    ("optim: [adamw_torch]\n", "optim: ['adamw_torch'] -- expected a name"),
    ("lr_scheduler_kwargs: [1]\n", "lr_scheduler_kwargs: [1] -- expected a mapping or JSON text"),
    ("val_size: 1.0\n", "val_size: 1.0 -- holds out every row"),
])
def test_values_of_another_type_are_read_or_named(tmp_path, monkeypatch, capsys, text, message):
    """A string where HF's parser takes a number doubled it ('4' x 2 = '44') or raised a traceback."""
    if message is None:
        config, _, _ = translated(tmp_path, monkeypatch, capsys, "model_name_or_path: m\ndataset: identity\n" + text)
        assert config["train"]["max_steps"] == 100 and config["train"]["global_batch_size"] == 4
        assert config["lora"]["r"] == 8 and config["lora"]["alpha"] == 16
    else:
        assert message in refusal(tmp_path, monkeypatch, capsys, "model_name_or_path: m\ndataset: identity\n" + text)


@pytest.mark.parametrize("entry, message", [
    ({"file_name": "a.json", "columns": None}, "its columns must be a mapping, got None"),
    ({"file_name": "a.json", "columns": ["x"]}, "its columns must be a mapping, got ['x']"),
    ({"file_name": "a.json", "formatting": "sharegpt", "tags": None}, "its tags must be a mapping"),
    ({"file_name": "a.json", "formatting": "openai"}, "formatting openai -- LLaMA-Factory's are alpaca and sharegpt"),
    ({"file_name": ["a.json"]}, "its entry has no file_name"),
])
def test_a_dataset_entry_of_another_shape_is_named(tmp_path, monkeypatch, capsys, entry, message):
    assert f"dataset odd: {message}" in refusal(tmp_path, monkeypatch, capsys, "model_name_or_path: m\ndataset: odd\n",
                                                {"odd": entry})


def test_a_translated_alpaca_entry_reads_its_file_as_llamafactory_does(tmp_path, monkeypatch, capsys, tokenizer):
    """openorca's entry ({prompt: question, response: response, system: system_prompt}) through
    the translation and zerofit's reader: the named columns are the example, the `input` and
    `system` columns the entry does not name left out, as LLaMA-Factory leaves them."""
    from zerofit.config.schema import Config
    from zerofit.data import tokenize

    row = {"question": "add 2 and 2", "response": "4", "system_prompt": "be terse", "input": "unnamed",
           "system": "unnamed"}
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "openorca.json", [row] * 4)
    config, _, _ = translated(tmp_path, monkeypatch, capsys, "model_name_or_path: m\ndataset: openorca\n")
    data_config = Config.model_validate({**config, "model": {"config": "tiny"}}).data
    read = tokenize.read_examples([tmp_path / "data" / "openorca.json"], data_config, tokenizer)
    assert read.examples[0] == tokenize.tokenize_row({"instruction": "add 2 and 2", "output": "4",
                                                        "system": "be terse"}, "alpaca", tokenizer)
    assert read.unread == [f"{tmp_path / 'data' / 'openorca.json'}: its system column (system_prompt is read as "
                           f"system, data.columns)"]


def test_set_reaches_into_a_mapping_and_refuses_a_list_entry(tmp_path, monkeypatch, capsys):
    config, _, _ = translated(tmp_path, monkeypatch, capsys, "model_name_or_path: m\nstage: pt\ndataset: c4_demo\n",
                              "--set", "data.columns.text=body")
    assert config["data"]["columns"] == {"text": "body"}
    assert cli.main(["config", "--from-llamafactory", "lf.yaml", "--set", "train.adam_betas.0=0.8"]) == 1
    assert "--set train.adam_betas.0: train.adam_betas is not a mapping" in capsys.readouterr().err
