"""A LLaMA-Factory training YAML (its examples/train_full, train_lora) as zerofit's config.

Every key that has a zerofit counterpart is carried over, and where LLaMA-Factory or HF
TrainingArguments default to something other than zerofit (the learning rate, Adam's beta2,
a schedule decaying to 0, no eval hold-out, no packing for sft, fp32 unless bf16 is set,
LoRA rank 8) their default is written out, so that the translated run trains as theirs
did. The per-device batch and accumulation become train.global_batch_size, for the planner
to split. Every other key is named with why it is left out; keys whose run zerofit cannot
do (DPO, QLoRA, a hub dataset) are refusals. `translate` is pure (dicts in, a Translation
out); `from_file` reads the YAML and its dataset_info.json, `render` writes zerofit's YAML.

Sources for the defaults: LLaMA-Factory src/llamafactory/hparams (data_args.py cutoff_len
2048, val_size 0, packing None -> on for stage pt only; finetuning_args.py lora_rank 8,
lora_alpha None -> 2 x rank, lora_dropout 0, lora_target all), data/parser.py (dataset_info
entries, their column and tag defaults), transformers TrainingArguments (learning_rate 5e-5,
num_train_epochs 3, lr_scheduler_type linear, adam_beta2 0.999, save_steps 500).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from zerofit.aliases import NO_EFFECT
from zerofit.config import Config, ConfigError, expand_path, read_yaml

# the ShareGPT tags LLaMA-Factory defaults to, and the OpenAI ones its dataset_info examples use:
# the two turn layouts zerofit reads ({from, value} and {role, content})
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
OPENAI_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
               "observation_tag": "tool", "function_tag": "function_call", "system_tag": "system"}

# their key: zerofit's, the value carried over as written
RENAMED = {
    "output_dir": "run_dir",
    "weight_decay": "train.weight_decay",
    "max_grad_norm": "train.grad_clip",
    "adam_epsilon": "train.adam_eps",
    "seed": "train.seed",
    "logging_steps": "log.every_steps",
    "save_total_limit": "checkpoint.keep_last",
    "packing": "data.packing",
    "neat_packing": "data.neat_packing",
    "train_on_prompt": "data.train_on_prompt",
    "mask_history": "data.mask_history",
    "trust_remote_code": "model.trust_remote_code",
    "additional_target": "lora.modules_to_save",
}
# keys whose run zerofit does not do: translating them would train something else
REFUSED = {
    "quantization_bit": "QLoRA (a quantized base) is not offered: drop quantization_bit for LoRA on the "
                        "bf16 base, which ZeRO-3 offload fits in host RAM",
    "adapter_name_or_path": "training on top of an existing adapter is not offered: merge it into the base "
                            "(`llamafactory-cli export`) and set that directory as model_name_or_path",
    "use_dora": "DoRA is not offered", "pissa_init": "PiSSA is not offered", "use_rslora": "rsLoRA is not offered",
    "freeze_vision_tower": "multimodal models are not offered", "image_max_pixels": "multimodal models are not offered",
    "pref_beta": "preference training (DPO, KTO, ORPO) is not offered",
}


@dataclass
class Translation:
    """zerofit's config as sections of keys, each with the comment saying where it came from."""
    values: dict[str, Any] = field(default_factory=dict)  # dotted key -> value
    comments: dict[str, str] = field(default_factory=dict)  # dotted key -> its source
    left_out: list[str] = field(default_factory=list)  # "key: value -- why"
    todo: list[str] = field(default_factory=list)  # what the user must still do before training
    refused: list[str] = field(default_factory=list)  # why this config cannot be trained by zerofit

    def set(self, key: str, value: Any, comment: str) -> None:
        self.values[key] = value
        self.comments[key] = comment

    def raw(self) -> dict:
        """The values as the nested dict config.validate takes."""
        out: dict = {}
        for key, value in self.values.items():
            *sections, name = key.split(".")
            node = out
            for section in sections:
                node = node.setdefault(section, {})
            node[name] = value
        return out


