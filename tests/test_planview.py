"""`zerofit plan` (planview.py and its CLI): plan.json, the plan line, the LoRA advice, --explain, flags."""
import json
from pathlib import Path

import pytest
from conftest import TINY, config, cuda_box

from zerofit.core.timeline import human_bytes
from zerofit.plan import choose, steptime
from zerofit.plan import spec as modelspec


def test_a_full_fine_tune_that_fits_nowhere_is_told_whether_lora_would():
    """llama-8b's full fine-tune needs ~145 GiB of host beside a 24 GiB card: the LoRA of the
    config's own lora section (rank 8 here) fits, and the advice says so with the numbers the
    planner gives that LoRA run; where even LoRA's frozen base fits nowhere, and for a LoRA run,
    no such line."""
    from zerofit.plan import render

    full = config(model={"config": "llama-8b"}, lora={"r": 8})
    decision, _, hw = render.plan_config(full, 1, hw=cuda_box("24GiB", host="64GiB"))
    assert not decision.plan.fits
    lora = [a for a in decision.advice if a.startswith("lora.enabled=true")]
    assert len(lora) == 1 and "rank 8 adapters on the frozen base" in lora[0] and "instead of 8.03B" in lora[0]
    as_lora, _, _ = render.plan_config(config(model={"config": "llama-8b"}, lora={"r": 8, "enabled": True}), 1, hw=hw)
    assert as_lora.plan.fits and f"fits as {choose.describe(as_lora.plan)};" in lora[0]
    assert f"host {human_bytes(as_lora.plan.devices['host'].total_bytes)} of" in lora[0]
    assert lora[0].endswith(f"~{as_lora.plan.step_seconds:.2f} s a step")
    assert "lora.enabled=true" in str(choose.refuse(decision))  # what train prints when it refuses
    # the frozen 16-bit base alone (16 GB) is over an 8 GiB card and a 4 GiB host
    for lora_section in ({"r": 8}, {"r": 8, "enabled": True}):
        tight, _, _ = render.plan_config(config(model={"config": "llama-8b"}, lora=lora_section), 1,
                                           hw=cuda_box("8GiB", host="4GiB"))
        assert not tight.plan.fits and tight.advice and not any(a.startswith("lora.") for a in tight.advice)


def test_plan_json_has_the_documented_keys():
    from zerofit.plan import render

    cfg = config(train={"micro_batch_size": 1})
    decision, spec, hw = render.plan_config(cfg, 1, hw=cuda_box("8GiB"))
    out = render.plan_json(decision, spec, hw)
    for key in ("fits", "params", "devices", "save_peak", "start_peak", "first_step_after_save_peak", "deepspeed_config",
                "estimated_step_seconds", "step_terms", "checkpoint_bytes", "export_peak"):
        assert key in out, key
    for device in ("gpu", "host", "disk"):
        assert {"total_bytes", "budget_bytes", "components"} <= set(out["devices"][device])
        assert out["devices"][device]["total_bytes"] == sum(out["devices"][device]["components"].values())
    assert "gpu" in out["save_peak"] and "host" in out["first_step_after_save_peak"]
    assert '"auto"' not in str(out["deepspeed_config"]) and out["deepspeed_config"]["zero_optimization"]["stage"] == 3
    assert out["estimated_step_seconds"] == steptime.step_seconds(out["step_terms"]) > 0


def test_the_plan_line_train_says_names_what_runs_and_who_chose_it():
    from zerofit.core.timeline import human_bytes
    from zerofit.plan import render

    cfg = config(train={"micro_batch_size": 1}, zero={"offload_optimizer": "cpu"})
    decision, spec, hw = render.plan_config(cfg, 1, hw=cuda_box("8GiB"))
    line = render.plan_line(decision)
    gpu = decision.plan.devices["gpu"]
    assert line.startswith(f"plan: {choose.describe(decision.plan)} (the planner chose ")
    chosen = line.split("the planner chose ")[1].split(")")[0].split(", ")
    assert "zero.offload_param" in chosen and "model.gradient_checkpointing" in chosen
    assert "zero.offload_optimizer" not in chosen and chosen[-1] == "bucket and window sizes"  # set by hand; tuning
    assert f"predicted peak gpu {human_bytes(gpu.total_bytes)} of {human_bytes(gpu.usable_bytes)}, host " in line
    assert "usable (the budgets less plan.headroom 10%); ~" in line  # the doctor's figure is the whole budget
    fixed = cfg.model_copy(update={"plan": cfg.plan.model_copy(update={"enabled": False})})
    assert "(plan.enabled false: as configured)" in render.plan_line(render.plan_config(fixed, 1,
                                                                                            hw=cuda_box("8GiB"))[0])


