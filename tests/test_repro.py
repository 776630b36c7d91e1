"""`zerofit doctor --repro` (repro.py): reproduction scripts of a zerofit run and an HF Trainer run, run standalone."""
import json
import os
import subprocess
import sys

import pytest
from conftest import deepspeed_lines, run_zerofit
from transformers import LlamaConfig


@pytest.mark.e2e
def test_repro_script_runs_standalone(clean_run, tmp_path):
    run, _, _ = clean_run
    done = run_zerofit(["doctor", "--repro", str(run), "--out", str(tmp_path / "repro.py")])
    assert "reproduction script" in done.stdout and deepspeed_lines(done) == []
    script = (tmp_path / "repro.py").read_text()
    assert "zerofit" not in script.split('"""', 2)[2]  # nothing but torch, transformers, deepspeed
    assert '"stage": 3' in script and '"num_hidden_layers": 2' in script
    assert "LORA = None" in script and "Unlike the run: the loss here is transformers'" in script
    ran = subprocess.run([sys.executable, "repro.py", "--steps", "3", "--save-every", "2", "--out", "ckpt"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "step 3 loss" in ran.stdout and "saved step 2: host RSS" in ran.stdout
    assert (tmp_path / "ckpt" / "step2").is_dir()
    assert "is deprecated" not in ran.stderr  # torch's warning about DeepSpeed's collectives, once per step


@pytest.mark.e2e
def test_repro_of_an_hf_trainer_run_runs(tmp_path):
    """HF Trainer's DeepSpeed config (as MemoryGuardCallback records it): steps_per_print is
    Infinity and there is no optimizer section (the Trainer passes its own AdamW). The script
    is valid Python, builds that optimizer, and trains at the recorded sequence length."""
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 4,
                 "gradient_clipping": 1.0, "bf16": {"enabled": True}, "steps_per_print": float("inf"),
                 "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                       "stage3_param_persistence_threshold": 640},
                 "zero_allow_untested_optimizer": True}
    model_config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               vocab_size=256).to_dict()
    out = tmp_path / "out"
    out.mkdir()
    (out / "memory_run.json").write_text(json.dumps({
        "source": "hf-trainer", "args": {"learning_rate": 1e-3, "gradient_checkpointing": False},
        "ds_config": ds_config, "model_config": model_config, "seq_len": 24}))
    done = run_zerofit(["doctor", "--repro", str(out), "--out", str(tmp_path / "repro.py")])
    assert "reproduction script" in done.stdout
    assert deepspeed_lines(done) == []  # "[WARNING] ... Setting accelerator to CPU" came with it
    script = (tmp_path / "repro.py").read_text()
    assert "SEQ_LEN = 24" in script and "CLIENT_OPTIMIZER_LR = 0.001" in script
    ran = subprocess.run([sys.executable, "repro.py", "--steps", "2", "--save-every", "0"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "step 2 loss" in ran.stdout


@pytest.mark.e2e
def test_repro_of_a_missing_run_says_so(tmp_path):
    done = run_zerofit(["doctor", "--repro", str(tmp_path / "nope")], check=False)
    assert done.returncode == 1 and "nope does not exist" in done.stderr


def hf_run_dir(directory, **recorded):
    """An HF Trainer run's output directory as MemoryGuardCallback records it (tiny model)."""
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
                 "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    model_config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               vocab_size=256).to_dict()
    directory.mkdir()
    (directory / "memory_run.json").write_text(json.dumps({
        "source": "hf-trainer", "args": {"learning_rate": 1e-3}, "ds_config": ds_config, "model_config": model_config,
        "seq_len": 24, **recorded}))
    return directory


@pytest.mark.e2e
def test_a_crafted_run_directory_cannot_inject_code(tmp_path):
    """The run directory went raw into the script's docstring: a name holding triple quotes, a
    newline and a line of code ended the docstring and the line ran with the script. Every value
    is quoted now; values that must be numbers and are not are refused."""
    marker = tmp_path / "pwned"
    payload = f'__import__("pathlib").Path({str(marker).replace("/", "|")!r}.replace("|", chr(47))).touch()'
    name = f'run """\n{payload}\n"""\r\t\\'
    run = hf_run_dir(tmp_path / name)
    run_zerofit(["doctor", "--repro", str(run)])
    script = run / "repro.py"
    compile(script.read_text(), str(script), "exec")
    ran = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0 and not marker.exists(), ran.stderr[-2000:]
    namespace = {}
    exec(compile(script.read_text().split("import argparse")[0], str(script), "exec"), namespace)
    assert repr(str(run)) in namespace["__doc__"]
    for field, value in (("seq_len", f"24\n{payload}"), ("args", {"learning_rate": f"1e-3\n{payload}"})):
        other = hf_run_dir(tmp_path / field, **{field: value})
        done = run_zerofit(["doctor", "--repro", str(other)], check=False)
        assert done.returncode == 1 and "not a number" in done.stderr and not marker.exists()
