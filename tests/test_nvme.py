"""NVMe offload (ZeRO-Infinity) with the real DeepSpeed on CPU: DeepSpeed's async_io op
(libaio) writes the optimizer state of preset `mini` to swap files under a tmp directory.
`mini` is the `tiny` Llama with vocab 4096 and hidden 128: its 2-D weights form one optimizer
sub group of 1.3M elements, over the 1 MiB below which DeepSpeed keeps a sub group in RAM
(with `tiny`, nothing would be swapped). Planner and error-path tests need no libaio."""
from __future__ import annotations

import json
import resource
import subprocess
from pathlib import Path

import pytest
from conftest import assert_resumes_exactly, read_jsonl, run_zerofit, tiny_config, trained_run, write_config

from zerofit.checkpoint import files as checkpoint
from zerofit.checkpoint import zerofiles
from zerofit.config.load import validate
from zerofit.core.errors import ConfigError
from zerofit.export.checkpoint import export
from zerofit.machine import hardware
from zerofit.nvme import aiotune, swaplayout
from zerofit.nvme import preflight as nvme
from zerofit.nvme.swaplayout import Aio
from zerofit.plan import deepspeed, estimate, render

LIBAIO_MISSING = nvme.libaio_problem()
needs_async_io = pytest.mark.skipif(LIBAIO_MISSING is not None, reason=f"libaio-dev is not installed, so "
                                    f"DeepSpeed cannot build its async_io op ({LIBAIO_MISSING}); .ci/run installs it")


MINI_EMBEDDING = 4096 * 128  # preset mini's largest parameter: 1 MiB in bf16, so it is swapped


def nvme_config(run_dir: Path, nvme_path: Path, **zero) -> dict:
    return tiny_config(run_dir, model={"config": "mini", "gradient_checkpointing": False},
                       zero={"offload_optimizer": "nvme", "nvme_path": str(nvme_path), **zero})


@pytest.fixture(scope="module")
def nvme_run(tmp_path_factory):
    """Optimizer and parameters on NVMe, 6 steps, checkpoints at 3 and 6; the parameters' swap
    buffers exactly the largest partition (the embedding, 4096 x 128), as small as DeepSpeed takes."""
    base = tmp_path_factory.mktemp("nvme")
    run, config_file, done = trained_run(base, nvme_config(base / "run", base / "swap", offload_param="nvme",
                                                           param_buffer_size=MINI_EMBEDDING))
    return run, config_file, done, base / "swap"


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("cpu")
    config = tiny_config(base / "run", model={"config": "mini", "gradient_checkpointing": False})
    return trained_run(base, config)[0]


# ------------------------------------------------------------------ training on NVMe
@pytest.mark.e2e
@needs_async_io
def test_nvme_offload_trains_like_cpu_offload(nvme_run, cpu_run):
    run, _, _, swap = nvme_run
    ds_config = json.loads((run / "ds_config.json").read_text())["zero_optimization"]
    assert ds_config["offload_optimizer"]["device"] == ds_config["offload_param"]["device"] == "nvme"
    # one swapped sub group: nothing for a pipelined swap to overlap, the planner keeps DeepSpeed's swapper
    assert "pipeline_read" not in ds_config["offload_optimizer"]
    assert ds_config["offload_param"]["buffer_size"] == MINI_EMBEDDING
    assert Path(ds_config["offload_optimizer"]["nvme_path"]).parent == swap  # the run's own folder there
    nvme_steps, cpu_steps = read_jsonl(run / "metrics.jsonl"), read_jsonl(cpu_run / "metrics.jsonl")
    assert [m["step"] for m in nvme_steps] == [m["step"] for m in cpu_steps] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(nvme_steps, cpu_steps):  # the same Adam on the same numbers, fp32 state in files
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["lr"] == b["lr"]
    assert nvme_steps[-1]["loss"] < nvme_steps[0]["loss"] - 1.0
    # the swap files really held the state, as the planner predicted, and are gone after the run
    plan = json.loads((run / "plan.json").read_text())
    manifest = checkpoint.read_manifest(run / "checkpoints" / "step-000006")
    swapped = {name: entry["bytes"] for name, entry in manifest["files"].items()
               if name.startswith("offloaded_tensors/rank00/") and name.endswith(".swp")}
    assert sum(swapped.values()) == plan["devices"]["nvme"]["components"]["optimizer_swap"] > 2**20
    assert not list(Path(plan["nvme"]["swap_dir"]).glob("zero_stage_3/*/rank0/*.swp"))
    assert not Path(plan["nvme"]["swap_dir"]).exists()  # nor the run's empty folders


