"""Choosing the fastest configuration that fits, or saying what would (choice.py, fitadvice.py)."""
from dataclasses import replace

import pytest
from conftest import config, cpu_box, cuda_box

from zerofit.config.load import validate
from zerofit.core.timeline import human_bytes
from zerofit.machine import hardware
from zerofit.plan import choose
from zerofit.plan import spec as modelspec


# ------------------------------------------------------------------------ choice
def test_keeps_parameters_on_a_gpu_that_holds_them_where_that_is_faster():
    spec = modelspec.from_name("llama-1.5b")
    roomy = choose.decide(config(train={"micro_batch_size": 1}), spec, cuda_box("80GiB"), 1)
    assert roomy.plan.fits and roomy.config.zero.offload_param == roomy.config.zero.offload_optimizer == "none"
    assert roomy.chosen_fields["zero.offload_param"] == "none"
    # optimizer offloaded: parameters on the GPU cost the copy back after each step
    # (planner param_copy_back); each placement is the fastest that fits of its kind
    decision = choose.decide(config(train={"micro_batch_size": 1}), spec, cuda_box("24GiB"), 1)
    assert decision.plan.fits and decision.config.zero.offload_optimizer == "cpu"
    fastest = {where: min((p.step_seconds for p in decision.considered if p.fits and not choose.narrowed_window(p)
                           and p.candidate.offload_param == where), default=None) for where in ("none", "cpu")}
    assert None not in fastest.values()
    assert decision.plan.step_seconds == min(fastest.values())
    assert decision.config.zero.offload_param == min(fastest, key=fastest.get)
    small = choose.decide(config(train={"micro_batch_size": 1}), spec, cuda_box("6GiB"), 1)
    assert small.plan.fits and small.config.zero.offload_param == "cpu"
    assert small.config.zero.offload_optimizer == "cpu"


def test_short_host_ram_under_a_cgroup_limit_says_to_raise_the_limit():
    """A container's limit, not the machine, is what ran short: the advice names it and how to raise it."""
    spec = modelspec.from_name("llama-1.5b")
    limited = hardware.with_overrides(cpu_box("3GiB"), host_limit="cgroup memory limit 3.0GiB",
                                      overridden=())  # as probed in the group: the budget is the limit's
    message = str(choose.refuse(choose.decide(config(), spec, limited, 1)))
    assert "of host RAM (have 3.0GiB under the cgroup memory limit 3.0GiB: raise it with docker --memory" in message
    assert "under the cgroup" not in str(choose.refuse(choose.decide(config(), spec, cpu_box("3GiB"), 1)))
    asked = hardware.with_overrides(limited, overridden=("host_mem",))  # plan.host_mem set the budget, not the group
    assert "under the cgroup" not in str(choose.refuse(choose.decide(config(), spec, asked, 1)))


def test_user_settings_are_constraints():
    spec = modelspec.from_name("llama-1.5b")
    decision = choose.decide(config(zero={"offload_param": "cpu"}, model={"gradient_checkpointing": True}),
                             spec, cuda_box("80GiB"), 1)
    assert decision.config.zero.offload_param == "cpu" and decision.config.model.gradient_checkpointing
    assert "zero.offload_param" not in decision.chosen_fields
    assert {shape.gradient_checkpointing for shape in {p.shape for p in decision.considered}} == {True}


@pytest.mark.e2e
def test_global_batch_is_split_into_micro_and_accumulation():
    spec = modelspec.from_name("llama-1.5b")
    decision = choose.decide(config(train={"global_batch_size": 16}), spec, cuda_box("24GiB"), 2)
    train = decision.config.train
    assert train.micro_batch_size * train.grad_accum_steps * 2 == 16
    with pytest.raises(Exception, match="multiple of the world size"):
        choose.decide(config(train={"global_batch_size": 15}), spec, cuda_box(), 2)


def test_nothing_fits_says_what_would_with_numbers():
    spec = modelspec.from_name("llama-8b")
    decision = choose.decide(config(model={"config": "llama-8b"}, zero={"offload_optimizer": "cpu"}), spec,
                             cuda_box("24GiB", host="64GiB"), 1)
    assert not decision.plan.fits and "host" in decision.plan.binding
    text = str(choose.refuse(decision))
    assert "no configuration fits" in text and "host:" in text and "GiB of host RAM" in text
    assert any("nvme" in a for a in decision.advice)


def test_a_refusal_names_the_one_moment_that_does_not_fit():
    """A plan may fail only in the first step after a save (the save's GPU residue on top of
    the step's peak): the refusal's breakdown names it, not an empty list."""
    spec = modelspec.from_name("llama-1.5b")
    decision = choose.decide(config(train={"micro_batch_size": 1}), spec, cuda_box("24GiB"), 1)
    gpu = decision.plan.first_step_after_save_peak["gpu"]
    over = replace(gpu, total_bytes=gpu.usable_bytes + 2**30)
    plan = replace(decision.plan, fits=False, first_step_after_save_peak={**decision.plan.first_step_after_save_peak,
                                                                          "gpu": over})
    text = str(choose.refuse(replace(decision, plan=plan)))
    assert f"gpu (first step after a save): {human_bytes(over.total_bytes)} of" in text, text


