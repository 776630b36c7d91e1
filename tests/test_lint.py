"""`zerofit lint` on good and bad DeepSpeed JSON, checked with DeepSpeed's own config models."""
import json
from pathlib import Path

import pytest
from conftest import run_zerofit

from zerofit.config.load import load
from zerofit.lint import check as lint
from zerofit.machine import hardware
from zerofit.plan import deepspeed
from zerofit.plan import spec as modelspec

# LLaMA-Factory's examples/deepspeed/ds_z3_offload_config.json: "auto" everywhere HF Trainer
# fills in (bench/configs/: the values, shared with bench/speed_bench.py).
LLAMA_FACTORY_Z3_OFFLOAD = json.loads(
    (Path(__file__).resolve().parents[1] / "bench" / "configs" / "llama_factory_ds_z3_offload.json").read_text())


def findings(result, level=None):
    return {f.key: f for f in result.findings if level is None or f.level == level}


def gpu_box(gpu="24GiB", host="128GiB"):
    return hardware.with_overrides(hardware.probe(gpu_mem=gpu, host_mem=host), cpu_cores=16)


def test_zerofits_own_config_is_clean():
    ds = deepspeed.build(load(), world_size=1, on_gpu=True)
    assert lint.lint(ds).findings == []


def test_llama_factory_offload_config_passes_with_warnings_and_plans():
    spec = modelspec.from_name("llama-1.5b")
    result = lint.lint(LLAMA_FACTORY_Z3_OFFLOAD, spec=spec, hw=gpu_box(), trainer=lint.TrainerArgs(1024, 2),
                       model_ref="llama-1.5b")
    assert result.errors == []
    warnings = findings(result, "warning")
    auto = next(f for k, f in warnings.items() if "auto" in f.message)
    assert "train_micro_batch_size_per_gpu" in auto.key and "zero_optimization.reduce_bucket_size" in auto.key
    gather = warnings["zero_optimization.stage3_gather_16bit_weights_on_model_save"]
    assert "2.8GiB" in gather.message  # 2 bytes x 1.498e9 parameters on rank 0's host
    assert "zero_optimization.reduce_bucket_size" not in warnings  # "auto": HF fills hidden^2
    plan = result.plan
    assert plan["fits"] is True and plan["shape"]["micro_batch"] == 2
    assert plan["shape"]["chunked_loss"] is False  # HF Trainer's loss, with its fp32 logits
    assert plan["candidate"]["offload_param"] == "cpu" and plan["candidate"]["sub_group_size"] == 10**9
    assert plan["candidate"]["reduce_bucket_size"] == 2048 * 2048
    assert plan["save_peak"]["host"]["components"]["consolidated_16bit_model"] == 2 * spec.total_params


def test_lint_plans_the_trainer_arguments_beside_the_json():
    """What HF Trainer sets outside the JSON changes the plan: a peft LoRA run trains (and keeps
    optimizer state for) only its adapters; without --gradient_checkpointing every layer's
    activations are held."""
    spec = modelspec.from_name("llama-1.5b")
    def planned(**trainer) -> dict:
        return lint.lint(LLAMA_FACTORY_Z3_OFFLOAD, spec=spec, hw=gpu_box(), model_ref="llama-1.5b",
                         trainer=lint.TrainerArgs(**trainer)).plan
    full, lora = planned(), planned(lora_rank=8, lora_targets=["q_proj", "v_proj"])
    layers, hidden, kv = 16, 2048, 512  # llama-1.5b: q_proj 2048 -> 2048, v_proj 2048 -> 512 (8 kv heads)
    assert lora["model"]["trainable_params"] == layers * 8 * ((hidden + hidden) + (hidden + kv))
    assert full["model"]["trainable_params"] == spec.total_params
    moments = [plan["devices"]["host"]["components"]["adam_moments_fp32"] for plan in (full, lora)]
    assert moments == [8 * spec.total_params, 8 * lora["model"]["trainable_params"]]
    held = planned(gradient_checkpointing=False)
    assert held["shape"]["gradient_checkpointing"] is False
    saved = [plan["devices"]["gpu"]["components"]["backward:activations_saved"] for plan in (full, held)]
    assert saved[1] > 5 * saved[0]


