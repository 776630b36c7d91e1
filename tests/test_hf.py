"""MemoryGuardCallback on a real (tiny, CPU) HF Trainer run, read back by zerofit doctor."""
import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, child_env, free_port, read_jsonl, run_zerofit
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from zerofit.doctor.run import diagnose
from zerofit.integrations.hf_trainer import MemoryGuardCallback

RESIDUE = 256 * 2**20


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, seq=32, vocab=128):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class KeepsMemoryAfterSave(TrainerCallback):
    """A user callback with a bug: it keeps 256 MiB alive after every save."""

    def __init__(self):
        self.kept = []

    def on_save(self, args, state, control, **kwargs):
        self.kept.append(torch.ones(RESIDUE, dtype=torch.uint8))


def trainer_run(output_dir, callbacks, max_steps=8, evaluate_around=False):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    args = TrainingArguments(output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, save_strategy="steps", save_steps=3,
                             eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=4, logging_steps=100,
                             report_to="none", use_cpu=True, disable_tqdm=True, learning_rate=1e-3)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(16), callbacks=callbacks)
    if evaluate_around:  # a baseline eval before training
        trainer.evaluate()
    trainer.train()
    if evaluate_around:  # LLaMA-Factory's do_eval: after train() returned
        trainer.evaluate()
    return trainer


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "out"
    trainer_run(out, [KeepsMemoryAfterSave(), MemoryGuardCallback()])
    return out


def test_callback_writes_the_timeline_into_output_dir(hf_run):
    records = read_jsonl(hf_run / "memory.jsonl")
    phases = [(r["step"], r["phase"]) for r in records]
    assert phases[0] == (0, "start")
    assert {(s, "forward_backward") for s in range(1, 9)} <= set(phases)
    assert {(s, "optimizer_step") for s in range(1, 9)} <= set(phases)
    assert [s for s, p in phases if p == "save"] == [3, 6, 8]
    assert [s for s, p in phases if p == "eval"] == [4, 8]
    assert all(r["after_save"] for r in records if r["step"] in (4, 7) and r["phase"] == "forward_backward")
    saves = [r for r in records if r["phase"] == "save"]
    assert all(r["released_cache"] for r in saves)
    # the buggy callback ran before ours: each save's residue is measured against the step before
    assert all(r["residue_bytes"] >= 0.9 * RESIDUE for r in saves), [r["residue_bytes"] for r in saves]
    run = json.loads((hf_run / "memory_run.json").read_text())
    assert run["source"] == "hf-trainer" and run["model_config"]["num_hidden_layers"] == 2
    assert run["args"]["gradient_accumulation_steps"] == 2
    assert run["seq_len"] == 32  # the rows' input_ids, for `zerofit doctor --repro`


@pytest.mark.e2e
def test_doctor_reads_the_trainer_output_dir(hf_run):
    diagnosis = diagnose(hf_run)
    assert diagnosis.source == "hf-trainer"
    residue = next(f for f in diagnosis.findings if f.kind == "post_save_residue")
    assert residue.device == "host"
    assert set(residue.evidence["residue_bytes"]) == {3, 6, 8}  # the save at 8 (no step after it): as it measured
    assert all(b >= 0.9 * RESIDUE for b in residue.evidence["residue_bytes"].values())
    done = run_zerofit(["doctor", str(hf_run)])
    assert "HF Trainer run" in (hf_run / "report.html").read_text()
    assert "stays above the pre-save baseline" in done.stdout


def test_evaluate_outside_train_is_recorded(tmp_path):
    """trainer.evaluate() before train() and after it returned: both marked on the timeline
    (they crashed the user's script: no timeline yet, and one already closed)."""
    trainer_run(tmp_path / "out", [MemoryGuardCallback()], max_steps=2, evaluate_around=True)
    phases = [(r["step"], r["phase"]) for r in read_jsonl(tmp_path / "out" / "memory.jsonl")]
    assert phases[0] == (0, "eval") and phases[1] == (0, "start") and phases[-1] == (2, "eval")
    assert diagnose(tmp_path / "out").source == "hf-trainer"  # the doctor reads such a timeline


def test_watchdog_stops_a_trainer_run_after_saving(tmp_path):
    trainer = trainer_run(tmp_path / "out", [MemoryGuardCallback(watchdog_threshold=0.01, watchdog_action="stop")])
    assert trainer.state.global_step == 1
    assert (tmp_path / "out" / "checkpoint-1").is_dir()
    watchdog = [r for r in read_jsonl(tmp_path / "out" / "memory.jsonl") if r["phase"] == "watchdog"]
    assert len(watchdog) == 1 and watchdog[0]["device"] == "host" and watchdog[0]["action"] == "stop"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="watchdog_action='panic'"):
        MemoryGuardCallback(watchdog_action="panic")
    with pytest.raises(ValueError, match="watchdog_threshold=1.5"):
        MemoryGuardCallback(watchdog_threshold=1.5)


