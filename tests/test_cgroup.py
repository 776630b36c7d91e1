"""The run's cgroup limits, read from trees laid out as the kernel lays them (v1 and v2), and,
where this machine lets a test make a group, from a real one."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_zerofit, tiny_config, write_config

from zerofit.core import cgroup
from zerofit.core.cgroup import GroupDirs, find_dirs
from zerofit.machine import hardware

GIB = 2**30
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MEMORY_MOUNT = "35 31 0:32 {root} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
V1_CPU_MOUNT = "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
HYBRID_UNIFIED = "41 31 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"


def write(directory: Path, **files: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text + "\n")
    return directory


def test_v2_in_a_container_reads_its_own_root(tmp_path):
    """A container with its own cgroup namespace: /proc/self/cgroup says "0::/", the mount is its group."""
    group = write(tmp_path / "sys/fs/cgroup", memory__max=str(8 * GIB), memory__current=str(3 * GIB),
                  memory__stat=f"anon {GIB}\ninactive_file {GIB}\nactive_file {GIB}\nshmem 0", cpu__max="250000 100000")
    memory = find_dirs("memory", "0::/\n", V2_MOUNT, root=tmp_path)
    assert memory == GroupDirs((group,), v2=True)
    # 3 GiB charged, 2 GiB of it page cache the kernel reclaims first (a run's checkpoints): 1 used, 7 left
    assert cgroup.memory_limit_and_available(memory) == (8 * GIB, 7 * GIB)
    assert cgroup.cpu_quota(find_dirs("cpu", "0::/\n", V2_MOUNT, root=tmp_path)) == 2.5


def test_v2_a_tighter_parent_binds_and_max_means_none(tmp_path):
    """A systemd slice or a Kubernetes pod sets the limit one level above the process's group."""
    pod = write(tmp_path / "sys/fs/cgroup/kubepods/pod1", memory__max=str(4 * GIB), memory__current=str(1 * GIB),
                memory__stat="inactive_file 0", cpu__max="100000 100000")
    container = write(pod / "ctr", memory__max="max", memory__current=str(1 * GIB), cpu__max="max 100000")
    write(tmp_path / "sys/fs/cgroup", memory__max="max", memory__current=str(9 * GIB))
    dirs = find_dirs("memory", "0::/kubepods/pod1/ctr\n", V2_MOUNT, root=tmp_path)
    assert dirs.levels == (container, pod, pod.parent, tmp_path / "sys/fs/cgroup")
    assert cgroup.memory_limit_and_available(dirs) == (4 * GIB, 3 * GIB)
    assert cgroup.cpu_quota(dirs) == 1.0
    write(pod, memory__max="max", cpu__max="max 100000")
    assert cgroup.memory_limit_and_available(dirs) is None
    assert cgroup.cpu_quota(dirs) is None


def test_v1_docker_without_a_namespace_and_the_hybrid_layout(tmp_path):
    """Docker on v1 mounts the container's group (root /docker/ID) where /proc/self/cgroup names
    it by its host path; a hybrid machine also mounts an empty unified hierarchy, which loses."""
    proc = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n"
    mounts = (V1_MEMORY_MOUNT.format(root="/docker/abc") + V1_CPU_MOUNT.format(root="/docker/abc")
              + HYBRID_UNIFIED)
    memory = write(tmp_path / "sys/fs/cgroup/memory", memory__limit_in_bytes=str(16 * GIB),
                   memory__usage_in_bytes=str(5 * GIB), memory__stat=f"inactive_file 7\ntotal_inactive_file {GIB}\ntotal_active_file {GIB}")
    write(tmp_path / "sys/fs/cgroup/cpu,cpuacct", cpu__cfs_quota_us="400000", cpu__cfs_period_us="100000")
    dirs = find_dirs("memory", proc, mounts, root=tmp_path)
    assert dirs == GroupDirs((memory,), v2=False)
    assert cgroup.memory_limit_and_available(dirs) == (16 * GIB, 13 * GIB)  # v1: the hierarchy's total_ counts
    assert cgroup.cpu_quota(find_dirs("cpu", proc, mounts, root=tmp_path)) == 4.0


