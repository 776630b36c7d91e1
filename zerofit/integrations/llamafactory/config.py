"""A LLaMA-Factory training YAML (its examples/train_full, train_lora) as zerofit's config.

Every key that has a zerofit counterpart is carried over, and where LLaMA-Factory or HF
TrainingArguments default to something other than zerofit (the learning rate, Adam's beta2,
a schedule decaying to 0, no eval hold-out, no packing for sft, fp32 unless bf16 is set,
LoRA rank 8, the columns a dataset_info.json entry does not name left unread) their default
is written out, so that the translated run trains as theirs did. The per-device batch and
accumulation become train.global_batch_size, for the planner to split. Keys that change
nothing in how zerofit trains are listed with why; keys whose value would train something
zerofit does not (DPO, QLoRA, NEFTune, a hub dataset) are refusals. `translate` is pure
(dicts in, a Translation out); `from_file` reads the YAML and its dataset_info.json,
`render` writes zerofit's YAML.

Sources: LLaMA-Factory src/llamafactory/hparams (data_args.py: cutoff_len 2048, val_size 0,
packing None -> on for stage pt only, neat_packing turns packing on; finetuning_args.py:
finetuning_type lora, lora_rank 8, lora_alpha None -> 2 x rank, lora_dropout 0, lora_target
all), data/parser.py (dataset_info entries: an entry's `columns` names every column read,
system / history / tools only when named), transformers TrainingArguments (learning_rate
5e-5, num_train_epochs 3, lr_scheduler_type linear, adam_beta2 0.999, save_steps 500,
per_device_train_batch_size 8, eval_steps = logging_steps, warmup_steps < 1 a ratio).
"""
from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from zerofit.config.aliases import NO_EFFECT
from zerofit.config.load import read_yaml
from zerofit.config.schema import Config
from zerofit.config.section import expand_path
from zerofit.core.errors import ConfigError
from zerofit.integrations.llamafactory import data, keys
from zerofit.models import bundled_chat_templates

# what AdamW is called in HF's `optim`: zerofit runs AdamW (DeepSpeed's CPU Adam, or fused Adam on the GPU)
ADAMW = {"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused"}

# their key: zerofit's, the value carried over as written
RENAMED = {
    "output_dir": "run_dir",
    "weight_decay": "train.weight_decay",
    "max_grad_norm": "train.grad_clip",
    "adam_epsilon": "train.adam_eps",
    "seed": "train.seed",
    "save_total_limit": "checkpoint.keep_last",
    "trust_remote_code": "model.trust_remote_code",
    "train_on_prompt": "data.train_on_prompt",
    "mask_history": "data.mask_history",
    "preprocessing_num_workers": "data.num_workers",
    "tokenized_path": "data.cache_dir",  # theirs stops after saving; zerofit keeps it up to date and trains on
}
# keys that, set (true, a number, a name), train what zerofit does not: refused, with why
REFUSED = {
    "quantization_bit": "QLoRA (a quantized base) is not offered: drop it for LoRA on the bf16 base, which ZeRO-3 "
                        "offload fits in host RAM",
    "adapter_name_or_path": "training on top of an existing adapter is not offered: merge it into the base "
                            "(`llamafactory-cli export`) and name that directory in model_name_or_path",
    "use_dora": "DoRA is not offered", "pissa_init": "PiSSA is not offered", "use_rslora": "rsLoRA is not offered",
    "loraplus_lr_ratio": "LoRA+ is not offered", "use_galore": "GaLore is not offered",
    "use_badam": "BAdam is not offered", "use_apollo": "APOLLO is not offered", "use_llama_pro": "LLaMA Pro is not offered",
    "neftune_noise_alpha": "NEFTune noise is not offered",
    "rope_scaling": "RoPE scaling is not offered: set it in the model's config.json",
    "label_smoothing_factor": "label smoothing is not offered",
    "resize_vocab": "resizing the vocabulary is not offered (ZeRO-3 partitions the embedding)",
    "new_special_tokens": "new special tokens are not offered (ZeRO-3 partitions the embedding)",
    "disable_shuffling": "zerofit always shuffles (seeded by train.seed)",
    "interleave_probs": "zerofit concatenates the datasets (mix_strategy concat)",
    "pure_bf16": "pure bf16 (no fp32 master weights) is not offered: zerofit keeps fp32 master weights",
}
# keys consumed with others by the functions below
READ_TOGETHER = {
    "stage", "model_name_or_path", "template", "flash_attn", "disable_gradient_checkpointing",
    "finetuning_type", "lora_rank", "lora_alpha", "lora_dropout", "lora_target", "additional_target",
    "dataset", "eval_dataset", "dataset_dir", "val_size", "max_samples", "packing", "neat_packing", "mix_strategy",
    "do_train", "do_predict", "per_device_train_batch_size", "gradient_accumulation_steps", "cutoff_len",
    "learning_rate", "max_steps", "num_train_epochs", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps",
    "warmup_ratio", "adam_beta1", "adam_beta2", "bf16", "fp16", "optim", "save_strategy", "save_steps",
    "eval_strategy", "evaluation_strategy", "eval_steps", "logging_steps", "report_to"}