def test_plan_writes_a_deepspeed_config_hf_trainer_takes(tmp_path, capsys):
    """The plan's deepspeed_config fixed lr, betas and the batch: HF Trainer refused it against
    default TrainingArguments ("ds optimizer.params.betas=[0.9, 0.95] vs hf adam_beta1+adam_beta2").
    --ds-config writes those keys "auto"; the Trainer fills them without a mismatch."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from zerofit.cli import main

    path = tmp_path / "ds.json"
    flags = ["plan", "--model", "tiny", "--micro-batch", "2", "--grad-accum", "4", "--precision", "fp32"]
    assert main(flags + ["--json", "--ds-config", str(path)]) == 0
    out = capsys.readouterr()
    resolved, written = json.loads(out.out)["deepspeed_config"], json.loads(path.read_text())
    assert written["zero_optimization"] == resolved["zero_optimization"]  # the plan's ZeRO settings
    assert "--per_device_train_batch_size 2 --gradient_accumulation_steps 4" in " ".join(out.err.split())
    # planned as HF Trainer runs: its own loss (fp32 logits), not zerofit's; the allocator setting said
    assert json.loads(out.out)["shape"]["chunked_loss"] is False and "expandable_segments:True" in out.err
    # the Trainer hands DeepSpeed's optimizer one group: weight decay on norms and biases, said
    assert "--weight_decay then decays norm weights and biases too" in " ".join(out.err.split())
    assert "give the Trainer zerofit.integrations.hf_trainer.MemoryGuardCallback()" in " ".join(out.err.split())  # its evals
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=4, learning_rate=1e-3, use_cpu=True, report_to=[])
    for ds, mismatches in ((resolved, True), (written, False)):
        hf = HfTrainerDeepSpeedConfig(json.loads(json.dumps(ds)))
        hf.trainer_config_process(args)
        assert bool(hf.mismatches) is mismatches, hf.mismatches
    assert hf.config["optimizer"]["params"]["lr"] == 1e-3 and hf.config["train_batch_size"] == 8


def test_plan_writes_no_deepspeed_config_when_nothing_fits(tmp_path, capsys):
    """It wrote one (and the Trainer flags to run it) while saying nothing fits, exit 1."""
    from zerofit.cli import main

    path = tmp_path / "ds.json"
    assert main(["plan", "--model", "llama-8b", "--gpu-mem", "24GiB", "--host-mem", "8GiB", "--accelerator", "cuda",
                 "--ds-config", str(path)]) == 1
    assert not path.exists() and "ds.json not written: nothing fits" in " ".join(capsys.readouterr().err.split())
    assert main(["plan", "--model", "llama-8b", "--gpu-mem", "24GiB", "--host-mem", "8GiB", "--accelerator", "cuda",
                 "--json"]) == 1
    out = capsys.readouterr()  # exit 1 said on stderr too, not only as "fits": false inside the JSON
    assert json.loads(out.out)["fits"] is False and "nothing fits" in out.err
    # zerofit's checkpoint disk alone short: the DeepSpeed config does not use it, so it is written
    assert main(["plan", "--model", "llama-0.5b", "--gpu-mem", "24GiB", "--host-mem", "64GiB", "--accelerator", "cuda",
                 "--disk-free", "1GB", "--ds-config", str(path)]) == 1
    assert path.is_file() and "only zerofit's checkpoint disk falls short" in " ".join(capsys.readouterr().err.split())
    assert main(["plan", "--model", "tiny", "--ds-config", str(tmp_path / "made" / "ds.json")]) == 0
    assert (tmp_path / "made" / "ds.json").is_file()  # its folder made, as doctor --out and export --out do
    (tmp_path / "afile").touch()
    assert main(["plan", "--model", "tiny", "--ds-config", str(tmp_path / "afile" / "ds.json")]) == 1
    assert "cannot be written" in capsys.readouterr().err


def zero3_trainer_run(tmp_path, *flags) -> dict:
    """tests/hf_zero3_run.py under torchrun: Trainer + DeepSpeed ZeRO-3 with parameter offload."""
    out = tmp_path / ("kept" if flags else "released")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_port",
                           str(free_port()), str(ROOT / "tests" / "hf_zero3_run.py"), str(out), *flags],
                          env=child_env({"PYTHONPATH": str(ROOT)}), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    evals = [r for r in read_jsonl(out / "memory.jsonl") if r["phase"] == "eval"]
    return {**result, "eval_steps": [r["step"] for r in evals], "released": [r["released_gathered"] for r in evals]}


@pytest.mark.e2e
def test_parameters_an_eval_left_gathered_are_partitioned_before_the_next_step(tmp_path):
    """HF Trainer does not partition what ZeRO-3 keeps gathered after an eval's forward (no
    backward follows), and the first training step after it gathers its window on top (on the
    H200: detectors.after_eval_spike). MemoryGuardCallback partitions them after each eval batch."""
    released = zero3_trainer_run(tmp_path)
    assert released["eval_steps"] == [3, 6] and released["released"] == [True, True]
    assert set(released["gathered_at_step_begin"].values()) == {0}  # step 4 opens after the eval at 3
    kept = zero3_trainer_run(tmp_path, "--keep-gathered")  # HF Trainer's own behaviour
    assert kept["released"] == [False, False]
    gathered = {int(step): n for step, n in kept["gathered_at_step_begin"].items()}
    assert gathered[4] == kept["params"] and gathered[3] == 0 and gathered[5] == 0  # the whole model


def test_the_release_passes_over_an_optimizer_without_zero3():
    """A Trainer's optimizer that is not DeepSpeed's (a bare torch one, or accelerate's wrapper of
    one) has nothing gathered: the callback's release leaves it alone instead of raising."""
    from zerofit.train.engine import release_gathered

    bare = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    release_gathered(bare)  # it raised AttributeError: no .optimizer
    callback = MemoryGuardCallback()
    callback.on_prediction_step(None, None, None, optimizer=bare)