def test_unknown_zero_key_is_an_error_with_the_fix():
    result = lint.lint({"train_micro_batch_size_per_gpu": 1,
                        "zero_optimization": {"stage": 3, "stage3_offload_optimizer": True}})
    error = findings(result, "error")["zero_optimization.stage3_offload_optimizer"]
    assert "not a DeepSpeed ZeRO key" in error.message and '"offload_optimizer": {"device": "cpu"}' in error.fix
    typo = lint.lint({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "sub_grup_size": 1}})
    assert findings(typo, "error")["zero_optimization.sub_grup_size"].fix == "did you mean sub_group_size?"


def test_top_level_keys_deepspeed_ignores_are_flagged():
    result = lint.lint({"train_micro_batch_size_per_gpu": 1, "gradient_clip": 1.0, "stage3_max_live_parameters": 1e9,
                        "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}})
    errors = findings(result, "error")
    assert errors["gradient_clip"].fix == "did you mean gradient_clipping?"
    assert errors["stage3_max_live_parameters"].fix == 'move it into "zero_optimization"'
    assert "bf16" not in errors and "zero_optimization" not in errors



def test_every_finding_is_named_when_deepspeed_refuses_a_section():
    """A section DeepSpeed refuses stops its parse: the keys it would have read later were not
    reported until that was fixed. Now each refusal is named per key, in words, beside the
    ignored top-level keys; and a misspelt stage3_ key gets the JSON spelling back."""
    result = lint.lint({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True, "loss_scale": 0},
                        "zero_optimisation": {"stage": 3}, "gradient_clip": 1.0,
                        "zero_optimization": {"stage": 5, "stage3_prefetch_bucket": 5}})
    errors = findings(result, "error")
    assert errors["bf16.loss_scale"].message.startswith("not a key of DeepSpeed's bf16 section")
    assert errors["zero_optimisation"].fix == "did you mean zero_optimization?"
    assert errors["gradient_clip"].fix == "did you mean gradient_clipping?"
    assert errors["zero_optimization.stage"].message == "must be one of 0, 1, 2, 3 (got 5)"
    assert errors["zero_optimization.stage3_prefetch_bucket"].fix == "did you mean stage3_prefetch_bucket_size?"
    assert not any("\n" in f.message for f in result.findings)


def test_nvme_without_path_and_batch_arithmetic():
    result = lint.lint({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 16,
                        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, world_size=1)
    errors = findings(result, "error")
    assert "nvme_path" in errors["zero_optimization.offload_param.nvme_path"].fix
    assert errors["train_batch_size"].fix == "set train_batch_size to 8"
    ok = lint.lint({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 16,
                    "zero_optimization": {"stage": 2}}, world_size=2)
    assert ok.errors == []
    for no_batch in ({}, {"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 3}}):  # DeepSpeed asserts
        assert '"auto"' in findings(lint.lint(no_batch), "error")["train_micro_batch_size_per_gpu"].fix
    assert lint.lint({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}).errors == []


@pytest.mark.parametrize("fp16, warned", [({"enabled": True}, True),
                                          ({"enabled": True, "loss_scale": 0, "initial_scale_power": 16}, False)])
def test_fp16_without_loss_scale_settings(fp16, warned):
    result = lint.lint({"train_micro_batch_size_per_gpu": 1, "fp16": fp16, "zero_optimization": {"stage": 2}})
    assert ("fp16" in findings(result, "warning")) == warned


def test_sub_group_and_bucket_sizes_against_the_budget():
    spec = modelspec.from_name("llama-1.5b")
    risky = lint.lint({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                       "zero_optimization": {"stage": 3}}, spec=spec, hw=gpu_box("8GiB"))
    warnings = findings(risky, "warning")
    sub = warnings["zero_optimization.sub_group_size"]
    assert "DeepSpeed's default 1e+09" in sub.message and "5.6GiB" in sub.message  # 6 bytes x 1e9
    assert sub.fix == 'set "sub_group_size": 1e8'
    bucket = warnings["zero_optimization.reduce_bucket_size"]
    assert "953.7MiB" in bucket.message and "8.0GiB GPU budget" in bucket.message
    assert risky.plan is not None and risky.plan["fits"] is False  # 16 bytes/param of 1.5B on 8 GiB
    assert "does not fit this config" in findings(risky, "error")["plan"].message  # so exit 1
    safe = lint.lint({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                      "zero_optimization": {"stage": 3, "sub_group_size": 1e8, "reduce_bucket_size": 4e6,
                                            "stage3_prefetch_bucket_size": 4e6,
                                            "offload_optimizer": {"device": "cpu"}}}, spec=spec, hw=gpu_box("8GiB"))
    assert safe.findings == [] and safe.plan["fits"] is True


@pytest.mark.e2e
def test_cli_exit_codes(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                               "zero_optimization": {"stage": 3, "stage3_offload_optimizer": True}}))
    done = run_zerofit(["lint", str(bad), "--json"], check=False)
    assert done.returncode == 1
    out = json.loads(done.stdout)
    assert out["ok"] is False and out["findings"][0]["key"] == "zero_optimization.stage3_offload_optimizer"
    good = tmp_path / "lf.json"
    good.write_text(json.dumps(LLAMA_FACTORY_Z3_OFFLOAD))
    done = run_zerofit(["lint", str(good), "--model", "tiny", "--gpu-mem", "24GiB"], check=False)
    assert done.returncode == 0, done.stderr
    assert "0 error(s)" in done.stdout and "plan: fits" in done.stdout
    assert "planned as: seq 1024 (--seq-len), micro batch 1" in " ".join(done.stdout.split())  # the assumptions said
    assert "full fine-tuning (--lora-rank R: a LoRA run)" in " ".join(done.stdout.split())
    done = run_zerofit(["lint", str(good), "--model", "tiny", "--gpu-mem", "24GiB", "--lora-rank", "4"], check=False)
    assert done.returncode == 0 and "LoRA rank 4" in done.stdout, done.stderr
    missing = run_zerofit(["lint", str(tmp_path / "nope.json")], check=False)
    assert missing.returncode == 1 and "does not exist" in missing.stderr


@pytest.mark.parametrize("clip, measured", [(1.0, "0.48x"), (0.0, "0.69x"), ("auto", "0.48x")])
def test_superoffload_warns_of_its_checkpoints_and_measured_speed(clip, measured):
    offload = {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}
    result = lint.lint({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": clip, "bf16": {"enabled": True},
                        "zero_optimization": offload})
    warning = findings(result, "warning")["zero_optimization.offload_optimizer.super_offload"]
    assert "worker process" in warning.message and "restarts Adam from zero" in warning.message
    assert measured in warning.message
    plain = lint.lint({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": clip, "bf16": {"enabled": True},
                       "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    assert "zero_optimization.offload_optimizer.super_offload" not in findings(plain)


def test_zenflow_under_zero3_is_flagged_with_what_it_needs_of_this_model():
    zenflow = {"topk_ratio": 0.05, "update_interval": 4, "overlap_step": True}
    result = lint.lint({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "zenflow": zenflow}})
    warning = findings(result, "warning")["zero_optimization.zenflow"]
    assert "zero.Init" in warning.message and "reduce_bucket_size" in warning.fix
    spec = modelspec.from_name("llama-1.5b")  # embedding 128256 x 2048 = 262,668,288 elements
    for bucket, fails in ((200_000_000, True), (262_668_288, False)):
        with_model = lint.lint({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                      "reduce_bucket_size": bucket, "zenflow": zenflow}}, spec=spec)
        message = findings(with_model, "warning")["zero_optimization.zenflow"].message
        assert f"model.embed_tokens.weight has 262,668,288 elements against a reduce_bucket_size of {bucket:,}" in message
        assert ("it would fail" in message) == fails
    stage2 = lint.lint({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": zenflow}})
    assert "zero_optimization.zenflow" not in findings(stage2)


DEEPCOMPILE_BUILD_SCRIPT = """
import json, sys
import torch
from zerofit.train import ranks
import deepspeed

ranks.init_distributed()
for ds in json.loads(sys.argv[1]):
    try:
        built, *_ = deepspeed.initialize(model=torch.nn.Sequential(torch.nn.Linear(8, 8)), config=ds)
        built.compile()
        print(json.dumps("compiled"), flush=True)
    except ValueError as e:  # the engine's refusals, before DeepCompile builds its CUDA op
        print(json.dumps("refused"), flush=True)
"""


@pytest.mark.e2e
def test_what_lint_says_of_deepcompile_offloads_is_what_deepspeed_refuses():
    """DeepCompile's engine.compile() refuses an optimizer-state offload beside ZeRO's, and an
    activation offload beside either (the engine turns offload_parameters on where ZeRO offloads
    optimizer and parameters to the CPU). Real DeepSpeed on the CPU accelerator: its refusals come
    before the CUDA-only op build, so each refused config is built here and linted."""
    import subprocess
    import sys

    from conftest import ROOT, child_env

    def config(zero: dict, compile_section: dict) -> dict:
        return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 3, **zero}, "compile": {"deepcompile": True, **compile_section}}

    cpu = {"device": "cpu"}
    refused = [config({"offload_optimizer": cpu}, {"offload_opt_states": True}),
               config({"offload_optimizer": cpu, "offload_param": cpu}, {"offload_activation": True}),
               config({}, {"offload_activation": True, "offload_opt_states": True})]
    done = subprocess.run([sys.executable, "-c", DEEPCOMPILE_BUILD_SCRIPT, json.dumps(refused)], capture_output=True,
                          text=True, timeout=600, env=child_env(), cwd=ROOT)
    built = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('"')]
    assert built == ["refused"] * 3, done.stderr[-3000:]
    linted = [sorted(f.key for f in lint.lint(ds).errors) for ds in refused]
    assert linted == [["compile.offload_opt_states"], ["compile.offload_activation"], ["compile.offload_activation"]]
    implied = findings(lint.lint(refused[1]), "error")["compile.offload_activation"].message
    assert "the engine turns it on" in implied
    for accepted in (config({}, {"offload_opt_states": True}), config({"offload_optimizer": cpu}, {}),
                     config({"offload_optimizer": cpu}, {"offload_opt_states": True}) | {"compile": {"deepcompile": False,
                                                                                                    "offload_opt_states": True}}):
        assert not [f for f in lint.lint(accepted).errors if f.key.startswith("compile.")]


@pytest.mark.parametrize("world_size, gpu, level", [(1, "24GiB", "error"), (4, "24GiB", None), (1, "80GiB", None)])
def test_deepcompile_optimizer_state_offload_is_sized_at_the_step(world_size, gpu, level):
    """offload_opt_states steps on the GPU with every state back: 16 bytes a parameter in bf16,
    over the ranks. llama-3.6b: 3,606,752,256 x 16 B = 53.7 GiB on one rank, 13.4 GiB on four."""
    spec = modelspec.from_name("llama-3.6b")
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "sub_group_size": 1e8},
          "compile": {"deepcompile": True, "offload_opt_states": True}}
    result = lint.lint(ds, spec=spec, hw=gpu_box(gpu), world_size=world_size)
    found = findings(result).get("compile.offload_opt_states")
    if level is None:
        assert found is None  # it fits, accumulation 1: nothing to say
    else:
        assert found.level == level and "53.7GiB a rank for this model, more than the 24.0GiB GPU budget" in found.message
    accumulating = lint.lint(ds | {"gradient_accumulation_steps": 4}, spec=spec, hw=gpu_box("80GiB"), world_size=world_size)
    warning = findings(accumulating, "warning")["compile.offload_opt_states"]
    assert "gradient_accumulation_steps 4" in warning.message and "gradient_accumulation_steps 1" in warning.fix
    without_model = findings(lint.lint(ds), "warning")["compile.offload_opt_states"]
    assert "16 bytes per parameter" in without_model.message and "--model" in without_model.fix
    stage2 = findings(lint.lint(ds | {"zero_optimization": {"stage": 2}}), "warning")["compile.offload_opt_states"]
    assert "does not read it" in stage2.message