@pytest.mark.e2e
@needs_async_io
def test_resume_with_swapped_optimizer_state_is_exact(nvme_run, tmp_path):
    """The swapped moments are in the checkpoint's manifest and come back bit for bit:
    every step after the resume has the uninterrupted run's loss and LR."""
    run, config_file, _, _ = nvme_run
    manifest = checkpoint.read_manifest(run / "checkpoints" / "step-000003")
    names = set(manifest["files"])
    for prefix in ("", "exp_avg-", "exp_avg_sq-"):
        assert any(n.startswith(f"offloaded_tensors/rank00/{prefix}") and n.endswith(".tensor.swp")
                   and "gradient" not in n for n in names), prefix
    assert checkpoint.verify(run / "checkpoints" / "step-000003", hashes=True) is None
    assert_resumes_exactly(run, config_file, tmp_path / "copy", drop="step-000006", resumed_at=3)


@pytest.mark.e2e
@needs_async_io
def test_export_reads_the_swapped_masters(nvme_run, cpu_run, tmp_path):
    """The fp32 masters DeepSpeed swapped to NVMe are empty tensors in the optim file; the
    export reads them from the checkpoint's copy of the swap files (the save records which
    file holds which sub group), --verify agrees, and the weights are the CPU-offload run's."""
    run, _, _, _ = nvme_run
    step = run / "checkpoints" / "step-000006"
    record = json.loads((zerofiles.nvme_copies(step, 0) / zerofiles.SUB_GROUPS_FILE).read_text())["sub_groups"]
    assert any(group["file"] for group in record)  # the 1.3M-element sub group is swapped
    exported = export(run, tmp_path / "nvme-model", dtype="fp32", verify=True, progress=False)
    assert exported.verify["max_abs_diff"] < 1e-5
    reference = export(cpu_run, tmp_path / "cpu-model", dtype="fp32", progress=False)
    assert reference.tensors == exported.tensors
    from safetensors.torch import load_file

    ours, theirs = (load_file(next((tmp_path / d).glob("*.safetensors"))) for d in ("nvme-model", "cpu-model"))
    assert ours.keys() == theirs.keys()
    for name in ours:  # the same Adam on the same numbers (the losses agree to 1e-5)
        assert (ours[name] - theirs[name]).abs().max() < 1e-4, name


@pytest.mark.e2e
@needs_async_io
def test_moving_the_optimizer_between_nvme_and_ram_on_resume_is_refused(nvme_run, cpu_run, tmp_path):
    """Either way DeepSpeed's load crashed (a size mismatch, a missing offloaded_tensors/):
    refused before anything is rewritten, naming the change."""
    import shutil

    run, config_file, _, _ = nvme_run
    for source, change, name in ((run, "zero.offload_optimizer=cpu", "to-ram"),
                                 (cpu_run, f"zero.nvme_path={tmp_path / 'swap'}", "to-nvme")):
        copy = tmp_path / name
        shutil.copytree(source, copy)
        before = (copy / "config.yaml").read_text()
        sets = [change] + (["zero.offload_optimizer=nvme"] if name == "to-nvme" else [])
        done = run_zerofit(["train", "--config", str(copy / "config.yaml"), "--run-dir", str(copy), "--resume",
                            *[arg for s in sets for arg in ("--set", s)]], check=False)
        said = " ".join(done.stderr.split())
        assert done.returncode == 1 and "cannot be loaded under this config (zero.offload_optimizer" in said, said
        assert (copy / "config.yaml").read_text() == before


def wide_model(directory: Path) -> dict:
    """The model section of a 2-layer Llama of hidden 256 (vocab 2048) with the demo
    tokenizer, written to `directory`: enough elements for several swapped sub groups at
    sub_group_size 300k (`mini` has one)."""
    from transformers import LlamaConfig

    from zerofit.demo import build_tokenizer

    LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4).save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return {"config": str(directory), "tokenizer": str(directory), "gradient_checkpointing": False}