def test_a_disk_too_small_for_checkpoints_does_not_change_the_configuration():
    """Short of disk alone, the configuration shown is still the fastest the GPU and host hold
    (it was the one closest to fitting overall, so it followed this machine's free disk)."""
    spec = modelspec.from_name("llama-1.5b")
    saving = config(train={"micro_batch_size": 1}, checkpoint={"save_final": True})
    roomy = choose.decide(saving, spec, cuda_box("24GiB"), 1)
    cramped = choose.decide(saving, spec, cuda_box("24GiB", disk=10**9), 1)
    assert roomy.plan.fits and not cramped.plan.fits and cramped.plan.binding == ["disk"]
    assert cramped.plan.candidate == roomy.plan.candidate and cramped.plan.shape == roomy.plan.shape
    assert any(a.startswith("disk:") for a in cramped.advice)


def test_a_disk_the_plan_passes_takes_every_save(tmp_path):
    """The disk plan holds the margin checkpoint.free_space_problem asks before each save (10%
    and 64 MiB): on a disk with room for the checkpoints alone the plan passed and the run
    stopped at its first save. Where the plan fits now, the save's own check passes."""
    from zerofit.checkpoint import files as checkpoint

    spec = modelspec.from_name("tiny")  # a checkpoint of a few MiB: the 64 MiB outweighs the plan's headroom
    keep_one = config(train={"micro_batch_size": 1, "max_steps": 100}, checkpoint={"every_steps": 10, "keep_last": 1})
    disk = choose.decide(keep_one, spec, cuda_box("24GiB"), 1).plan.devices["disk"]
    on_disk = choose.checkpoints_on_disk(keep_one)
    assert on_disk == 2  # the older one stays until the newer is written
    one = disk.components["checkpoints"] // on_disk
    share = disk.usable_bytes / disk.budget_bytes  # the headroom the plan keeps
    bare = int(one * on_disk / share) + 1  # room for the checkpoints alone
    assert not choose.decide(keep_one, spec, cuda_box("24GiB", disk=bare), 1).plan.devices["disk"].fits
    enough = int(disk.total_bytes / share) + 1
    assert choose.decide(keep_one, spec, cuda_box("24GiB", disk=enough), 1).plan.devices["disk"].fits
    older = (on_disk - 1) * one  # what the disk holds when the next save begins
    assert checkpoint.free_space_problem(tmp_path, one, free_bytes=enough - older) is None
    assert checkpoint.free_space_problem(tmp_path, one, free_bytes=bare - older) is not None


@pytest.mark.e2e
def test_a_resume_counts_the_checkpoints_retention_deletes(reference):
    """A run killed on a small disk could not resume there: the plan asked room for keep_last + 1
    new checkpoints while the two already there would be rotated out ("disk: 95.6MiB of 88.3MiB
    usable" on a 120 MiB disk the run had completed on). Planned as a resume of a real run dir
    (step-000004 and step-000006, keep_last 2) on a disk one checkpoint short of that demand."""
    from zerofit.checkpoint import files as checkpoint
    from zerofit.plan import render

    more = ["train.max_steps=12"]
    config_file = str(reference / "config.yaml")
    one = checkpoint.on_disk_bytes(reference / "checkpoints" / "step-000006")
    disk = render.plan(config_path=config_file, overrides=more, disk_free="1TB")[0].plan.devices["disk"]
    share = disk.usable_bytes / disk.budget_bytes
    short = int(disk.total_bytes / share) - one  # room for all but one of the new checkpoints
    decision, _, hw = render.plan(config_path=config_file, overrides=more, disk_free=f"{short}B")
    assert decision.plan.devices["disk"].fits, decision.plan.devices["disk"]
    credit = hw.disk_free_bytes - short
    assert abs(credit - 2 * one) <= one // 10  # both existing ones go as the three new ones are written
    assert any(note.startswith("disk:") and "retention deletes" in note for note in decision.plan.notes)
    fresh = render.plan_config(decision.config, 1, hw=hardware.with_overrides(hw, disk_free_bytes=short),
                                 resuming=False)[0]  # --no-resume sets them aside: they stay on the disk
    assert not fresh.plan.devices["disk"].fits


def test_a_run_without_periodic_saves_keeps_one_checkpoint_on_disk():
    once = validate({"model": {"config": "tiny"}, "train": {"epochs": 1},
                     "checkpoint": {"every_steps": 0, "every_minutes": 0}})
    assert choose.checkpoints_on_disk(once) == 1
    never = validate({"model": {"config": "tiny"}, "train": {"epochs": 1},
                      "checkpoint": {"every_steps": 0, "every_minutes": 0, "save_final": False}})
    assert choose.checkpoints_on_disk(never) == 0
    # the clock may save at any step: keep_last + 1 on disk, at most one a step
    by_the_clock = validate({"model": {"config": "tiny"}, "train": {"epochs": 1}, "checkpoint": {"every_steps": 0}})
    assert choose.checkpoints_on_disk(by_the_clock) == 3
    short = validate({"model": {"config": "tiny"}, "train": {"max_steps": 2},
                      "checkpoint": {"every_steps": 0, "save_final": False}})
    assert choose.checkpoints_on_disk(short) == 2