@pytest.mark.parametrize("param_device, ratio, warned", [("cpu", 0.75, True), ("none", 0.75, False), ("cpu", 1.0, False)])
def test_partial_offload_beside_offloaded_parameters_is_flagged(param_device, ratio, warned):
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": ratio}, "offload_param": {"device": param_device}}
    result = lint.lint({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero})
    warning = findings(result, "warning").get("zero_optimization.offload_optimizer.ratio")
    assert (warning is not None) == warned
    if warned:
        assert "6.07 s" in warning.message and "offload_param none" in warning.fix


def test_what_deepspeed_accepts_and_then_ignores_or_trips_on():
    """Legacy cpu_offload beside offload_optimizer (DeepSpeed asserts: lint crashed), keys the
    stage does not read, and a number written as a string (DeepSpeed fails comparing it)."""
    legacy = lint.lint({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})
    assert [f.key for f in legacy.errors] == ["zero_optimization"] and "deprecated" in legacy.errors[0].message
    stage3 = lint.lint({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "allgather_partitions": True, "allgather_bucket_size": 5e8}})
    assert {f.key for f in stage3.findings if "does not read it" in f.message} == {
        "zero_optimization.allgather_partitions", "zero_optimization.allgather_bucket_size"}
    stage2 = lint.lint({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 2, "stage3_prefetch_bucket_size": 5e8}})
    assert any(f.key == "zero_optimization.stage3_prefetch_bucket_size" for f in stage2.findings)
    text = lint.lint({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": "1.0",
                      "zero_optimization": {"stage": 3}})
    assert [f.key for f in text.errors] == ["gradient_clipping"]
    words = lint.lint({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": "one",  # crashed lint
                       "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}})
    assert [f.key for f in words.errors] == ["gradient_clipping"]
    auto = lint.lint({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                      "zero_optimization": {"stage": 3}})
    assert not auto.errors  # HF fills "auto" in


@pytest.mark.parametrize("stage, device, warned", [(2, "nvme", "nothing goes to NVMe"), (1, "nvme", "nothing goes"),
                                                   (0, "cpu", "no ZeRO optimizer"), (2, "cpu", None), (3, "nvme", None)])
def test_an_offload_the_stage_ignores_is_named(stage, device, warned):
    zero = {"stage": stage, "offload_optimizer": {"device": device, "nvme_path": "/tmp"}}
    said = [f.message for f in lint.lint({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}).findings
            if f.key.startswith("zero_optimization.offload_optimizer")]
    assert [m for m in said if warned and warned in m] if warned else said == [], said


def test_a_value_out_of_range_names_the_range():
    result = lint.lint({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "reduce_bucket_size": -1}})
    finding = next(f for f in result.errors if f.key == "zero_optimization.reduce_bucket_size")
    assert finding.fix == "set it > 0"


@pytest.mark.e2e
@pytest.mark.parametrize("key", ["bf16", "fp16"])
def test_a_precision_flag_written_as_a_bool_is_an_error_not_a_crash(key, tmp_path):
    """`"bf16": true` made lint crash in precision() ('bool' object has no attribute 'get');
    DeepSpeed itself fails on it ("argument after ** must be a mapping, not bool")."""
    ds = {"train_micro_batch_size_per_gpu": 1, key: True, "zero_optimization": {"stage": 3}}
    result = lint.lint(ds)
    assert [f.key for f in result.errors] == [key]
    assert "must be an object" in result.errors[0].message and result.errors[0].fix == f'"{key}": {{"enabled": true}}'
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(ds))
    done = run_zerofit(["lint", str(config)], check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr and f"error {key}: must be an object" in done.stdout


def test_optimizer_and_scheduler_sections_are_checked():
    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    typo = lint.lint(base | {"optimizer": {"type": "AdamW", "parms": {"lr": 1e-5}}})
    assert [f.key for f in typo.errors] == ["optimizer.parms"]
    assert typo.errors[0].fix == "did you mean params?"
    text = lint.lint(base | {"optimizer": {"type": "AdamW", "params": {"lr": "1e-5"}}})
    assert [f.key for f in text.errors] == ["optimizer.params.lr"] and "must be a number" in text.errors[0].message
    unknown = lint.lint(base | {"optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "adamw_mode": True,
                                                                          "max_grad_norm": 1.0}}})
    assert findings(unknown, "error")["optimizer.params.adamw_mode"].fix == "did you mean adam_w_mode?"
    assert "gradient_clipping" in findings(unknown, "error")["optimizer.params.max_grad_norm"].fix
    other = lint.lint(base | {"optimizer": {"type": "Lamb", "params": {"lr": "2e-3", "max_coeff": 0.3}}})
    assert [f.key for f in other.errors] == ["optimizer.params.lr"]  # other types: numbers only
    sched = lint.lint(base | {"scheduler": {"type": "WarmupDecayLR",
                                            "params": {"warmup_num_steps": 10, "total_num_step": 100}}})
    assert [f.key for f in sched.errors] == ["scheduler.params.total_num_step"]  # not also "requires total_num_steps"
    assert "WarmupDecayLR takes no total_num_step" in sched.errors[0].message
    assert sched.errors[0].fix == "did you mean total_num_steps?"
    missing = lint.lint(base | {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "10"}}})
    assert {f.key for f in missing.errors} == {"scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps"}