@pytest.mark.multirank
@needs_async_io
def test_two_ranks_resume_their_swapped_state_exactly(tmp_path):
    """Two ranks, each with its own swap files and optimizer file. DeepSpeed hands a rank
    its own optimizer file and None for the others' (`_get_all_zero_checkpoint_state_dicts`);
    the resume restores each rank's state and every later step has the uninterrupted run's loss."""
    config = nvme_config(tmp_path / "run", tmp_path / "swap", sub_group_size=150_000)
    config["model"] = wide_model(tmp_path / "model")
    config_file = write_config(tmp_path / "c.yaml", config)
    run_zerofit(["train", "--config", str(config_file)], nproc=2)
    run = tmp_path / "run"
    plan = json.loads((run / "plan.json").read_text())
    assert plan["nvme"]["swapped_sub_groups"] >= 2
    # both ranks' swap files share the one path: the plan (and the free-space check) counts them together
    manifest = checkpoint.read_manifest(run / "checkpoints" / "step-000006")
    swapped = sum(entry["bytes"] for name, entry in manifest["files"].items()
                  if name.startswith("offloaded_tensors/rank") and name.endswith(".swp"))
    assert swapped == plan["devices"]["nvme"]["components"]["optimizer_swap"]
    # several swapped sub groups per rank, each read from the swap file recorded for it
    exported = export(run, tmp_path / "model-out", dtype="fp32", verify=True, progress=False)
    assert exported.verify["max_abs_diff"] < 1e-5
    assert_resumes_exactly(run, config_file, tmp_path / "copy", drop="step-000006", resumed_at=3, nproc=2)


@pytest.mark.e2e
@needs_async_io
def test_pipelined_swap_trains_what_the_serial_swap_trains(tmp_path):
    """Hidden 256 in sub groups of 300k elements: five sub groups swapped, so the pipelined
    swapper really has one reading, one stepping and one writing (with `mini` only one is
    swapped). With zerofit's buffer_count 12 it runs, every loss equals the one-at-a-time
    swapper's bit for bit, and its checkpoint resumes exactly."""
    model = wide_model(tmp_path / "model")
    runs = {}
    for pipelined in (False, True):
        config = nvme_config(tmp_path / f"run-{pipelined}", tmp_path / "swap", sub_group_size=300_000,
                             nvme_pipeline=pipelined)
        config["model"] = model
        if not pipelined:
            config["checkpoint"] = {"every_steps": 0, "save_final": False}
        base = tmp_path / f"base-{pipelined}"
        base.mkdir()
        runs[pipelined], config_file, _ = trained_run(base, config)
    serial, pipelined = (read_jsonl(runs[p] / "metrics.jsonl") for p in (False, True))
    assert [m["loss"] for m in pipelined] == [m["loss"] for m in serial] and len(serial) == 6
    plan = json.loads((runs[True] / "plan.json").read_text())
    assert plan["nvme"]["swapped_sub_groups"] >= swaplayout.PIPELINED_SUB_GROUPS + 1
    offload = json.loads((runs[True] / "ds_config.json").read_text())["zero_optimization"]["offload_optimizer"]
    assert offload["buffer_count"] == swaplayout.PIPELINED_BUFFER_COUNT and offload["pipeline_read"]
    serial_plan = json.loads((runs[False] / "plan.json").read_text())
    assert plan["nvme"]["locked_buffer_bytes"] == 3 * serial_plan["nvme"]["locked_buffer_bytes"] > 0
    assert plan["nvme"]["pipelined"] and not serial_plan["nvme"]["pipelined"]
    # the first step's moments, held until the step ends: half the swap files' 16 bytes per element
    host = plan["devices"]["host"]["components"]
    assert host["first_step_moments_pipelined"] == plan["nvme"]["swap_bytes"] // 2
    assert "first_step_moments_pipelined" not in serial_plan["devices"]["host"]["components"]
    assert_resumes_exactly(runs[True], config_file, tmp_path / "copy", drop="step-000006", resumed_at=3)


