# A smoke run of every verb on the GPU machine (not a benchmark: exit codes, --verify, the doctor's
# plan vs measured). From the project root there:
#   source .whl/prelude.sh || exit; export TORCH_CUDA_ARCH_LIST=9.0 CUDA_VISIBLE_DEVICES=0; bash bench/gpu_smoke.sh > $OUT/smoke.out 2>&1
# The run directories go to $RUNS (/tmp/smoke), their logs to $RUNS/logs, which ends as one file,
# $OUT/logs.tgz: the device returns 8 files at most (bench/results/gpu-smoke-N/ holds session N's).
RUNS=${RUNS:-/tmp/smoke}
LOGS=$RUNS/logs
mkdir -p "$LOGS"
set -x
python - <<'PY'
import json, random
random.seed(0)
with open("/tmp/sft.jsonl", "w") as f:
    for i in range(2000):
        f.write(json.dumps({"instruction": f"Repeat {i} times the word ok.", "output": " ok" * (1 + i % 97)}) + "\n")
    for i in range(200):
        f.write(json.dumps({"conversations": [{"from": "human", "value": f"hi {i}"}, {"from": "gpt", "value": "hello " * (i % 13 + 1)}]}) + "\n")
PY
python -m zerofit train --run-dir $RUNS/demo --set train.max_steps=40 > $LOGS/demo.log 2>&1; echo "demo rc $?"
tail -5 $LOGS/demo.log
cat > /tmp/c.yaml <<YAML
run_dir: $RUNS/r05
model: {config: llama-0.5b, tokenizer: /tmp/tok}
data: {path: /tmp/sft.jsonl, packing: false}
train: {seq_len: 512, global_batch_size: 16, max_steps: 20, lr: 1e-4, warmup_steps: 2}
eval: {every_steps: 10, max_sequences: 64}
checkpoint: {every_steps: 10, keep_last: 2}
plan: {gpu_mem: 24GiB}
YAML
python -c "from zerofit.demo import build_tokenizer; build_tokenizer().save_pretrained('/tmp/tok')"
python -m zerofit train --config /tmp/c.yaml > $LOGS/r05.log 2>&1; echo "r05 rc $?"
grep -v "^\[20" $LOGS/r05.log | tail -25
python -m zerofit export $RUNS/r05 --out /tmp/exp --verify > $LOGS/export.log 2>&1; echo "export rc $?"; tail -4 $LOGS/export.log
python -m zerofit doctor $RUNS/r05 --out $LOGS/report.html > $LOGS/doctor.log 2>&1; echo "doctor rc $?"; head -30 $LOGS/doctor.log
python -m zerofit generate /tmp/exp --prompt "hi" --max-new-tokens 8 2>&1 | tail -3
# plain packing of prompted rows: whole examples, best fit, rows closed by padding (no mask)
python -m zerofit train --config /tmp/c.yaml --run-dir $RUNS/r05w --set data.packing=true \
  --set train.max_steps=10 --set checkpoint.every_steps=0 > $LOGS/r05w.log 2>&1
echo "r05w rc $?"; grep -v "^\[20" $LOGS/r05w.log | tail -8
# neat packing (whole examples, best fit, a block-diagonal mask): the planner's mask against the GPU
python -m zerofit train --config /tmp/c.yaml --run-dir $RUNS/r05n --set data.packing=true \
  --set data.neat_packing=true --set train.max_steps=10 --set checkpoint.every_steps=0 > $LOGS/r05n.log 2>&1
echo "r05n rc $?"; grep -v "^\[20" $LOGS/r05n.log | tail -8
python -m zerofit doctor $RUNS/r05n > $LOGS/doctor-neat.log 2>&1; echo "doctor neat rc $?"; head -20 $LOGS/doctor-neat.log
# the export fine-tuned again from its directory (model.path: weight headers checked before the build)
python -m zerofit train --config /tmp/c.yaml --run-dir $RUNS/r05p --set model.path=/tmp/exp --set model.config=null \
  --set model.tokenizer=null --set train.max_steps=5 --set checkpoint.every_steps=0 > $LOGS/r05p.log 2>&1
echo "r05p rc $?"; grep -v "^\[20" $LOGS/r05p.log | tail -8
# async saves capped as the planner caps them (half of plan.host_mem), 0.5B checkpoints of ~6 GB
python -m zerofit train --config /tmp/c.yaml --run-dir $RUNS/r05a --set plan.host_mem=64GiB \
  --set checkpoint.async_save=true --set train.max_steps=10 --set checkpoint.every_steps=5 > $LOGS/r05a.log 2>&1
echo "r05a rc $?"; grep -v "^\[20" $LOGS/r05a.log | grep -E "async|checkpoint|done|plan:"
# examples over seq_len cut as LLaMA-Factory's cutoff_len cuts (data.truncation: balanced), padded rows
python -m zerofit train --config /tmp/c.yaml --run-dir $RUNS/r05t --set train.seq_len=96 \
  --set train.max_steps=5 --set checkpoint.every_steps=0 > $LOGS/r05t.log 2>&1
echo "r05t rc $?"; grep -v "^\[20" $LOGS/r05t.log | grep -E "data:|cut to|done|plan:"
# 20k rows tokenized by forked workers (data.num_workers' default) into a shared data.cache_dir, which a
# second run directory then reads instead of tokenizing
python -c "
import json
with open('/tmp/sft20k.jsonl', 'w') as f:
    for i in range(20000):
        f.write(json.dumps({'instruction': f'Repeat {i} times the word ok.', 'output': ' ok' * (1 + i % 97)}) + '\n')"
for run in r05c1 r05c2; do
  /usr/bin/time -f "$run %e s" python -m zerofit train --config /tmp/c.yaml --run-dir $RUNS/$run \
    --set data.path=/tmp/sft20k.jsonl --set data.cache_dir=/tmp/tokcache --set train.max_steps=3 \
    --set checkpoint.every_steps=0 > $LOGS/$run.log 2>&1
  echo "$run rc $?"; grep -v "^\[20" $LOGS/$run.log | grep -E "tokeniz|data:|done| s$"
done
tar czf "$OUT/logs.tgz" -C "$RUNS" logs