# ----------------------------------------------------------------------- the CLI
@pytest.mark.e2e
def test_plan_cli_json_and_exit_codes():
    import json

    from conftest import run_zerofit

    done = run_zerofit(["plan", "--model", "tiny", "--seq-len", "64", "--micro-batch", "2", "--json"])
    out = json.loads(done.stdout)
    assert out["fits"] is True and out["params"] == TINY and out["accelerator"] == "cpu"
    assert out["shape"]["seq_len"] == 64 and out["deepspeed_config"]["train_micro_batch_size_per_gpu"] == 2
    for device in ("gpu", "host", "disk"):
        assert {"total_bytes", "budget_bytes", "components"} <= set(out["devices"][device])
    assert set(out["save_peak"]) >= {"gpu", "host"} and set(out["first_step_after_save_peak"]) >= {"gpu", "host"}
    assert out["estimated_step_seconds"] > 0 and out["step_terms"]
    over = run_zerofit(["plan", "--model", "llama-8b", "--gpu-mem", "24GiB", "--host-mem", "16GiB", "--explain"],
                       check=False)
    assert over.returncode == 1
    assert "does not fit" in over.stdout and "what would fit" in over.stdout and "GiB of GPU memory per rank" in over.stdout
    assert "candidates" in over.stdout and "reduce / prefetch / persistence" in over.stdout  # --explain
    assert "max(compute, pcie_params + zero3_hooks, pcie_grads)" in " ".join(over.stdout.split())  # how the terms add up


def test_explain_tells_candidates_apart_by_their_buckets():
    """Candidates differing only in bucket sizes read alike in the configuration column: the
    buckets column is what tells them apart (llama-1.5b at 24 GiB: three ratio-0.75 rows)."""
    from rich.console import Console

    from zerofit.core.timeline import human_count
    from zerofit.plan import render

    assert [human_count(n) for n in (500_000_000, 3_774_873, 640, 262_668_288, 8_030_261_248, 82_496)] == \
        ["500M", "3.77M", "640", "263M", "8.03B", "82.5K"]
    spec, hw = modelspec.from_name("llama-1.5b"), cuda_box(host="64GiB")
    decision = choose.decide(config(train={"micro_batch_size": 1}), spec, hw, 1)
    alike = {}
    for p in decision.considered:
        alike.setdefault(choose.describe(p), set()).add(render.buckets(p.candidate))
    assert any(len(b) > 1 for b in alike.values())
    console = Console(record=True, width=200)
    render.render_explain(decision, console)
    text = console.export_text()
    assert render.buckets(decision.plan.candidate) in text


