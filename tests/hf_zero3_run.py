"""An HF Trainer run under DeepSpeed ZeRO-3 (CPU accelerator, gloo; launched by torchrun) with
MemoryGuardCallback and an eval every 3 steps. Prints one JSON line: the parameter elements
still gathered when each training step begins, by step.

    torchrun --nproc_per_node 1 tests/hf_zero3_run.py OUT_DIR [--keep-gathered]
"""
import json
import sys

import torch
from test_hf import Tokens  # this script's directory leads sys.path
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from zerofit.integrations.hf_trainer import MemoryGuardCallback

# LLaMA-Factory's ds_z3_offload_config.json shape, with nothing persistent so every parameter is gathered
DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "train_batch_size": "auto", "bf16": {"enabled": False},
             "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                                   "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 1e9,
                                   "stage3_max_live_parameters": 1e9, "stage3_prefetch_bucket_size": 0}}


class GatheredAtStepBegin(TrainerCallback):
    def __init__(self):
        self.by_step: dict[int, int] = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.by_step[state.global_step + 1] = sum(p.ds_numel for p in model.parameters()
                                                  if p.ds_status.name == "AVAILABLE")


def main(out: str, keep_gathered: bool) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    args = TrainingArguments(output_dir=out, max_steps=6, per_device_train_batch_size=4, eval_strategy="steps",
                             eval_steps=3, per_device_eval_batch_size=4, save_strategy="no", logging_steps=100,
                             report_to="none", use_cpu=True, disable_tqdm=True, deepspeed=DS_CONFIG)
    spy = GatheredAtStepBegin()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64), eval_dataset=Tokens(16),
                      callbacks=[MemoryGuardCallback(release_after_eval=not keep_gathered), spy])
    trainer.train()
    print(json.dumps({"gathered_at_step_begin": spy.by_step,
                      "params": sum(p.ds_numel for p in model.parameters())}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], "--keep-gathered" in sys.argv[2:])