def translate(lf: dict, dataset_info: dict | None, dataset_dir: str, model_is_dir: bool) -> Translation:
    """`lf`, a LLaMA-Factory training YAML; `dataset_info` its dataset_dir's dataset_info.json
    (None when there is none); `model_is_dir`: whether model_name_or_path is a local directory."""
    out = Translation()
    stage = _stage(lf, out)
    _model(lf, out, model_is_dir)
    _method(lf, out)
    _data(lf, out, stage, dataset_info, dataset_dir)
    _batch_and_schedule(lf, out)
    _logging_and_saving(lf, out)
    for key, value in lf.items():
        if key in RENAMED:
            out.set(RENAMED[key], value, key)
        elif key in REFUSED:
            out.refused.append(f"{key}: {REFUSED[key]}")
        elif key in NO_EFFECT:
            out.left_out.append(f"{key}: {_shown(value)} -- {NO_EFFECT[key]}")
        elif key not in READ_TOGETHER:
            out.left_out.append(f"{key}: {_shown(value)} -- zerofit has no counterpart")
    return out


# keys the functions above read, some of them together with others
READ_TOGETHER = {
    "stage", "model_name_or_path", "template", "flash_attn", "disable_gradient_checkpointing",
    "finetuning_type", "lora_rank", "lora_alpha", "lora_dropout", "lora_target",
    "dataset", "eval_dataset", "dataset_dir", "val_size", "max_samples",
    "per_device_train_batch_size", "gradient_accumulation_steps", "cutoff_len", "learning_rate", "max_steps",
    "num_train_epochs", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio",
    "adam_beta1", "adam_beta2", "bf16", "fp16",
    "save_strategy", "save_steps", "eval_strategy", "evaluation_strategy", "eval_steps", "report_to"}


def _source(lf: dict, key: str, default_from: str) -> str:
    """The comment of a value taken from `key`, or from its default where the config has none."""
    return key if key in lf else f"{default_from} {key}"