def test_a_mount_root_matches_whole_path_components(tmp_path):
    """A mount of /docker/abc holds /docker/abc/x, not /docker/abcdef/x (a sibling container's
    group, seen through a shared mount): that one reads the mount itself, not a made-up 'def/x'."""
    mounts = V1_MEMORY_MOUNT.format(root="/docker/abc")
    point = tmp_path / "sys/fs/cgroup/memory"
    assert find_dirs("memory", "12:memory:/docker/abc/x\n", mounts, root=tmp_path).levels == (point / "x", point)
    assert find_dirs("memory", "12:memory:/docker/abcdef/x\n", mounts, root=tmp_path).levels == (point,)


def test_v2_memory_high_throttles_and_counts_as_the_limit(tmp_path):
    """Past memory.high the kernel reclaims and throttles the group on every allocation: a plan
    past it crawls, so it is the budget where it is below memory.max."""
    group = write(tmp_path / "sys/fs/cgroup", memory__max=str(8 * GIB), memory__high=str(6 * GIB),
                  memory__current=str(2 * GIB), memory__stat="inactive_file 0")
    dirs = find_dirs("memory", "0::/\n", V2_MOUNT, root=tmp_path)
    assert cgroup.memory_limit_and_available(dirs) == (6 * GIB, 4 * GIB)
    write(group, memory__high="max")
    assert cgroup.memory_limit_and_available(dirs) == (8 * GIB, 6 * GIB)


def test_v1_unlimited_is_no_limit_and_a_missing_group_is_none(tmp_path):
    write(tmp_path / "sys/fs/cgroup/memory/a", memory__limit_in_bytes="9223372036854771712",
          memory__usage_in_bytes=str(GIB))
    write(tmp_path / "sys/fs/cgroup/cpu,cpuacct", cpu__cfs_quota_us="-1", cpu__cfs_period_us="100000")
    proc = "12:memory:/a\n4:cpu,cpuacct:/\n"
    mounts = V1_MEMORY_MOUNT.format(root="/") + V1_CPU_MOUNT.format(root="/")
    assert cgroup.memory_limit_and_available(find_dirs("memory", proc, mounts, root=tmp_path)) is None
    assert cgroup.cpu_quota(find_dirs("cpu", proc, mounts, root=tmp_path)) is None
    assert find_dirs("memory", "0::/\n", "", root=tmp_path) is None  # no cgroup filesystem mounted


def test_a_limit_above_the_machines_ram_never_binds():
    """The GPU machine's container: 128 GiB limit, 125.9 GiB of RAM. Its figures are the machine's
    (the doctor said "of 125.85 GiB (cgroup memory limit 128.0GiB)" once checkpoints filled the cache)."""
    machine = cgroup.tighter(125 * GIB, 120 * GIB, (128 * GIB, 100 * GIB))
    assert machine == cgroup.HostMemory(125 * GIB, 120 * GIB, None)
    limited = cgroup.tighter(125 * GIB, 120 * GIB, (64 * GIB, 60 * GIB))
    assert limited == cgroup.HostMemory(64 * GIB, 60 * GIB, "cgroup memory limit 64.0GiB")
    assert cgroup.tighter(125 * GIB, 20 * GIB, (64 * GIB, 60 * GIB)).available == 20 * GIB  # the machine is fuller
    assert cgroup.tighter(125 * GIB, 120 * GIB, None).limit is None


def test_this_process_reads_as_much_as_the_machine_has_at_most():
    import psutil

    host = cgroup.host_memory()
    machine = psutil.virtual_memory()
    assert 0 < host.total <= machine.total
    assert 0 < host.available <= host.total
    assert (host.limit is None) == (host.total == machine.total)