# keys of which one replaces the other (a --set of one drops the translation's other)
EXCLUSIVE = {"train.max_steps": ("train.epochs",), "train.epochs": ("train.max_steps",),
             "train.warmup_steps": ("train.warmup_ratio",), "train.warmup_ratio": ("train.warmup_steps",),
             "data.eval_examples": ("data.eval_fraction", "eval.at_end"),
             "data.eval_fraction": ("data.eval_examples", "eval.at_end"),
             "data.eval_path": ("data.eval_fraction", "data.eval_examples", "eval.at_end"),
             "model.config": ("model.path",)}


@dataclass
class Translation:
    """zerofit's config as dotted keys, each with the comment saying where it came from."""
    values: dict[str, Any] = field(default_factory=dict)  # dotted key -> value
    comments: dict[str, str] = field(default_factory=dict)  # dotted key -> its source
    left_out: list[str] = field(default_factory=list)  # "key: value -- why"
    notes: list[str] = field(default_factory=list)  # what trains otherwise than theirs, for stderr
    todo: dict[str, str] = field(default_factory=dict)  # zerofit key -> what to set before training
    refused: list[str] = field(default_factory=list)  # why this config cannot be trained by zerofit

    def set(self, key: str, value: Any, comment: str) -> None:
        self.values[key] = value
        self.comments[key] = comment

    def override(self, key: str, value: Any) -> None:
        """A --set on top: the key's value (`data.columns.text`: one entry of the mapping), the keys
        it excludes dropped, its to-do done."""
        if key.count(".") >= 2:
            field_key, _, inner = key.rpartition(".")
            mapping = self.values.get(field_key, {})
            if not isinstance(mapping, dict):
                raise ConfigError(f"--set {key}: {field_key} is not a mapping; set it whole (--set {field_key}=[...])")
            key, value = field_key, {**mapping, inner: value}
        for other in EXCLUSIVE.get(key, ()):
            self.values.pop(other, None)
        self.todo.pop(key, None)
        self.set(key, value, "--set")

    def raw(self) -> dict:
        """The values as the nested dict configfile.validate takes."""
        out: dict = {}
        for key, value in self.values.items():
            *sections, name = key.split(".")
            node = out
            for section in sections:
                node = node.setdefault(section, {})
            node[name] = value
        return out