ADAM_BUILD_SCRIPT = """
import json, sys
import torch
from zerofit.train import ranks
import deepspeed

ranks.init_distributed()
for params in json.loads(sys.argv[1]):
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
          "optimizer": {"type": "AdamW", "params": params}}
    try:
        built, optimizer, _, _ = deepspeed.initialize(model=torch.nn.Linear(8, 8), config=ds)
        print(json.dumps(type(built.optimizer.optimizer).__name__), flush=True)
    except Exception as e:
        print(json.dumps("failed: " + type(e).__name__), flush=True)
"""


@pytest.mark.e2e
def test_what_lint_says_of_adam_params_is_what_deepspeed_does():
    """With the optimizer offloaded DeepSpeed builds DeepSpeedCPUAdam, which takes none of torch's
    extra keywords (foreach) and raises on AMSGrad; "torch_adam" written as text is true to it.
    Each case is built by real DeepSpeed and linted: an error exactly where the build fails."""
    import subprocess
    import sys

    from conftest import ROOT, child_env

    cases = [{"lr": 1e-3, "bias_correction": False}, {"lr": 1e-3, "foreach": True}, {"lr": 1e-3, "amsgrad": True},
             {"lr": 1e-3, "set_grad_none": True}, {"lr": 1e-3, "torch_adam": True, "foreach": False, "amsgrad": True},
             {"lr": 1e-3, "torch_adam": "false"}]
    done = subprocess.run([sys.executable, "-c", ADAM_BUILD_SCRIPT, json.dumps(cases)], capture_output=True,
                          text=True, timeout=600, env=child_env(), cwd=ROOT)
    built = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('"')]
    assert built == ["DeepSpeedCPUAdam", "failed: TypeError", "failed: RuntimeError", "failed: TypeError",
                     "AdamW", "AdamW"], done.stderr[-3000:]
    offload = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    linted = [[f.key for f in lint.lint(offload | {"optimizer": {"type": "AdamW", "params": p}}).errors] for p in cases]
    assert linted == [[], ["optimizer.params.foreach"], ["optimizer.params.amsgrad"], ["optimizer.params.set_grad_none"],
                      [], ["optimizer.params.torch_adam"]]
    foreach = lint.lint(offload | {"optimizer": {"type": "AdamW", "params": cases[1]}}).errors[0]
    assert foreach.fix.startswith('only torch\'s Adam takes it: add "torch_adam": true')
    on_gpu = lint.lint({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                        "optimizer": {"type": "AdamW", "params": {"set_grad_none": True}}})
    assert on_gpu.errors == []  # FusedAdam's own keyword, where the optimizer stays on the GPU