def test_cpu_machine_plans_against_host_ram():
    spec = modelspec.from_name("tiny")
    decision = choose.decide(validate({"model": {"config": "tiny"}, "train": {"max_steps": 1}}), spec, cpu_box(), 1)
    plan = decision.plan
    assert plan.accelerator == "cpu" and plan.gpu_allocated_peak == 0 and plan.devices["gpu"].total_bytes == 0
    assert any(k.startswith("device:") for k in plan.devices["host"].components)
    assert decision.config.zero.offload_param == "none"


def test_what_would_fit_offloads_or_partitions_parameters_the_closest_plan_holds(tmp_path, capsys):
    """The closest plan keeps every parameter persistent (one rank, parameters on the GPU): the
    alternatives that offload them or add ranks were priced with that threshold, so the GPU still
    held them all and neither was offered; only NVMe and "more memory" were. And a plan whose
    training fits but whose engine start does not said "nothing zerofit can change" with no number."""
    from zerofit.cli import main

    hardware_flags = ["--accelerator", "cuda", "--disk-free", "4TB"]
    assert main(["plan", "--model", "llama-13b", "--gpu-mem", "24GiB", "--host-mem", "128GiB", *hardware_flags]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "gpu: zero.offload_optimizer=cpu zero.offload_param=cpu (GPU" in out and "gpu: 2 GPUs" in out
    assert main(["plan", "--model", "llama-1.5b", "--gpu-mem", "8GiB", "--host-mem", "20GiB", "--headroom", "0",
                 "--offload-optimizer", "nvme", "--offload-param", "cpu", "--nvme-path", str(tmp_path),
                 *hardware_flags]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "host (engine start): 21.3GiB of host RAM (have 20.0GiB)" in out and "nothing zerofit can change" not in out


def test_what_would_fit_says_what_a_change_leaves_over_and_tells_close_sizes_apart(capsys):
    """llama-1.5b at 24 GiB on 23.5 GiB of RAM: each GPU fix left the host over budget without a
    word (a user who shortened train.seq_len met "does not fit" again), and the GPU's need read
    "24.0GiB (have 24.0GiB)"."""
    from zerofit.cli import main

    flags = ["--model", "llama-1.5b", "--gpu-mem", "24GiB", "--host-mem", "23.5GiB", "--accelerator", "cuda",
             "--disk-free", "2TB"]
    assert main(["plan", *flags]) == 1
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.split("\n  - ")]
    seq = next(line for line in lines if line.startswith("gpu: train.seq_len="))
    assert "; host still over: " in seq and "GiB usable" in seq
    shorter = seq.split("=")[1].split()[0]
    assert main(["plan", *flags, "--seq-len", shorter]) == 1  # the GPU fits there, the host does not
    out = " ".join(capsys.readouterr().out.split())
    assert "gpu: " not in out.split("what would fit:")[1] and "host: " in out.split("what would fit:")[1]
    gpu_need = next(line for line in lines if line.startswith("gpu: ") and "of GPU memory per rank" in line)
    need, have = gpu_need.removeprefix("gpu: ").split(" of GPU memory per rank (have ")
    assert need != have.rstrip(")")


def test_fixed_segments_are_noted_where_the_norms_block_has_no_room():
    """With memory.expandable_segments off, a plan that leaves less under the GPU budget than
    DeepSpeed's fp64 norm copy (1.86 GiB for llama-3.6b's 394M-element embedding, capped at
    250M elements) says so; with room to spare, or expandable segments on, it says nothing."""
    spec = modelspec.from_name("llama-3.6b")

    def notes(gpu_mem, expandable):
        hw = hardware.with_overrides(hardware.probe(accelerator="cuda", gpu_mem=gpu_mem, host_mem="200GiB"),
                                     disk_free_bytes=10**13, cpu_cores=16)
        config = validate({"run_dir": "/tmp/unused", "model": {"config": "llama-3.6b"}, "data": {"path": "synthetic"},
                           "train": {"max_steps": 1, "seq_len": 1024, "global_batch_size": 16},
                           "plan": {"headroom": 0.05}, "memory": {"expandable_segments": expandable}})
        return [n for n in choose.decide(config, spec, hw, 1).plan.notes if n.startswith("fixed GPU segments")]

    tight = notes("5.3GiB", False)
    assert len(tight) == 1 and "asks 1.9GiB in one block" in tight[0]
    assert notes("5.3GiB", True) == []
    assert notes("24GiB", False) == []