def translate(lf: dict, dataset_info: dict | None, dataset_dir: str, model_is_dir: bool,
              has_chat_template: bool | None = None) -> Translation:
    """`lf`, a LLaMA-Factory training YAML; `dataset_info` its dataset_dir's dataset_info.json
    (None when there is none); `model_is_dir`: whether model_name_or_path is a local directory;
    `has_chat_template`: whether its tokenizer has a chat template (None: unknown)."""
    lf, problems = as_llamafactory_reads(lf)
    out = Translation(refused=problems)
    stage = _stage(lf, out)
    _model(lf, out, model_is_dir, has_chat_template, stage)
    _method(lf, out)
    data.data_section(lf, out, stage, dataset_info, dataset_dir)
    _batch_and_schedule(lf, out)
    _logging_and_saving(lf, out)
    known = keys.theirs() | RENAMED.keys() | REFUSED.keys() | NO_EFFECT.keys() | READ_TOGETHER
    for key, value in lf.items():
        if key in RENAMED:
            out.set(RENAMED[key], value, key)
        elif key in REFUSED:
            if value:  # false, 0 or an empty list: their default, nothing to refuse
                out.refused.append(f"{key}: {_shown(value)} -- {REFUSED[key]}")
        elif key in NO_EFFECT:
            out.left_out.append(f"{key}: {_shown(value)} -- {NO_EFFECT[key]}")
        elif key in READ_TOGETHER:
            continue
        elif key in known:
            out.left_out.append(f"{key}: {_shown(value)} -- not read: zerofit has no such setting")
        else:
            _unknown(key, value, known, out)
    return out