def test_valid_optimizer_and_scheduler_sections_raise_no_alarm():
    """HF Trainer's documented ZeRO-3 config ("auto" everywhere, filled by HF) and DeepSpeed's
    own docs examples: Adam with torch_adam's keywords, OneCycle, a torch scheduler."""
    hf = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": "auto", "total_num_steps": "auto"}}}
    assert lint.lint(hf).errors == []
    docs = {"train_batch_size": 8, "gradient_accumulation_steps": 1, "fp16": {"enabled": True, "loss_scale": 0},
            "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                     "weight_decay": 3e-7, "torch_adam": True, "fused": True}},
            "scheduler": {"type": "OneCycle", "params": {"cycle_first_step_size": 1000, "cycle_min_lr": 1e-4,
                                                         "cycle_max_lr": 1e-3, "cycle_min_mom": 0.85}},
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 1e6}}
    assert lint.lint(docs).findings == []  # train_batch_size + gradient_accumulation_steps alone: DeepSpeed derives
    untyped = lint.lint({"train_micro_batch_size_per_gpu": 1, "optimizer": {"params": {"lr": 1e-5}}})
    assert [f.key for f in untyped.errors] == ["optimizer.type"]
    torch_sched = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                   "scheduler": {"type": "StepLR", "params": {"step_size": 10, "gamma": 0.5}}}
    assert lint.lint(torch_sched).findings == []