def test_plan_for_another_machine_takes_its_free_disk(capsys):
    """Checkpoints were judged against this machine's free disk even with every other figure
    given for another machine: --disk-free stands in for it."""
    from zerofit.cli import main

    flags = ["plan", "--model", "llama-8b", "--gpu-mem", "24GiB", "--host-mem", "256GiB", "--json"]
    assert main(flags + ["--disk-free", "50GB"]) == 1
    small = json.loads(capsys.readouterr().out)
    assert small["devices"]["disk"]["budget_bytes"] == 50 * 10**9 and not small["devices"]["disk"]["fits"]
    assert main(flags + ["--disk-free", "2TB"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"]["disk"]["budget_bytes"] == 2 * 10**12


def test_a_mixture_of_experts_is_said_to_be_priced_as_dense(tmp_path, capsys):
    from zerofit.cli import main

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4}))
    assert modelspec.from_name(str(tmp_path)).experts == 4 and modelspec.from_name("tiny").experts == 0
    main(["plan", "--model", str(tmp_path), "--gpu-mem", "24GiB", "--disk-free", "1TB"])
    main(["plan", "--model", "tiny", "--gpu-mem", "24GiB", "--disk-free", "1TB"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("a mixture of experts (4 experts a layer)") == 1


def test_hardware_flags_out_of_range_are_usage_errors(capsys):
    from zerofit.cli import main

    for flag, value in (("--cpu-cores", "0"), ("--cpu-cores", "-4"), ("--micro-batch", "0"), ("--seq-len", "4")):
        with pytest.raises(SystemExit) as exit_:
            main(["plan", "--model", "tiny", flag, value])
        assert exit_.value.code == 2 and f"argument {flag}: {value} is below" in capsys.readouterr().err


def test_plan_takes_another_machines_nvme_free_space(tmp_path, capsys):
    """--disk-free stood in for the checkpoints' disk of another machine, but its NVMe's free
    space was always measured here (where the path may not even be), so an NVMe plan for it
    fitted or not by this machine's disk."""
    from zerofit.cli import main

    flags = ["plan", "--model", "llama-1.5b", "--gpu-mem", "8GiB", "--host-mem", "64GiB", "--accelerator", "cuda",
             "--offload-optimizer", "nvme", "--offload-param", "cpu", "--nvme-path", str(tmp_path / "nvme"),
             "--disk-free", "2TB", "--json"]
    planned = {}
    for free in ("1GB", "2TB"):
        main([*flags, "--nvme-free", free])
        planned[free] = json.loads(capsys.readouterr().out)
    assert planned["1GB"]["nvme"]["free_bytes"] == 10**9 and not planned["1GB"]["devices"]["nvme"]["fits"]
    assert planned["2TB"]["nvme"]["free_bytes"] == 2 * 10**12 and planned["2TB"]["devices"]["nvme"]["fits"]
    assert planned["2TB"]["nvme"]["swap_bytes"] > 10**9  # the 1 GB did not hold the swap files
    assert main(["plan", "--model", "llama-1.5b", "--nvme-free", "1TB"]) == 1
    assert "--nvme-free is the free space at zero.nvme_path: give --nvme-path" in capsys.readouterr().err


# the same machine wherever the test runs: nothing of this one is measured into the plans; the
# checkpoint schedule as it was when the totals were taken (a save at the end only)
ANOTHER_MACHINE = ["--gpu-mem", "24GiB", "--host-mem", "64GiB", "--cpu-cores", "16", "--disk-free", "2TB",
                   "--accelerator", "cuda", "--json", "--set", "checkpoint.every_steps=0",
                   "--set", "checkpoint.every_minutes=0"]
SEVEN_B = str(Path(__file__).parent / "data" / "qwen2.5-7b" / "config.json")  # Qwen2.5-7B's config.json
KEPT_PLANS = {
    "llama-8b": ["--model", "llama-8b"],
    "qwen2-0.5b": ["--model", "qwen2-0.5b"],
    "qwen2.5-7b config.json": ["--model", SEVEN_B],
    "qwen2.5-7b config.json, LoRA": ["--model", SEVEN_B, "--set", "lora.enabled=true"],
    "llama-1.5b on NVMe": ["--model", "llama-1.5b", "--offload-optimizer", "nvme", "--offload-param", "cpu",
                           "--nvme-path", "NVME", "--nvme-free", "2TB", "--gpu-mem", "8GiB"],
}
PEAKS = ("devices", "save_peak", "start_peak", "first_step_after_save_peak", "export_peak")


def plan_totals(out: dict) -> dict:
    """What a plan predicts, in bytes: each peak's components and totals, the checkpoint, the
    model's counts, and the LoRA advice's figures (its step time left out: that is the step model's)."""
    import re

    kept = {peak: {device: {"total_bytes": v["total_bytes"], "components": v["components"]}
                   for device, v in out[peak].items()} for peak in PEAKS}
    lora = [re.sub(r"; ~[\d.]+ s a step$", "", a) for a in out["advice"] if a.startswith("lora.enabled=true")]
    return {**kept, "fits": out["fits"], "params": out["params"], "trainable_params": out["trainable_params"],
            "checkpoint_bytes": out["checkpoint_bytes"], "chosen": out["chosen"], "model": out["model"],
            "lora_advice": lora}


def test_plans_keep_the_byte_totals_they_had(tmp_path, capsys):
    """Planning was made faster (issue 53: the meta model built once, hook orders cached, imports
    deferred): the same plans give the same bytes as before that work (tests/data/plan_totals.json,
    captured from `zerofit plan --json` before it)."""
    from zerofit.cli import main

    kept = json.loads((Path(__file__).parent / "data" / "plan_totals.json").read_text())
    for name, flags in KEPT_PLANS.items():
        flags = [str(tmp_path) if flag == "NVME" else flag for flag in flags]
        main(["plan", *flags, *ANOTHER_MACHINE[2 * ("--gpu-mem" in flags):]])
        assert plan_totals(json.loads(capsys.readouterr().out)) == kept[name], name