@pytest.mark.e2e
@needs_async_io
def test_short_swap_file_stops_the_run_and_keeps_the_checkpoint(tmp_path):
    """A swap write that failed silently (the drill cuts the largest file after step 4):
    the run stops with the reason before DeepSpeed reads it back; step 3 stays valid."""
    config = nvme_config(tmp_path / "run", tmp_path / "swap")
    config_file = write_config(tmp_path / "c.yaml", config)
    done = run_zerofit(["train", "--config", str(config_file)], env={"ZEROFIT_FAULT": "shortswap@step:4"},
                       check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "a write failed" in done.stderr and "resume from the newest checkpoint" in done.stderr
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    assert checkpoint.verify(tmp_path / "run" / "checkpoints" / "step-000003", hashes=True) is None


# ------------------------------------------------------------------ preflight
def small_disk(tmp_path: Path) -> tuple[Path, dict]:
    """A 4 MiB tmpfs (O_DIRECT works there on Linux >= 6.6) when this process may mount,
    else a directory with the `nospace@nvme:1` drill: the preflight sees a full disk."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    return mount, ({} if done.returncode == 0 else {"ZEROFIT_FAULT": "nospace@nvme:1"})


@pytest.mark.e2e
@pytest.mark.parametrize("problem", ["not_writable", "typo", "free_space", "libaio"])
def test_preflight_refuses_before_training(problem, tmp_path):
    nvme_path, env = tmp_path / "swap", {}
    if problem == "typo":  # its parent missing: mkdir -p would have put the swap files on another disk
        nvme_path = tmp_path / "nvme" / "zerofti"
    elif problem == "not_writable":
        (tmp_path / "a_file").write_text("")
        nvme_path = tmp_path / "a_file" / "swap"
    elif problem == "free_space":
        nvme_path, env = small_disk(tmp_path)
    else:  # libaio missing: the search dirs for libaio.h / libaio.so replaced by an empty one
        (tmp_path / "empty").mkdir()
        env = {nvme.SEARCH_DIRS_VARIABLE: str(tmp_path / "empty")}
    config_file = write_config(tmp_path / "c.yaml", nvme_config(tmp_path / "run", nvme_path))
    try:
        done = run_zerofit(["train", "--config", str(config_file)], env=env, check=False)
    finally:
        if problem == "free_space" and not env:
            subprocess.run(["umount", str(nvme_path)], check=True)
    assert done.returncode == 1, done.stderr[-3000:]
    expected = {"not_writable": ["is not usable", "Not a directory", "writable directory on a local"],
                "typo": ["is not usable", f"{tmp_path / 'nvme'} does not exist (a typo?"],
                "free_space": ["free under", "the swap files need", "pick another zero.nvme_path"],
                "libaio": ["libaio.h and libaio.so not found", "apt-get install libaio-dev"]}[problem]
    for text in expected:
        assert text in done.stderr, (text, done.stderr[-3000:])
    assert "step 1" not in done.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------ doctor --system
@pytest.mark.e2e
@needs_async_io
def test_doctor_measures_and_tunes_the_path_and_runs_use_it(tmp_path):
    env = {"ZEROFIT_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "400"}  # one table row per line
    path = tmp_path / "disk"
    done = run_zerofit(["doctor", "--system", "--nvme-path", str(path), "--nvme-mib", "16"], env=env)
    for text in ("direct I/O write", "direct I/O read", "aio tuning", "cached in"):
        assert text in done.stdout, text
    cache = list((tmp_path / "cache").glob("aio-*.json"))
    assert len(cache) == 1
    tuned = json.loads(cache[0].read_text())
    assert tuned["path"] == str(path.resolve()) and tuned["dio_alignment"] in (512, 1024, 2048, 4096)
    assert len(tuned["tried"]) >= 2 and tuned["read_bytes_per_s"] > 0 and tuned["write_bytes_per_s"] > 0
    assert tuned["aio"] in [t["aio"] for t in tuned["tried"]]
    # a later run on that path: DeepSpeed gets the tuned aio settings, the plan the measured rates
    config_file = write_config(tmp_path / "c.yaml", nvme_config(tmp_path / "run", path))
    planned = json.loads(run_zerofit(["plan", "--config", str(config_file), "--json"], env=env).stdout)
    assert planned["deepspeed_config"]["aio"] == tuned["aio"]
    assert planned["nvme"]["rates_measured"] is True
    assert planned["nvme"]["read_bytes_per_s"] == tuned["read_bytes_per_s"]
    assert any("sweep cached" in note for note in planned["notes"])


# ------------------------------------------------------------------ the planner
def planned(host: str, nvme_path: Path | None):
    config = validate({"model": {"config": "llama-3.6b", "gradient_checkpointing": True},
                       "train": {"seq_len": 1024, "micro_batch_size": 2, "max_steps": 10},
                       "zero": {"nvme_path": str(nvme_path) if nvme_path else None}})
    hw = hardware.probe(gpu_mem="24GiB", host_mem=host, nvme_path=str(nvme_path) if nvme_path else None)
    hw = hardware.with_overrides(hw, cpu_cores=16, disk_free_bytes=10**13,
                                 nvme_free_bytes=10**13 if nvme_path else None)
    return render.plan_config(config, 1, hw=hw)


def test_plan_proposes_nvme_when_host_ram_is_short(tmp_path, capsys):
    decision, spec, hw = planned("40GiB", tmp_path)
    plan = decision.plan
    assert plan.fits and plan.candidate.offload_optimizer == "nvme"
    summary = render.nvme_summary(decision, spec, hw)
    # 3.6B parameters: fp32 master + 2 moments (12 B) and fp32 gradients (4 B) per parameter in files
    assert 16 * 3.5e9 < summary["swap_bytes"] < 16 * 3.8e9
    assert summary["read_bytes_per_step"] >= summary["swap_bytes"] and summary["bandwidth_to_hide_io"] > 1e9
    assert plan.devices["host"].total_bytes < 40 * 2**30 * 0.9
    render.render(decision, spec, hw)
    out = capsys.readouterr().out.replace("\n", " ")
    assert "of swap files under" in out and "GB/s would keep it within the rest of the step" in out
    assert summary["swap_seconds_per_step"] == plan.step_terms["nvme"] > 0
    assert summary["swap_seconds_per_step"] + summary["other_seconds_per_step"] == pytest.approx(plan.step_seconds)
    assert f"~{plan.step_terms['nvme']:.1f} s of swap per step beside" in out
    # with host RAM to spare the faster CPU offload wins
    roomy, _, _ = planned("256GiB", tmp_path)
    assert roomy.plan.fits and roomy.plan.candidate.offload_optimizer == "cpu"


def test_swap_files_and_checkpoints_on_one_filesystem_share_its_free_space(tmp_path):
    """Each was checked against the whole free space: both fitting alone, not together."""
    decision, spec, hw = planned("40GiB", tmp_path)
    assert hardware.probe(nvme_path=str(tmp_path / "swap"), disk_path=tmp_path).nvme_shares_disk  # one filesystem
    shape, candidate = decision.plan.shape, decision.plan.candidate
    roomy = estimate.predict(spec, hw, shape, candidate, 0.1)
    swap, checkpoints = roomy.devices["nvme"].total_bytes, roomy.devices["disk"].total_bytes
    assert swap and checkpoints
    free = int((max(swap, checkpoints) + 1) / 0.9) + 1  # room for either alone, not both
    tight = hardware.with_overrides(hw, disk_free_bytes=free, nvme_free_bytes=free, nvme_shares_disk=False)
    apart = estimate.predict(spec, tight, shape, candidate, 0.1)
    shared = estimate.predict(spec, hardware.with_overrides(tight, nvme_shares_disk=True), shape, candidate, 0.1)
    assert apart.devices["nvme"].fits and apart.devices["disk"].fits
    assert not shared.devices["nvme"].fits and shared.devices["disk"].fits


def test_the_planners_own_nvme_choice_is_checked_for_direct_io_blocks(tmp_path, monkeypatch):
    """offload_optimizer left to the planner, which picks NVMe for a short host: the optimizer's
    transfers are checked against the path's direct-I/O block as for a user who wrote nvme
    (they were not, and DeepSpeed's next read after a torn write aborts). A hidden size of 1000
    makes 4,000,000-byte rows, not whole 4 KiB blocks; 1024 makes whole ones."""
    monkeypatch.setenv("ZEROFIT_CACHE_DIR", str(tmp_path / "cache"))
    swap = tmp_path / "swap"
    swap.mkdir()
    cache = aiotune.cache_path(swap)
    cache.parent.mkdir()
    cache.write_text(json.dumps({"version": aiotune.CACHE_VERSION, "path": str(swap.resolve()),
                                 "dio_alignment": 4096, "aio": {}}))
    problems = {}
    for hidden in (1000, 1024):
        model = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
                 "intermediate_size": 2752, "num_attention_heads": 8 + 2 * (hidden == 1000),
                 "num_key_value_heads": 8 + 2 * (hidden == 1000), "num_hidden_layers": 40, "vocab_size": 32000}
        (tmp_path / f"h{hidden}.json").write_text(json.dumps(model))
        config = validate({"model": {"config": str(tmp_path / f"h{hidden}.json"), "gradient_checkpointing": True},
                           "train": {"seq_len": 512, "micro_batch_size": 1, "max_steps": 10},
                           "zero": {"nvme_path": str(swap)}})
        hw = hardware.with_overrides(hardware.probe(gpu_mem="4GiB", host_mem="8GiB", nvme_path=str(swap)),
                                     cpu_cores=16, disk_free_bytes=10**13, nvme_free_bytes=10**13)
        decision, _, _ = render.plan_config(config, 1, hw=hw)
        assert decision.plan.candidate.offload_optimizer == "nvme" and "offload_optimizer" not in config.zero.model_fields_set
        problems[hidden] = decision.nvme_problems
    assert "not a multiple of 4096" in problems[1000][0] and problems[1024] == []


def test_parameter_swap_buffers_hold_the_largest_partition(tmp_path):
    """DeepSpeed's default offload_param.buffer_size (1e8 elements) cannot hold llama-0.5b's
    embedding (128,256 x 1024): zero.Init asserted "More elements 131334144 than buffer size
    100000000" on the H200 (bench/results/planner_accuracy-nvme-params.json). The plan sizes
    the buffers to it, counts them pinned on the host, and refuses a smaller one of the user's."""
    config = {"model": {"config": "llama-0.5b"}, "train": {"seq_len": 512, "micro_batch_size": 1, "max_steps": 2},
              "zero": {"offload_param": "nvme", "nvme_path": str(tmp_path)}}
    hw = hardware.with_overrides(hardware.probe(gpu_mem="8GiB", host_mem="64GiB", nvme_path=str(tmp_path)),
                                 disk_free_bytes=10**13, nvme_free_bytes=10**13)
    for world, partition in ((1, 128_256 * 1024), (2, 128_256 * 1024 // 2)):
        decision, _, _ = render.plan_config(validate(config), world, hw=hw)
        assert decision.config.zero.param_buffer_size == max(partition, 10**8)
        assert decision.chosen_fields["zero.param_buffer_size"] == max(partition, 10**8)
        assert decision.config.zero.max_reuse_distance == 0  # each swapped-in parameter released at once
    decision, _, _ = render.plan_config(validate(config), 1, hw=hw)
    ds = deepspeed.build(decision.config, 1, on_gpu=True)["zero_optimization"]["offload_param"]
    assert ds["buffer_size"] == 128_256 * 1024
    pinned = decision.plan.devices["host"].components["param_swap_buffers_pinned"]
    assert pinned == 5 * 2 ** (2 * 128_256 * 1024 - 1).bit_length()  # 5 buffers, torch rounds pinned blocks up
    config["zero"]["param_buffer_size"] = 10**8
    with pytest.raises(ConfigError, match="param_buffer_size=100,000,000 is smaller than the largest parameter "
                                          "partition \\(131,334,144 elements\\)"):
        render.plan_config(validate(config), 1, hw=hw)


def test_plan_without_nvme_path_says_what_disk_would_fit():
    decision, _, _ = planned("40GiB", None)
    assert not decision.plan.fits
    advice = " ".join(decision.advice)
    assert "zero.offload_optimizer=nvme" in advice and "GB/s keeps that within the rest" in advice
    assert "free (host" in advice


# ------------------------------------------------------------------ swap layout maths
def test_swap_layout_keeps_direct_io_whole_blocks():
    """4 I/O threads split a 1,029,120-element sub group into 1,029,120 B shares: whole 512-B
    blocks, not whole 4 KiB ones. zerofit goes to one thread, where the share is the whole
    padded transfer (4,116,480 B = 1005 x 4 KiB)."""
    groups = ((1_029_120,),)
    four = Aio(intra_op_parallelism=4)
    assert swaplayout.transfer_problems(groups, four, 512) == []
    assert swaplayout.transfer_problems(groups, four, 4096)
    fixed, changes = swaplayout.aligned_aio(groups, four, 4096)
    assert fixed.intra_op_parallelism == 1 and swaplayout.transfer_problems(groups, fixed, 4096) == []
    assert "intra_op_parallelism 4 -> 1" in changes[0]
    # a sub group under one aio block stays in RAM, and only its moments' files are counted
    layout = swaplayout.layout(((200_000,), (1_028_096,)), Aio())
    assert layout.resident == (200_000,) and layout.swapped == (1_028_096,)
    assert layout.state_bytes == 3 * 4 * 1_028_096 and layout.pinned_buffer_bytes == 4 * 4 * 1_028_096
    # per step: master, moments and gradients in; all of them out once (gradients at the boundary)
    assert layout.read_bytes_per_step == layout.write_bytes_per_step == 4 * 4 * 1_028_096


def test_pipelined_swap_costs_buffers_and_saves_its_measured_share():
    numel = 24 * 2**20  # whole aio-aligned transfers: no padding
    groups = tuple((numel,) for _ in range(10))  # ten sub groups of 96 MiB fp32
    serial, pipelined = (swaplayout.layout(groups, Aio(), pipelined=p) for p in (False, True))
    assert pipelined.pinned_buffer_bytes == 3 * serial.pinned_buffer_bytes
    read, write = 2e9, 1e9  # bytes/s
    moved = 10 * 16 * numel  # per step, each way: master, two moments, gradients
    at_rates = moved / read + moved / write
    assert swaplayout.nvme_seconds(serial, read, write) == pytest.approx(swaplayout.SERIAL_SWAP_FRACTION * at_rates)
    assert swaplayout.nvme_seconds(pipelined, read, write) == pytest.approx(
        swaplayout.PIPELINED_SWAP_FRACTION * swaplayout.SERIAL_SWAP_FRACTION * at_rates)
    # one sub group: nothing to overlap
    single = swaplayout.layout(groups[:1], Aio(), pipelined=True)
    assert swaplayout.nvme_seconds(single, read, write) == pytest.approx(swaplayout.nvme_seconds(serial, read, write) / 10)


def test_space_and_memlock_problems_name_numbers_and_fix(tmp_path, monkeypatch):
    problem = nvme.space_problem(tmp_path, 10 * 2**30, free_bytes=2**30)
    assert "1.0GiB free under" in problem and "10.0GiB" in problem and "Free 10.0GiB" in problem
    assert nvme.space_problem(tmp_path, 2**30, free_bytes=10 * 2**30) is None
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, hard))
        if hardware.has_ipc_lock():  # root in most containers: mlock passes the limit
            assert nvme.memlock_problem(2**30) is None
        monkeypatch.setattr(hardware, "has_ipc_lock", lambda: False)  # a process the limit binds
        problem = nvme.memlock_problem(2**30)
        assert "lock 1.0GiB of RAM, `ulimit -l` allows 64.0KiB" in problem and "ulimit -l unlimited" in problem
        assert nvme.memlock_problem(32 * 1024) is None and nvme.memlock_problem(0) is None
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_an_nvme_path_that_is_a_file_is_named_so(tmp_path):
    """It read "not usable: File exists" (the swap directory could not be made under it)."""
    file = tmp_path / "swap"
    file.write_text("")
    assert nvme.path_problem(file) == (f"zero.nvme_path={file} is a file, not a directory; name a directory for "
                                       f"DeepSpeed's swap files")


@pytest.mark.e2e
@needs_async_io
def test_a_lora_base_on_nvme_is_said_unchecked(tmp_path):
    """A LoRA base whose partitions are on NVMe (zero.offload_param nvme) is not fingerprinted:
    reading it back would cost a full swap-in. A run on NVMe records no fingerprint, and its
    resume says the base was not checked; a resume onto NVMe of a checkpoint that has one
    (the base in RAM then) says so too and keeps that fingerprint for the next resume to check."""
    from zerofit.lora.base import BASE_FINGERPRINT

    raw = tiny_config(tmp_path / "run", model={"config": "mini", "gradient_checkpointing": False},
                      lora={"enabled": True, "r": 8, "alpha": 32}, train={"max_steps": 1},
                      eval={"every_steps": 0, "at_end": False}, checkpoint={"every_steps": 1, "keep_last": 3})
    config = write_config(tmp_path / "c.yaml", raw)
    on_nvme = ["--set", "zero.offload_param=nvme", "--set", f"zero.nvme_path={tmp_path / 'swap'}",
               "--set", f"zero.param_buffer_size={MINI_EMBEDDING}"]  # the embedding's 1 MiB is swapped
    unchecked = ("cannot check that the frozen base is the one this run's adapters were trained on (checkpoint at "
                 "step {step}): {why}; make sure model.path (or model.config, train.seed and train.precision) is "
                 "what it was")

    def fingerprint(step):
        state = json.loads((tmp_path / "run" / "checkpoints" / f"step-{step:06d}" / "loop_state.json").read_text())
        return state["extra"][BASE_FINGERPRINT]

    def train(max_steps, *sets):
        done = run_zerofit(["train", "--config", str(config), "--set", f"train.max_steps={max_steps}", *sets],
                           env={"COLUMNS": "400"})
        return " ".join(done.stderr.split())

    assert "cannot check" not in train(1, *on_nvme) and fingerprint(1) == [None]  # a new run: nothing to compare
    said = train(2)  # the base in RAM
    assert unchecked.format(step=1, why="the checkpoint records no fingerprint of it (its partitions were on NVMe)") \
        in said, said[-3000:]
    assert None not in fingerprint(2)
    said = train(3, *on_nvme)
    assert unchecked.format(step=2, why="its partitions are on NVMe now, where reading them back would cost a full "
                                        "swap-in") in said, said[-3000:]
    assert fingerprint(3) == fingerprint(2)


@pytest.mark.e2e
@needs_async_io
def test_a_lora_base_on_nvme_checked_by_its_files_is_not_said_unchecked(tmp_path):
    """A model.path base is compared with the checkpoint's fingerprint from its files before the
    build (loraresume.base_refusal): on NVMe now, the resume said it could not check the base all the
    same. Now it says nothing; another base is refused as in RAM."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from zerofit.demo import build_tokenizer
    from zerofit.models import config_from_name

    base = tmp_path / "base"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config_from_name("mini")).save_pretrained(base)
    build_tokenizer().save_pretrained(base)
    moved = tmp_path / "moved"
    shutil.copytree(base, moved)
    tensors = load_file(moved / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] += 1e-3
    save_file(tensors, moved / "model.safetensors", metadata={"format": "pt"})
    raw = tiny_config(tmp_path / "run", lora={"enabled": True, "r": 8, "alpha": 32}, train={"max_steps": 1},
                      eval={"every_steps": 0, "at_end": False}, checkpoint={"every_steps": 1})
    raw["model"] = {"path": str(base), "gradient_checkpointing": False}
    config = write_config(tmp_path / "c.yaml", raw)
    run_zerofit(["train", "--config", str(config)])
    on_nvme = ["--set", "zero.offload_param=nvme", "--set", f"zero.nvme_path={tmp_path / 'swap'}",
               "--set", f"zero.param_buffer_size={MINI_EMBEDDING}"]
    for path, refused in ((moved, True), (base, False)):
        done = run_zerofit(["train", "--config", str(config), "--set", "train.max_steps=2", "--set",
                            f"model.path={path}", *on_nvme], check=False, env={"COLUMNS": "400"})
        said = " ".join(done.stderr.split())
        assert done.returncode == int(refused) and "cannot check" not in said, said[-3000:]
        assert ("the frozen base model differs from the one" in said) == refused
    assert (tmp_path / "run" / "checkpoints" / "step-000002").is_dir()