# LLaMA-Factory's examples/deepspeed/ds_z0_config.json
LLAMA_FACTORY_Z0 = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                    "zero_allow_untested_optimizer": True,
                    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                             "hysteresis": 2, "min_loss_scale": 1}, "bf16": {"enabled": "auto"},
                    "zero_optimization": {"stage": 0, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                                          "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                                          "contiguous_gradients": True, "round_robin_gradients": True}}


@pytest.mark.parametrize("ds, warned", [(LLAMA_FACTORY_Z0, False), ({}, False),
                                        ({"train_micro_batch_size_per_gpu": 1,
                                          "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}}, True)])
def test_reduce_bucket_is_not_warned_of_where_the_stage_never_allocates_it(ds, warned):
    """Stage 0 never reads reduce_bucket_size (engine.py hands it to the stage 1-3 optimizers)."""
    assert ("zero_optimization.reduce_bucket_size" in findings(lint.lint(ds), "warning")) == warned


def test_legacy_cpu_offload_is_warned_of_with_its_replacement():
    result = lint.lint({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert result.errors == []
    warning = findings(result, "warning")["zero_optimization.cpu_offload"]
    assert "deprecated" in warning.message and warning.fix == 'use "offload_optimizer": {"device": "cpu"}'


def test_a_stage_written_as_a_string_gets_its_stage_checks():
    result = lint.lint({"train_micro_batch_size_per_gpu": 1,
                        "zero_optimization": {"stage": "3", "allgather_bucket_size": 5e8}})
    warning = findings(result, "warning")["zero_optimization.allgather_bucket_size"]
    assert warning.message == "ZeRO stage 3 does not read it"


def test_each_problem_is_named_once_with_a_fix_that_is_json():
    """fp16 and bf16 both on: one error (DeepSpeed's own refusal of it was a second, "fix the
    setting it names"); a number written as a word gets "write a number", not `"key": two`."""
    both = lint.lint({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}, "bf16": {"enabled": True},
                      "zero_optimization": {"stage": 3}})
    assert [f.key for f in both.errors] == ["fp16.enabled, bf16.enabled"]
    worded = lint.lint({"train_micro_batch_size_per_gpu": "two", "zero_optimization": {"stage": 3}})
    assert findings(worded, "error")["train_micro_batch_size_per_gpu"].fix == "write a number"
    quoted = lint.lint({"train_micro_batch_size_per_gpu": "2", "zero_optimization": {"stage": 3}})
    assert findings(quoted, "error")["train_micro_batch_size_per_gpu"].fix == \
        'write the number ("train_micro_batch_size_per_gpu": 2)'