def _unknown(key: str, value: Any, known: set[str], out: Translation) -> None:
    """A key no LLaMA-Factory or HF argument class declares: LLaMA-Factory stops on it ("Some keys
    are not used by the HfArgumentParser"). One spelt like a key it reads is refused with that key
    (`learning_rat` left out would train at HF's default learning rate, not the one meant);
    another (a key of a LLaMA-Factory release zerofit's list lacks) is left out and said."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
    if close:
        out.refused.append(f"{key}: {_shown(value)} -- not a LLaMA-Factory or HF TrainingArguments key (LLaMA-Factory "
                           f"stops on it too): did you mean {close[0]}?")
        return
    out.left_out.append(f"{key}: {_shown(value)} -- not read: no LLaMA-Factory or HF TrainingArguments key has this name")
    out.notes.append(f"{key}: not a LLaMA-Factory or HF TrainingArguments key that zerofit knows (LLaMA-Factory "
                     f"{keys.SOURCE_RELEASE} stops on unknown keys); left out")


# the types HF's argument parser reads a YAML's values into (LLaMA-Factory's hparams, TrainingArguments)
NUMBERS = {"per_device_train_batch_size", "gradient_accumulation_steps", "lora_rank", "lora_alpha", "lora_dropout",
           "cutoff_len", "max_samples", "val_size", "learning_rate", "num_train_epochs", "max_steps", "warmup_steps",
           "warmup_ratio", "weight_decay", "max_grad_norm", "adam_beta1", "adam_beta2", "adam_epsilon", "seed",
           "logging_steps", "save_steps", "eval_steps", "save_total_limit", "quantization_bit",
           "preprocessing_num_workers"}
NAMES = {"stage", "finetuning_type", "model_name_or_path", "output_dir", "dataset_dir", "template", "flash_attn",
         "optim", "lr_scheduler_type", "mix_strategy", "save_strategy", "eval_strategy", "evaluation_strategy"}
NAME_LISTS = {"dataset", "eval_dataset", "lora_target", "additional_target", "report_to"}  # `a,b` or a list


def as_llamafactory_reads(lf: dict) -> tuple[dict, list[str]]:
    """The YAML's values as LLaMA-Factory reads them, and the ones it could not: OmegaConf's YAML
    (1e-5 a number, not PyYAML's string), then HfArgumentParser's types ("4" for an integer
    field is 4); a null is the default, as if the key were not there; lr_scheduler_kwargs may
    be JSON text (HF's dict fields are)."""
    out, problems = {}, []
    for key, value in lf.items():
        if value is None:
            continue
        if key in NUMBERS:
            value = _number(value)
        elif key in NAMES and not isinstance(value, str) or key in NAME_LISTS and not isinstance(value, (str, list)):
            value = None
        elif key == "lr_scheduler_kwargs":
            value = _mapping(value)
        if value is None:
            expected = "a number" if key in NUMBERS else "a mapping or JSON text" if key == "lr_scheduler_kwargs" \
                else "a name" if key in NAMES else "names, comma-separated or a list"
            problems.append(f"{key}: {lf[key]!r} -- expected {expected}")
        else:
            out[key] = value
    return out, problems


def _number(value: Any) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    if not isinstance(value, str):
        return value
    for kind in (int, float):
        try:
            return kind(value.strip())
        except ValueError:
            pass
    return None


def _mapping(value: Any) -> dict | None:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def _source(lf: dict, key: str, default_from: str) -> str:
    """The comment of a value taken from `key`, or from its default where the config has none."""
    return key if key in lf else f"{default_from} {key}"


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _stage(lf: dict, out: Translation) -> str:
    stage = lf.get("stage", "sft")
    if stage not in ("sft", "pt"):
        out.refused.append(f"stage: {stage} -- zerofit trains sft (instruction and chat data) and pt (plain text); "
                           f"reward models, PPO, DPO and KTO are not offered")
    if lf.get("do_predict") or lf.get("do_train") is False:
        which = "do_predict: true" if lf.get("do_predict") else "do_train: false"
        out.refused.append(f"{which} -- a prediction run, not a training one: `zerofit chat` and `zerofit generate` "
                           f"answer prompts from an exported model")
    return stage


def _model(lf: dict, out: Translation, model_is_dir: bool, has_chat_template: bool | None, stage: str) -> None:
    name = lf.get("model_name_or_path")
    if name is None:
        out.refused.append("model_name_or_path: missing -- name the local model directory")
        return
    out.set("model.path", name, "model_name_or_path")
    if not model_is_dir:
        out.todo["model.path"] = (f"{name} is not a directory here and nothing downloads at run time: download it "
                                  f"once (`hf download {name} --local-dir DIR`) and set model.path to DIR")
    attention = lf.get("flash_attn", "auto")
    if attention == "disabled":
        out.set("model.attn_implementation", "eager", "flash_attn: disabled")
    elif attention == "fa2":
        out.left_out.append("flash_attn: fa2 -- zerofit runs PyTorch's SDPA, which takes FlashAttention-2's kernel "
                            "on a GPU that has it")
    if lf.get("disable_gradient_checkpointing"):
        out.set("model.gradient_checkpointing", False, "disable_gradient_checkpointing: true")
    template = lf.get("template")
    if template is None or stage == "pt":
        return
    bundled = template in bundled_chat_templates()
    if has_chat_template is False and bundled:
        out.set("model.chat_template", template, f"template: {template} (bundled; {name}'s tokenizer has none)")
        return
    out.left_out.append(f"template: {template} -- zerofit renders conversations and alpaca rows with the tokenizer's "
                        f"own chat template (model.path's, model.tokenizer's, or model.chat_template's), which for a "
                        f"chat model is what LLaMA-Factory's template of it writes"
                        + (f"; for LLaMA-Factory's own layout set model.chat_template: {template} (bundled: system, "
                           f"user and assistant turns, tool calls and their answers)" if bundled else ""))
    if has_chat_template is False:
        out.todo["model.chat_template"] = (
            f"{name}'s tokenizer has no chat template, so zerofit would lay conversations out as `role:` lines and "
            f"alpaca rows as Stanford's `### Instruction:` layout, not LLaMA-Factory's `{template}` template: set "
            f"model.chat_template to a .jinja file of that template (zerofit bundles "
            f"{', '.join(bundled_chat_templates())})")


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
    alpha = lf.get("lora_alpha")  # LLaMA-Factory: `lora_alpha or lora_rank * 2`
    out.set("lora.alpha", alpha or 2 * rank, "lora_alpha" if alpha else "LLaMA-Factory's default lora_alpha, 2 x lora_rank")
    out.set("lora.dropout", lf.get("lora_dropout", 0.0), _source(lf, "lora_dropout", "LLaMA-Factory's default"))
    target = lf.get("lora_target", "all")
    out.set("lora.target_modules", data.names(target), _source(lf, "lora_target", "LLaMA-Factory's default (all)"))
    if lf.get("additional_target"):
        out.set("lora.modules_to_save", data.names(lf["additional_target"]), "additional_target")


def _batch_and_schedule(lf: dict, out: Translation) -> None:
    micro, accumulation = lf.get("per_device_train_batch_size", 8), lf.get("gradient_accumulation_steps", 1)
    out.set("train.global_batch_size", micro * accumulation,
            f"per_device_train_batch_size {micro} x gradient_accumulation_steps {accumulation}; the planner splits it")
    out.notes.append(f"train.global_batch_size {micro * accumulation} is one GPU's per_device_train_batch_size x "
                     f"gradient_accumulation_steps: on N GPUs LLaMA-Factory steps on N x that, so set N x "
                     f"{micro * accumulation} for a run under torchrun")
    out.set("train.seq_len", lf.get("cutoff_len", 2048), _source(lf, "cutoff_len", "LLaMA-Factory's default"))
    out.set("train.lr", lf.get("learning_rate", 5e-5), _source(lf, "learning_rate", "HF's default"))
    if lf.get("max_steps", -1) > 0:  # HF's -1: unset; steps win over epochs
        out.set("train.max_steps", lf["max_steps"], "max_steps")
    else:
        out.set("train.epochs", lf.get("num_train_epochs", 3.0), _source(lf, "num_train_epochs", "HF's default"))
    _schedule(lf, out)
    optimizer = lf.get("optim", "adamw_torch")
    if optimizer not in ADAMW:
        out.refused.append(f"optim: {optimizer} -- zerofit trains with AdamW (DeepSpeed's CPU Adam when the optimizer "
                           f"is offloaded, fused Adam on the GPU)")
    out.set("train.adam_betas", [lf.get("adam_beta1", 0.9), lf.get("adam_beta2", 0.999)],
            "adam_beta1, adam_beta2 (HF's defaults 0.9, 0.999 where unset)")
    precision = "bf16" if lf.get("bf16") else "fp16" if lf.get("fp16") else "fp32"
    out.set("train.precision", precision, "bf16" if precision == "bf16" else "fp16" if precision == "fp16" else
            "neither bf16 nor fp16 is set: LLaMA-Factory trains in fp32 (bf16 halves the GPU's share)")


def _schedule(lf: dict, out: Translation) -> None:
    schedule, kwargs = lf.get("lr_scheduler_type", "linear"), dict(lf.get("lr_scheduler_kwargs") or {})
    where = "lr_scheduler_type" if "lr_scheduler_type" in lf else "HF's default lr_scheduler_type, linear"
    if schedule in ("linear", "cosine", "cosine_with_min_lr"):
        out.set("train.lr_schedule", "cosine" if schedule != "linear" else "linear", where)
        if schedule != "cosine_with_min_lr":
            out.set("train.min_lr_ratio", 0.0, "HF's schedules decay to 0")
        elif "min_lr_rate" in kwargs:
            out.set("train.min_lr_ratio", kwargs.pop("min_lr_rate"), "lr_scheduler_kwargs.min_lr_rate")
        else:
            out.refused.append("lr_scheduler_kwargs: cosine_with_min_lr needs min_lr_rate (a min_lr in absolute "
                               "terms is not offered: divide it by learning_rate)")
            kwargs.pop("min_lr", None)
        if schedule != "linear" and kwargs.get("num_cycles", 0.5) == 0.5:  # half a cosine: zerofit's
            kwargs.pop("num_cycles", None)
    elif schedule in ("constant", "constant_with_warmup"):
        out.set("train.lr_schedule", "constant", where)
    else:
        out.refused.append(f"lr_scheduler_type: {schedule} -- zerofit offers linear, cosine and constant")
    if kwargs:
        out.refused.append(f"lr_scheduler_kwargs: {kwargs} -- zerofit's {schedule} schedule takes none of them")
    warmup_steps, warmup_ratio = lf.get("warmup_steps", 0), lf.get("warmup_ratio", 0)
    if warmup_steps and 0 < warmup_steps < 1:  # transformers 5 reads a warmup_steps below 1 as a ratio
        warmup_steps, warmup_ratio = 0, warmup_steps
    if schedule == "constant":
        if warmup_steps or warmup_ratio:
            out.left_out.append("warmup: HF's constant schedule has none (constant_with_warmup warms up)")
    elif warmup_steps > 0:  # HF: warmup_steps wins over warmup_ratio
        out.set("train.warmup_steps", int(warmup_steps), "warmup_steps")
    elif warmup_ratio > 0:
        out.set("train.warmup_ratio", warmup_ratio, "warmup_ratio" if "warmup_ratio" in lf else
                "warmup_steps below 1, a ratio")
    if schedule != "constant" and (warmup_steps > 0 or warmup_ratio > 0):
        out.notes.append("warmup: zerofit's first step runs at lr / warmup steps, HF's at 0 (zerofit's warmup is one "
                         "step ahead: no step is spent at a learning rate of 0)")


def _logging_and_saving(lf: dict, out: Translation) -> None:
    for key in ("logging_steps", "save_steps", "eval_steps"):
        if 0 < lf.get(key, 1) < 1:
            out.refused.append(f"{key}: {lf[key]} -- a ratio of the run's steps is not offered: write a step count")
    if "logging_steps" in lf:
        out.set("log.every_steps", int(lf["logging_steps"]), "logging_steps")
    save = lf.get("save_strategy", "steps")
    if save == "no":  # nor zerofit's clock schedule: a checkpoint at the end only (save_final)
        out.set("checkpoint.every_steps", 0, "save_strategy: no")
        out.set("checkpoint.every_minutes", 0, "save_strategy: no")
    elif save == "steps":
        out.set("checkpoint.every_steps", int(lf.get("save_steps", 500)), _source(lf, "save_steps", "HF's default"))
    else:
        out.set("checkpoint.every_steps", 0, f"save_strategy: {save} is not offered: a checkpoint at the end "
                                             f"(checkpoint.save_final); set a step count")
    if "save_total_limit" not in lf and save != "no":
        out.left_out.append("save_total_limit: unset -- HF keeps every checkpoint, zerofit the newest "
                            "checkpoint.keep_last (2)")
    evaluate = lf.get("eval_strategy", lf.get("evaluation_strategy", "no"))
    if evaluate == "steps":  # HF's eval_steps defaults to logging_steps
        out.set("eval.every_steps", int(lf.get("eval_steps", lf.get("logging_steps", 500))),
                "eval_steps" if "eval_steps" in lf else "eval_strategy: steps, at HF's default eval_steps "
                                                        "(logging_steps)")
    elif evaluate != "no":
        out.left_out.append(f"eval_strategy: {evaluate} -- not offered: eval runs every eval.every_steps and at the "
                            f"end (eval.at_end)")
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
    the directory zerofit runs in, as llamafactory-cli reads it, and the data paths written
    absolute, so the translation runs from anywhere."""
    lf = read_yaml(path)
    dataset_dir = os.path.abspath(expand_path(str(lf.get("dataset_dir") or "data")))
    dataset_info = data.read_dataset_info(Path(dataset_dir) / "dataset_info.json")
    model = lf.get("model_name_or_path")
    model_dir = Path(expand_path(str(model))) if model else None
    is_dir = model_dir is not None and model_dir.is_dir()
    translation = translate(lf, dataset_info, dataset_dir, is_dir, has_chat_template(model_dir) if is_dir else None)
    for key in ("data.path", "data.eval_path"):
        paths = translation.values.get(key, [])
        missing = [p for p in ([paths] if isinstance(paths, str) else paths) if not Path(p).exists()]
        if missing:
            translation.todo[key] = f"{', '.join(missing)} not found: fix the entries' file_name, or set {key}"
    return translation


def has_chat_template(model_dir: Path) -> bool:
    """Whether the tokenizer saved in `model_dir` has a chat template (transformers keeps it in
    chat_template.jinja, chat_template.json or tokenizer_config.json's chat_template)."""
    if (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def render(translation: Translation, source: str) -> str:
    """zerofit's YAML, each key commented with where it came from, the keys left out listed above."""
    lines = [f"# zerofit config translated from the LLaMA-Factory config {source}",
             "# (`zerofit config --from-llamafactory`). Where LLaMA-Factory or HF default otherwise than",
             "# zerofit, their default is written out, so this run trains as theirs did."]
    for title, items in (("left out", translation.left_out), ("trains otherwise than theirs", translation.notes),
                         ("to do before `zerofit train`", [f"{k}: {v}" for k, v in translation.todo.items()])):
        if items:
            lines += ["#", f"# {title}:"] + [f"#   {item}" for item in items]
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
