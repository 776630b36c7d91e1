# LLaMA-Factory's training YAMLs (LoRA and full sft, their examples' keys) translated by
# `zerofit config --from-llamafactory` and trained on the GPU machine from a local model
# directory and a dataset_info.json, then exported and prompted. A smoke run, not a benchmark.
#   source .whl/prelude.sh || exit; export TORCH_CUDA_ARCH_LIST=9.0 CUDA_VISIBLE_DEVICES=0; bash bench/gpu_lf.sh
# Logs go to $OUT (bench/results/gpu-lf-N/ holds session N's).
set -x
mkdir -p /tmp/lfdata
python - <<'PY'
import json
import torch
from transformers import AutoModelForCausalLM
from zerofit.demo import build_tokenizer
from zerofit.models import config_from_name

with open("/tmp/lfdata/repeat.json", "w") as f:  # alpaca, as a JSON array (LLaMA-Factory's demos)
    json.dump([{"instruction": f"Repeat {i} times the word ok.", "input": "", "output": " ok" * (1 + i % 97),
                "system": "unread: dataset_info.json does not name it"} for i in range(2000)], f)
with open("/tmp/lfdata/chat.jsonl", "w") as f:  # sharegpt under its own column name
    for i in range(400):
        f.write(json.dumps({"dialog": [{"from": "human", "value": f"hi {i}"},
                                       {"from": "gpt", "value": "hello " * (i % 13 + 1)}]}) + "\n")
json.dump({"repeat": {"file_name": "repeat.json"},
           "chat": {"file_name": "chat.jsonl", "formatting": "sharegpt", "columns": {"messages": "dialog"}}},
          open("/tmp/lfdata/dataset_info.json", "w"))
model = AutoModelForCausalLM.from_config(config_from_name("llama-0.5b"), dtype=torch.bfloat16)
model.save_pretrained("/tmp/base05")
build_tokenizer().save_pretrained("/tmp/base05")
PY
for kind in ${KINDS:-lora full}; do  # KINDS=full: one of the two
  cat > /tmp/lf-$kind.yaml <<YAML
### model
model_name_or_path: /tmp/base05
### method
stage: sft
do_train: true
finetuning_type: $kind
lora_rank: 8
lora_target: all
deepspeed: examples/deepspeed/ds_z3_offload_config.json
### dataset
dataset: repeat,chat
dataset_dir: /tmp/lfdata
template: llama3
cutoff_len: 1024
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
### output
output_dir: $OUT/lf-$kind
logging_steps: 5
save_steps: 10
plot_loss: true
overwrite_output_dir: true
### train
per_device_train_batch_size: 2
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
max_steps: 20
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
### eval
val_size: 0.05
eval_strategy: steps
eval_steps: 10
YAML
  python -m zerofit config --from-llamafactory /tmp/lf-$kind.yaml --set plan.gpu_mem=24GiB \
    > $OUT/zf-$kind.yaml 2> $OUT/translate-$kind.log; echo "translate $kind rc $?"; cat $OUT/translate-$kind.log
  python -m zerofit train --config $OUT/zf-$kind.yaml > $OUT/train-$kind.log 2>&1; echo "train $kind rc $?"
  grep -v "^\[20" $OUT/train-$kind.log | grep -E "data:|not read|plan:|eval loss|done|error" | cut -c1-400
  python -m zerofit doctor $OUT/lf-$kind > $OUT/doctor-$kind.log 2>&1; echo "doctor $kind rc $?"
  grep -iE "gpu|host|finding|ended" $OUT/doctor-$kind.log | head -8
  python -m zerofit export $OUT/lf-$kind --out /tmp/exp-$kind --verify > $OUT/export-$kind.log 2>&1
  echo "export $kind rc $?"; tail -2 $OUT/export-$kind.log
  python -m zerofit generate /tmp/exp-$kind --prompt "Repeat 3 times the word ok." --max-new-tokens 8 2>&1 | tail -2
done
rm -rf $OUT/lf-*/checkpoints  # GBs: the logs, plan and memory timeline come back
