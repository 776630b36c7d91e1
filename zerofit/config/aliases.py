"""The names LLaMA-Factory and HF TrainingArguments give to what zerofit's config calls
otherwise, so that an unknown key from a config carried over names its zerofit key (or says
that zerofit does not offer it) instead of the nearest spelling of an unrelated one."""
from __future__ import annotations

THEIRS = {
    "model_name_or_path": "model.path (a local model directory)",
    "preprocessing_num_workers": "data.num_workers",
    "tokenized_path": "data.cache_dir (kept up to date: changed files or tokenizer are tokenized again)",
    "template": "the tokenizer's own chat template (a model directory carries its own), or model.chat_template: "
                "a .jinja file that renders the conversation, or the name of a LLaMA-Factory template zerofit "
                "bundles (llama3, qwen, mistral, alpaca, ...: `zerofit config --example` lists them)",
    "dataset": "data.path (files or directories; there is no dataset registry: a dataset_info.json entry's "
               "file_name is data.path, its columns data.columns)",
    "dataset_dir": "data.path (files or directories; there is no dataset registry: a dataset_info.json entry's "
               "file_name is data.path, its columns data.columns)",
    "cutoff_len": "train.seq_len (an example over it is cut as LLaMA-Factory cuts: data.truncation: balanced)",
    "val_size": "data.eval_fraction for a fraction, data.eval_examples for an integer (a count of rows held "
                "out; zerofit holds 0.05 of the rows out by default, LLaMA-Factory none: eval_fraction 0 for "
                "theirs)",
    "formatting": "data.format (auto, the default, tells each row's format by its fields: alpaca, sharegpt, or "
                  "OpenAI-style messages, which LLaMA-Factory calls sharegpt with role/content tags)",
    "columns": "data.columns (keyed as dataset_info.json's columns: {prompt: question, response: answer})",
    "file_name": "data.path (files or directories)",
    "tags": "not offered: turns are read as {role, content} (OpenAI roles) or {from, value} (human, gpt, "
            "observation, function_call), the tags LLaMA-Factory's defaults name",
    "finetuning_type": "lora.enabled: true for LoRA (full fine-tuning otherwise)",
    "lora_rank": "lora.r",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "lora_target": "lora.target_modules",
    "additional_target": "lora.modules_to_save",
    "output_dir": "run_dir",
    "per_device_train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "learning_rate": "train.lr",
    "num_train_epochs": "train.epochs",
    "lr_scheduler_type": "train.lr_schedule (cosine, linear or constant, HF's cosine_with_min_lr and "
                         "constant_with_warmup too; zerofit's decay ends at train.min_lr_ratio x lr, 0.1 by "
                         "default, HF's at 0: min_lr_ratio: 0 for theirs)",
    "lr_scheduler_kwargs": "train.min_lr_ratio for min_lr_rate (the only scheduler argument zerofit takes)",
    "warmup_ratio": "train.warmup_ratio",
    "max_grad_norm": "train.grad_clip",
    "adam_beta1": "train.adam_betas ([beta1, beta2])",
    "adam_beta2": "train.adam_betas ([beta1, beta2]; zerofit's default [0.9, 0.95], HF's [0.9, 0.999])",
    "adam_epsilon": "train.adam_eps",
    "bf16": "train.precision: bf16",
    "fp16": "train.precision: fp16",
    "save_steps": "checkpoint.every_steps",
    "save_total_limit": "checkpoint.keep_last",
    "eval_steps": "eval.every_steps",
    "logging_steps": "log.every_steps",
    "report_to": "log.tensorboard",
    "flash_attn": "model.attn_implementation",
}


# their keys that change nothing in how zerofit trains (a run needs no counterpart), and why
NO_EFFECT = {
    "do_train": "zerofit train trains",
    "overwrite_cache": "zerofit's tokenized rows (RUN_DIR/data-cache, or data.cache_dir) are named by the data "
                       "files, the data keys, the tokenizer and zerofit's code: any change tokenizes them again",
    "dataloader_num_workers": "batches come from memory",
    "plot_loss": "zerofit writes metrics.jsonl and plots memory over time (log.tensorboard for loss curves)",
    "overwrite_output_dir": "a run directory resumes, or starts over with `zerofit train --no-resume`",
    "save_only_model": "checkpoints always hold the optimizer, to resume; `zerofit export` writes the model",
    "ddp_timeout": "zerofit sets DeepSpeed's timeouts and tells a lost rank apart (elastic.lost_node_after_s)",
    "resume_from_checkpoint": "a run resumes from its newest intact checkpoint by itself",
    "per_device_eval_batch_size": "eval runs at the planner's training micro batch",
    "logging_dir": "TensorBoard files go to RUN_DIR/tensorboard",
    "run_name": "the run is named by run_dir",
    "deepspeed": "zerofit writes DeepSpeed's config from its memory plan (`zerofit lint FILE` checks yours)",
    "gradient_checkpointing": "the planner turns it on where memory needs it (model.gradient_checkpointing fixes it)",
    "mix_strategy": "several datasets are concatenated (LLaMA-Factory's default, concat)",
    "streaming": "datasets are read whole",
    "do_predict": "`zerofit chat` answers prompts from the exported model",
    "predict_with_generate": "`zerofit chat` answers prompts from the exported model",
    "do_eval": "eval runs when an eval set exists (val_size, eval_dataset)",
}


def hint(name: str) -> str | None:
    """What zerofit calls another tool's key `name`, or None when it is not one of theirs."""
    if name in NO_EFFECT:
        return f"not needed: {NO_EFFECT[name]}"
    return THEIRS.get(name)