def _shown(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _stage(lf: dict, out: Translation) -> str:
    stage = lf.get("stage", "sft")
    if stage not in ("sft", "pt"):
        out.refused.append(f"stage: {stage} -- zerofit trains sft (instruction and chat data) and pt (plain text); "
                           f"reward models, PPO, DPO and KTO are not offered")
    return stage


def _model(lf: dict, out: Translation, model_is_dir: bool) -> None:
    name = lf.get("model_name_or_path")
    if name is None:
        out.todo.append("model.path: the config names no model_name_or_path; set the local model directory")
        return
    out.set("model.path", name, "model_name_or_path")
    if not model_is_dir:
        out.todo.append(f"model.path: {name} is not a directory here and nothing downloads at run time: download "
                        f"it once (`hf download {name} --local-dir DIR`) and set model.path to DIR")
    attention = lf.get("flash_attn", "auto")
    if attention == "disabled":
        out.set("model.attn_implementation", "eager", "flash_attn: disabled")
    elif attention == "fa2":
        out.left_out.append("flash_attn: fa2 -- zerofit runs PyTorch's SDPA, which takes FlashAttention-2's kernel "
                            "on a GPU that has it")
    if lf.get("disable_gradient_checkpointing"):
        out.set("model.gradient_checkpointing", False, "disable_gradient_checkpointing: true")
    template = lf.get("template")
    if template == "alpaca":
        out.set("data.alpaca_template", "alpaca", "template: alpaca")
    elif template is not None:
        out.left_out.append(f"template: {template} -- conversations are rendered by the tokenizer's own chat template "
                            f"(model.path's tokenizer_config.json or chat_template.jinja), which a chat model "
                            f"ships; `zerofit chat` renders the same one")


def _method(lf: dict, out: Translation) -> None:
    kind = lf.get("finetuning_type", "lora")  # LLaMA-Factory's default is LoRA, not full
    if kind == "full":
        return
    if kind != "lora":
        out.refused.append(f"finetuning_type: {kind} -- zerofit trains every weight (full) or LoRA adapters (lora)")
        return
    rank = lf.get("lora_rank", 8)
    out.set("lora.enabled", True, _source(lf, "finetuning_type", "LLaMA-Factory's default (lora)"))
    out.set("lora.r", rank, _source(lf, "lora_rank", "LLaMA-Factory's default"))
    alpha = lf.get("lora_alpha")  # LLaMA-Factory: None means 2 x lora_rank
    out.set("lora.alpha", alpha if alpha is not None else 2 * rank,
            "lora_alpha" if alpha is not None else "LLaMA-Factory's default lora_alpha, 2 x lora_rank")
    out.set("lora.dropout", lf.get("lora_dropout", 0.0), _source(lf, "lora_dropout", "LLaMA-Factory's default"))
    target = lf.get("lora_target", "all")
    out.set("lora.target_modules", [t.strip() for t in target.split(",")] if isinstance(target, str) else target,
            _source(lf, "lora_target", "LLaMA-Factory's default (all)"))


def _names(value: Any) -> list[str]:
    """LLaMA-Factory's `dataset: a,b` or a YAML list."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return [str(name) for name in value or []]


def _data(lf: dict, out: Translation, stage: str, dataset_info: dict | None, dataset_dir: str) -> None:
    if stage == "pt":
        out.set("data.format", "text", "stage: pt")
    entries = {}
    for key, zerofit_key in (("dataset", "data.path"), ("eval_dataset", "data.eval_path")):
        names = _names(lf.get(key))
        if not names:
            continue
        if dataset_info is None:
            out.refused.append(f"{key}: {', '.join(names)} -- no dataset_info.json in {dataset_dir} (dataset_dir, read "
                               f"from the directory zerofit runs in, as LLaMA-Factory does): run from "
                               f"LLaMA-Factory's directory, or set dataset_dir")
            continue
        paths = []
        for name in names:
            entry = _entry(name, dataset_info, dataset_dir, out)
            if entry is not None:
                paths.append(os.path.join(dataset_dir, entry["file_name"]))
                entries[name] = entry
        if paths:
            out.set(zerofit_key, paths if len(paths) > 1 else paths[0], f"{key} in {dataset_dir}/dataset_info.json")
    if entries and stage == "sft":
        _formats(entries, out)
    if "dataset" not in lf:
        out.todo.append("data.path: the config names no dataset; set the data files")
    _hold_out(lf, out)
    if stage == "sft" and "packing" not in lf:
        out.set("data.packing", False, "LLaMA-Factory packs sft data only when packing: true")
    if "max_samples" in lf:
        out.set("data.max_samples", lf["max_samples"], "max_samples")


def _entry(name: str, dataset_info: dict, dataset_dir: str, out: Translation) -> dict | None:
    """The dataset_info.json entry `name`, when zerofit can read its files."""
    entry = dataset_info.get(name)
    if not isinstance(entry, dict):
        out.refused.append(f"dataset {name}: not in {dataset_dir}/dataset_info.json")
        return None
    if "file_name" not in entry:
        hub = next((entry[k] for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url") if k in entry), name)
        out.refused.append(f"dataset {name}: a hub dataset ({hub}) and nothing downloads at run time: download it "
                           f"once, then point a dataset_info.json entry's file_name (or data.path) at the files")
        return None
    if entry["file_name"].endswith((".csv", ".txt", ".arrow")):
        out.refused.append(f"dataset {name}: {entry['file_name']} -- zerofit reads .json, .jsonl and .parquet files "
                           f"(and directories of them): convert it")
        return None
    if entry.get("ranking") or {"chosen", "rejected", "kto_tag"} & set(entry.get("columns", {})):
        out.refused.append(f"dataset {name}: preference data (ranking, chosen/rejected) is for DPO and reward "
                           f"models, which zerofit does not train")
        return None
    if {"images", "videos", "audios"} & set(entry.get("columns", {})):
        out.refused.append(f"dataset {name}: images, videos and audio are not offered (text models only)")
        return None
    for key in ("subset", "split", "folder", "num_samples"):
        if key in entry and not (key == "split" and entry[key] == "train"):
            out.left_out.append(f"dataset {name}: {key}: {entry[key]} -- not offered: every row of its files is read")
    return entry


def _formats(entries: dict[str, dict], out: Translation) -> None:
    """data.format and data.columns from the entries' formatting, columns and tags."""
    formats, columns = set(), {}
    for name, entry in entries.items():
        formatting = entry.get("formatting", "alpaca")
        tags = {**SHAREGPT_TAGS, **entry.get("tags", {})}
        if formatting == "sharegpt" and not any(_same_turns(tags, known) for known in (SHAREGPT_TAGS, OPENAI_TAGS)):
            out.refused.append(f"dataset {name}: tags {entry['tags']} -- zerofit reads turns as {{from, value}} "
                               f"(human, gpt, observation, function_call) or {{role, content}} (OpenAI's roles): "
                               f"rename the file's tags")
            continue
        openai = formatting == "sharegpt" and tags["role_tag"] == "role"
        formats.add("messages" if openai else formatting)
        for column, file_column in entry.get("columns", {}).items():
            if columns.setdefault(column, file_column) != file_column:
                out.refused.append(f"dataset {name}: its {column} column is {file_column}, another dataset's "
                                   f"{columns[column]}: data.columns maps one name per field; rename one file's")
    if len(formats) == 1:
        out.set("data.format", formats.pop(), "formatting in dataset_info.json")
    columns = {key: value for key, value in columns.items() if key != value}
    if columns:
        out.set("data.columns", columns, "columns in dataset_info.json")


def _same_turns(tags: dict, known: dict) -> bool:
    """Whether `tags` name turns as `known` does: roles and content (the tool turns' tags
    aside, which LLaMA-Factory's OpenAI examples leave at the ShareGPT defaults)."""
    return all(tags[key] == known[key] for key in ("role_tag", "content_tag", "user_tag", "assistant_tag",
                                                   "system_tag"))


def _hold_out(lf: dict, out: Translation) -> None:
    size = lf.get("val_size", 0)
    if "eval_dataset" in lf:
        return
    if isinstance(size, float) and 0 < size < 1:
        out.set("data.eval_fraction", size, "val_size")
    elif size:  # LLaMA-Factory: an integer val_size is a count of examples
        out.set("data.eval_examples", int(size), "val_size (a count)")
    else:
        out.set("data.eval_fraction", 0.0, "LLaMA-Factory's default val_size, 0: no hold-out")


def _batch_and_schedule(lf: dict, out: Translation) -> None:
    micro, accumulation = lf.get("per_device_train_batch_size", 8), lf.get("gradient_accumulation_steps", 1)
    out.set("train.global_batch_size", micro * accumulation,
            f"per_device_train_batch_size {micro} x gradient_accumulation_steps {accumulation} on one GPU (x the "
            f"GPU count under torchrun); the planner splits it")
    out.set("train.seq_len", lf.get("cutoff_len", 2048), _source(lf, "cutoff_len", "LLaMA-Factory's default"))
    out.set("train.lr", lf.get("learning_rate", 5e-5), _source(lf, "learning_rate", "HF's default"))
    if lf.get("max_steps", -1) > 0:  # HF's -1: unset; steps win over epochs
        out.set("train.max_steps", lf["max_steps"], "max_steps")
    else:
        out.set("train.epochs", lf.get("num_train_epochs", 3.0), _source(lf, "num_train_epochs", "HF's default"))
    if lf.get("warmup_steps", 0) > 0:  # HF: warmup_steps wins over warmup_ratio
        out.set("train.warmup_steps", lf["warmup_steps"], "warmup_steps")
    elif lf.get("warmup_ratio", 0) > 0:
        out.set("train.warmup_ratio", lf["warmup_ratio"], "warmup_ratio")
    schedule = lf.get("lr_scheduler_type", "linear")
    where = "lr_scheduler_type" if "lr_scheduler_type" in lf else "HF's default lr_scheduler_type, linear"
    if schedule in ("linear", "cosine"):
        out.set("train.lr_schedule", schedule, where)
        out.set("train.min_lr_ratio", 0.0, "HF's schedules decay to 0")
    elif schedule == "cosine_with_min_lr":
        kwargs = lf.get("lr_scheduler_kwargs") or {}
        out.set("train.lr_schedule", "cosine", where)
        if "min_lr_rate" in kwargs:
            out.set("train.min_lr_ratio", kwargs["min_lr_rate"], "lr_scheduler_kwargs.min_lr_rate")
        else:
            out.refused.append("lr_scheduler_kwargs: cosine_with_min_lr needs min_lr_rate (a min_lr in absolute "
                               "terms is not offered: divide it by learning_rate)")
    elif schedule in ("constant", "constant_with_warmup"):
        out.set("train.lr_schedule", "constant", where)
        if schedule == "constant":
            out.set("train.warmup_steps", 0, "HF's constant schedule has no warmup")
    else:
        out.refused.append(f"lr_scheduler_type: {schedule} -- zerofit offers linear, cosine and constant")
    out.set("train.adam_betas", [lf.get("adam_beta1", 0.9), lf.get("adam_beta2", 0.999)],
            "adam_beta1, adam_beta2 (HF's defaults 0.9, 0.999 where unset)")
    precision = "bf16" if lf.get("bf16") else "fp16" if lf.get("fp16") else "fp32"
    out.set("train.precision", precision, "bf16" if precision == "bf16" else "fp16" if precision == "fp16" else
            "neither bf16 nor fp16 is set: LLaMA-Factory trains in fp32 (bf16 halves the GPU's share)")


def _logging_and_saving(lf: dict, out: Translation) -> None:
    save = lf.get("save_strategy", "steps")
    if save == "no":
        out.set("checkpoint.every_steps", 0, "save_strategy: no")
    elif save != "steps":
        out.left_out.append(f"save_strategy: {save} -- checkpoints are taken every checkpoint.every_steps")
    else:
        out.set("checkpoint.every_steps", lf.get("save_steps", 500), _source(lf, "save_steps", "HF's default"))
    evaluate = lf.get("eval_strategy", lf.get("evaluation_strategy", "no"))
    if evaluate == "steps" and "eval_steps" in lf:
        out.set("eval.every_steps", lf["eval_steps"], "eval_steps")
    elif evaluate == "steps":  # HF's eval_steps defaults to logging_steps
        out.set("eval.every_steps", lf.get("logging_steps", 500), "eval_strategy: steps, at HF's default eval_steps "
                "(logging_steps)")
    elif evaluate != "no":
        out.left_out.append(f"eval_strategy: {evaluate} -- eval runs every eval.every_steps and at the end")
    reports = lf.get("report_to", [])
    reports = [reports] if isinstance(reports, str) else reports
    if "tensorboard" in reports or "all" in reports:
        out.set("log.tensorboard", True, "report_to")
    others = [r for r in reports if r not in ("tensorboard", "none", "all")]
    if others:
        out.left_out.append(f"report_to: {', '.join(others)} -- zerofit writes TensorBoard files (log.tensorboard) "
                            f"and RUN_DIR/metrics.jsonl")


# ---------------------------------------------------------------------------- reading and writing
def from_file(path: Path) -> Translation:
    """The LLaMA-Factory YAML at `path` translated; its dataset_dir (default `data`) is read from
    the directory zerofit runs in, as llamafactory-cli reads it."""
    lf = read_yaml(path)
    dataset_dir = str(lf.get("dataset_dir", "data"))
    info_path = Path(expand_path(dataset_dir)) / "dataset_info.json"
    dataset_info = None
    if info_path.is_file():
        try:
            dataset_info = json.loads(info_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"{info_path} is not valid JSON ({e}); fix it, or set dataset_dir to another "
                              f"directory") from None
    model = lf.get("model_name_or_path")
    translation = translate(lf, dataset_info, dataset_dir, model_is_dir=bool(model) and Path(expand_path(model)).is_dir())
    for key in ("data.path", "data.eval_path"):
        paths = translation.values.get(key, [])
        missing = [p for p in ([paths] if isinstance(paths, str) else paths) if not Path(expand_path(p)).exists()]
        if missing:
            translation.todo.append(f"{key}: {', '.join(missing)} not found here (paths are read from the directory "
                                    f"zerofit runs in): run from LLaMA-Factory's directory, or set {key}")
    return translation


def render(translation: Translation, source: str) -> str:
    """zerofit's YAML, each key commented with where it came from, the keys left out listed above."""
    lines = [f"# zerofit config translated from the LLaMA-Factory config {source}",
             "# (`zerofit config --from-llamafactory`). Where LLaMA-Factory or HF default otherwise than",
             "# zerofit, their default is written out, so this run trains as theirs did."]
    if translation.left_out:
        lines += ["#", "# left out:"] + [f"#   {item}" for item in translation.left_out]
    if translation.todo:
        lines += ["#", "# to do before `zerofit train`:"] + [f"#   {item}" for item in translation.todo]
    sections: dict[str, list[str]] = {}
    for key, value in translation.values.items():
        section, _, name = key.rpartition(".")
        shown = yaml.safe_dump(value, default_flow_style=True, width=10_000).removesuffix("\n...\n").strip()
        sections.setdefault(section, []).append(f"{name}: {shown}  # {translation.comments[key]}")
    for section in ("", *Config.model_fields):
        if section in sections:
            lines += [""] + ([f"{section}:"] if section else [])
            lines += [f"  {line}" if section else line for line in sections[section]]
    return "\n".join(lines) + "\n"
