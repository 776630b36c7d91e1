"""The whole plan (planner.py, hardware.py): async snapshots, checkpoint size, sizes, peaks against measured runs."""
from dataclasses import replace

import pytest
from conftest import TINY, cuda_box

from zerofit.config.load import validate
from zerofit.machine import hardware
from zerofit.plan import choose, estimate
from zerofit.plan import spec as modelspec
from zerofit.plan.estimate import Candidate, Shape

GIB = 2**30


def test_async_save_holds_its_snapshot_buffer_on_the_host():
    """checkpoint.async_save reserves the rank's share of the checkpoint in host RAM for the
    whole run; over its cap the run saves synchronously and nothing is held."""
    spec = modelspec.from_name("llama-1.5b")
    hw = hardware.with_overrides(hardware.probe(accelerator="cuda", gpu_mem="24GiB", host_mem="200GiB"),
                                 disk_free_bytes=10**13)
    cand = Candidate(offload_optimizer="cpu")
    sync = estimate.predict(spec, hw, Shape(seq_len=1024, micro_batch=1, world_size=2), cand)
    default_cap = estimate.predict(spec, hw, Shape(seq_len=1024, micro_batch=1, world_size=2, async_snapshot_max=None), cand)
    share = default_cap.devices["host"].components["async_snapshot"] / 2
    # each rank half of what one rank reserved for the whole 1.5B checkpoint on the GPU machine
    assert share == pytest.approx(18_408_603_811 / 2, rel=0.01)  # bench/results/checkpoint.json
    assert "async_snapshot" not in sync.devices["host"].components
    # two ranks on this node: each holds its share
    assert default_cap.devices["host"].components["async_snapshot"] == 2 * int(share)
    assert default_cap.host_rss_peak - sync.host_rss_peak == int(share)  # per rank
    too_small = replace(default_cap.shape, async_snapshot_max=int(share) - 1)
    assert "async_snapshot" not in estimate.predict(spec, hw, too_small, cand).devices["host"].components
    assert choose.async_snapshot_max(validate_tiny(checkpoint={"async_save": True, "async_host_max_gib": 2})) == 2 * 2**30
    assert choose.async_snapshot_max(validate_tiny(checkpoint={"async_save": True})) is None
    assert choose.async_snapshot_max(validate_tiny()) == 0


def validate_tiny(**sections):
    return validate({"run_dir": "/tmp/unused", "model": {"config": "tiny"}, "data": {"path": "demo"},
                     "train": {"max_steps": 1}, **sections})


def test_checkpoint_size_formula():
    """12 bytes per parameter (fp32 master + 2 Adam moments) per rank plus metadata; the
    tiny model's optimizer file measured 1,090,117 bytes."""
    assert estimate.checkpoint_bytes(TINY) == 12 * TINY + estimate.CHECKPOINT_OVERHEAD_BYTES
    assert abs(estimate.checkpoint_bytes(TINY) - 1_122_076) / 1_122_076 < 0.05  # du -sb of step-000006
    assert estimate.checkpoint_bytes(1000, world_size=2) == 2 * (12 * 500 + estimate.CHECKPOINT_OVERHEAD_BYTES)


def test_sizes_parse_and_bad_ones_name_the_key():
    from zerofit.core.errors import ConfigError

    assert hardware.probe(gpu_mem="24GiB", host_mem="64GB").gpu_budget_bytes == 24 * GIB
    assert hardware.probe(gpu_mem="24GiB", host_mem="64GB").host_budget_bytes == 64 * 10**9
    with pytest.raises(ConfigError, match=r"gpu_mem='lots' is not a size; write e.g. 24GiB"):
        hardware.probe(gpu_mem="lots")
    if hardware._probe_gpu() is None:  # CUDA asked for with nothing to measure: it was planned as a 0-byte GPU
        with pytest.raises(ConfigError, match="needs the GPU's memory: give --gpu-mem"):
            hardware.probe(accelerator="cuda")