@pytest.mark.e2e
def test_plan_host_mem_beyond_the_machine_or_its_group_is_warned_of(tmp_path):
    """plan.host_mem is the budget the plan counts on; above what this machine lets the run take
    (its RAM, or its cgroup's limit), the kernel ends the run first: train says so as it plans."""
    machine = hardware.probe(accelerator="cpu")
    assert hardware.host_mem_beyond_reach(machine) is None  # probed: never beyond itself
    assert hardware.host_mem_beyond_reach(hardware.probe(host_mem="1GiB", accelerator="cpu")) is None
    asked = hardware.probe(host_mem="64GiB", accelerator="cpu")
    limited = hardware.with_overrides(asked, host_total_bytes=3 * GIB, host_limit="cgroup memory limit 3.0GiB")
    assert hardware.host_mem_beyond_reach(limited).startswith(
        "plan.host_mem 64.0GiB is more than this machine lets the run take (cgroup memory limit 3.0GiB)")
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run", train={"max_steps": 1},
                                                             plan={"host_mem": "1000TiB"}))
    done = run_zerofit(["train", "--config", str(config)])
    said = " ".join(done.stderr.split() + done.stdout.split())
    assert "plan.host_mem 1024000.0GiB is more than this machine lets the run take (" in said
    assert "leave plan.host_mem unset to plan against what is here" in said


def make_group() -> tuple[Path, Path] | None:
    """A memory and a CPU group below this process's own (v1, root), or None where this machine
    does not let a test make them (v2's no-internal-processes rule, no root)."""
    memory, cpu = cgroup.group_dirs("memory"), cgroup.group_dirs("cpu")
    if memory is None or cpu is None or memory.v2 or cpu.v2:
        return None
    made = []
    try:
        for dirs in (memory, cpu):
            made.append(dirs.levels[0] / f"zerofit-test-{os.getpid()}")
            made[-1].mkdir()
        (made[0] / "memory.limit_in_bytes").write_text(str(3 * GIB))
        (made[1] / "cpu.cfs_quota_us").write_text("150000")
        (made[1] / "cpu.cfs_period_us").write_text("100000")
    except OSError:
        for directory in made:
            directory.rmdir()
        return None
    return made[0], made[1]


CANNOT_JOIN = 97  # the exit status of a process the machine did not let into the groups


def in_groups(groups: tuple[Path, Path], argv: list[str]) -> subprocess.CompletedProcess:
    """`argv` run as a process of both groups (it joins them before it execs)."""
    join = "".join(f"{{ echo $$ > {directory}/cgroup.procs || exit {CANNOT_JOIN}; }} && " for directory in groups)
    return subprocess.run(["bash", "-c", join + 'exec "$@"', "in-group", *argv], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parent.parent)


@pytest.mark.e2e
def test_a_process_in_a_3_gib_group_plans_against_its_limit(tmp_path):
    """The probe, `zerofit plan` and `zerofit train` in a real memory group of 3 GiB with a CPU
    quota of 1.5 CPUs. Planned against the machine, that train was killed by the kernel at the
    limit (exit 137, bench/results/cgroup-3gib.txt); against the group, it stops with the advice."""
    groups = make_group()
    if groups is None:
        pytest.skip("this machine does not let a test make a cgroup (needs root and cgroup v1)")
    probe = ("from zerofit.machine import hardware; hw = hardware.probe(); "
             "print(hw.host_total_bytes, hw.host_budget_bytes, hw.cpu_cores, hw.host_limit)")
    try:
        probed = in_groups(groups, [sys.executable, "-c", probe])
        planned = in_groups(groups, [sys.executable, "-m", "zerofit", "plan", "--model", "llama-0.5b",
                                     "--gpu-mem", "24GiB"])
        trained = in_groups(groups, [sys.executable, "-m", "zerofit", "train", "--run-dir", str(tmp_path / "run"),
                                     "--set", "model.config=llama-0.5b", "--set", "train.seq_len=128"])
    finally:
        for directory in groups:
            directory.rmdir()  # empty again: its processes have exited
    if probed.returncode == CANNOT_JOIN:
        pytest.skip(f"this machine made the groups but let no process join them: {probed.stderr.strip()}")
    assert probed.returncode == 0, probed.stderr
    total, budget, cores, limit = probed.stdout.split(maxsplit=3)
    assert int(total) == 3 * GIB
    assert 2 * GIB < int(budget) <= 3 * GIB
    assert int(cores) == 1
    assert limit.strip() == "cgroup memory limit 3.0GiB"
    assert "(cgroup memory limit 3.0GiB), 1 rank(s)" in planned.stdout.replace("\n", " "), planned.stdout
    assert trained.returncode == 1, trained.stderr
    assert re.search(r"\(have \d\.\dGiB under the cgroup memory limit 3\.0GiB: raise it with docker --memory",
                     trained.stderr), trained.stderr