def test_host_peaks_of_the_measured_nvme_and_cpu_offload_runs():
    """bench/results/nvme-3.6b-a64.json: llama-3.6b, parameters on CPU, the optimizer on CPU, on
    NVMe one sub group at a time and pipelined (16 x 1024 x 64 tokens per step, one GPU of the
    2 x H200 host); nvme.json: the CPU and NVMe runs again at 88 micro batches per step. The
    host peak of each run and of its engine start (the `start` phase of its memory.jsonl)
    within 10% of the plan's: the start's second copy of the 16-bit
    parameters is the NVMe run's peak, the pipelined run's first-step moments its own."""
    import json
    from pathlib import Path

    from zerofit.core.files import read_jsonl

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    measured = json.loads((results / "nvme-3.6b-a64.json").read_text())
    spec = modelspec.from_name("llama-3.6b")
    hw = cuda_box(gpu="139GiB", host="251GiB", cores=32)
    shape = Shape(seq_len=1024, micro_batch=16, grad_accum=64, gradient_checkpointing=True)
    runs = {"cpu": Candidate(offload_optimizer="cpu", offload_param="cpu"),
            "nvme": Candidate(offload_optimizer="nvme", offload_param="cpu"),
            "nvme_pipelined": Candidate(offload_optimizer="nvme", offload_param="cpu", nvme_pipeline=True)}
    for run, cand in runs.items():
        plan = estimate.predict(spec, hw, shape, cand)
        start = next(r for r in read_jsonl(results / f"nvme-3.6b-a64-{run}-memory.jsonl") if r["phase"] == "start")
        start = start["host_peak"]
        peak = measured[run]["host_rss_bytes"]
        assert plan.host_rss_peak == pytest.approx(peak, rel=0.1), run
        assert plan.start_peak["host"].total_bytes == pytest.approx(start, rel=0.1), run
    longer = json.loads((results / "nvme.json").read_text())
    for run in ("cpu", "nvme"):  # the accumulation does not change the host's bytes
        plan = estimate.predict(spec, hw, replace(shape, grad_accum=longer["grad_accum"]), runs[run])
        assert plan.host_rss_peak == pytest.approx(longer[run]["host_rss_bytes"], rel=0.1), run
    nvme_plan = estimate.predict(spec, hw, shape, runs["nvme"])
    assert nvme_plan.host_rss_peak == nvme_plan.start_peak["host"].total_bytes  # the start is its peak
    assert "engine_init_16bit_params_copy" in nvme_plan.start_peak["host"].components


def test_lora_runs_with_evals_are_planned_at_their_measured_peaks():
    """bench/results/planner_accuracy-...-lora-eval.json (H200): llama-1.5b and 3.6b, LoRA r16,
    the base on the GPU or on the CPU, s512 and s2048, an eval of 4 batches after each step. The
    plan's GPU peak against the larger of the training's and the evals' is -1.4% .. +8.6%
    (before this session's changes, over by up to 17% with no eval, under by 39% with them: an
    eval left a live window gathered, bench/results/eval-leftovers-s29/). With the base on the
    CPU the host peak is within 7%: the engine start copies the trainable 16-bit partitions
    only (the whole model's copy was priced: +52%)."""
    pytest.importorskip("peft")
    import json
    from pathlib import Path

    from conftest import bench_module

    accuracy = bench_module("planner_accuracy")
    cells = json.loads((Path(__file__).resolve().parents[1] / "bench/results/planner_accuracy-llama-1.5b_llama-3.6b-"
                        "none_optimizer_param_cpu-s512_2048-lora-eval.json").read_text())
    measured = [c for c in cells if c["status"] == "measured"]
    assert len(measured) == 8
    for c in measured:
        cell = accuracy.Cell(c["model"], c["offload_mode"], c["seq_len"], c["cap_gib"], lora=True, evaluate=True)
        plan = accuracy.predict(cell, {"steps": 2, "accelerator": "cuda"}, 2, "100GiB")
        peak = max(c["measured_gpu_peak"], c["measured_eval_gpu_peak"])
        assert -0.03 <= plan["predicted_gpu_peak"] / peak - 1 <= 0.10, cell.name
        if c["offload_mode"] != "none":
            assert plan["predicted_host_rss"] == pytest.approx(c["measured_host_rss"], rel=0.07), cell.name
