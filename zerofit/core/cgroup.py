"""What this process's control group lets it use of the machine: its memory and its CPUs.

In a container (`docker run --memory 64g --cpus 8`), a Kubernetes pod with limits or a Slurm job
with cgroup confinement, the machine's figures (psutil, os.cpu_count) overstate what the run may
take: the kernel's OOM killer ends the group at its memory limit, whatever the machine has free,
and a CPU quota throttles 64 CPU-Adam threads to the time of 8. The planner, the watchdog and the
tokenizing workers read their host figures here.

cgroup v2 (memory.max, memory.high, memory.current, cpu.max) and v1 (memory.limit_in_bytes,
memory.usage_in_bytes, cpu.cfs_quota_us / cpu.cfs_period_us), per the kernel's
Documentation/admin-guide/cgroup-v2.rst and cgroup-v1/memory.rst. The group's directory is found
from /proc/self/cgroup and /proc/self/mountinfo; a limit anywhere above it, up to the mount (a
container's own root), binds too, so every level is read and the tightest wins.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import psutil

# v1 writes "no limit" as the largest page-aligned 64-bit value (9223372036854771712)
V1_NO_LIMIT = 2**62


@dataclass(frozen=True)
class HostMemory:
    total: int            # the machine's RAM, or the group's limit where that is smaller
    available: int        # what may still be taken before the kernel reclaims the last or kills
    limit: str | None     # what capped it, said to the user ("cgroup memory limit 64.0GiB"), None: the machine


@dataclass(frozen=True)
class GroupDirs:
    """The process's group directory for one controller and its ancestors up to the mount,
    innermost first; `v2`: the unified hierarchy's file names."""
    levels: tuple[Path, ...]
    v2: bool


def host_memory() -> HostMemory:
    """The machine's RAM (psutil) or the memory group's, whichever is tighter."""
    machine = psutil.virtual_memory()
    return tighter(machine.total, machine.available, memory_limit_and_available(group_dirs("memory")))


def tighter(machine_total: int, machine_available: int, group: tuple[int, int] | None) -> HostMemory:
    """The machine's figures, or the group's (limit, available) where its limit is below the
    machine's RAM: a limit above it never binds before the machine runs out (the GPU machine's
    containers sit under a 128 GiB limit on 125.9 GiB)."""
    if group is None or group[0] >= machine_total:
        return HostMemory(machine_total, machine_available, None)
    limit, available = group
    return HostMemory(limit, min(machine_available, available), f"cgroup memory limit {limit / 2**30:.1f}GiB")


def cpu_limit() -> int | None:
    """The group's CPU quota in whole CPUs (at least 1), None when it has none."""
    quota = cpu_quota(group_dirs("cpu"))
    return None if quota is None else max(1, math.floor(quota))  # as Go's automaxprocs rounds


# ---------------------------------------------------------------------- reading one group
def memory_limit_and_available(dirs: GroupDirs | None) -> tuple[int, int] | None:
    """(the tightest limit, what its level may still take), None where no level has a limit.
    v2's memory.high counts as a limit: above it the kernel throttles the group and reclaims
    its pages on every allocation, so a run planned past it crawls where it does not die.
    Used memory counts the group's pages less its page cache (active and inactive file pages),
    which the kernel reclaims before it kills the group, as MemAvailable counts the machine's:
    a run's checkpoints, written through the cache, are charged to its group."""
    if dirs is None:
        return None
    limit_names, usage_name, prefix = ((("memory.max", "memory.high"), "memory.current", "") if dirs.v2 else
                                       (("memory.limit_in_bytes",), "memory.usage_in_bytes", "total_"))
    found = None
    for level in dirs.levels:
        limits = [value for value in (_read_int(level / name) for name in limit_names) if value is not None]
        limit = min(limits) if limits else None
        usage = _read_int(level / usage_name)
        if limit is None or limit >= V1_NO_LIMIT or usage is None:
            continue
        stat = _stat(level / "memory.stat")
        used = max(0, usage - stat.get(f"{prefix}active_file", 0) - stat.get(f"{prefix}inactive_file", 0))
        here = (limit, max(0, limit - used))
        found = here if found is None or here[1] < found[1] else found
    return found


def cpu_quota(dirs: GroupDirs | None) -> float | None:
    """The tightest level's quota / period in CPUs, None where no level has one."""
    if dirs is None:
        return None
    quotas = []
    for level in dirs.levels:
        if dirs.v2:
            fields = _read_text(level / "cpu.max").split()
            quota, period = (fields + ["", ""])[:2]
        else:
            quota, period = _read_text(level / "cpu.cfs_quota_us"), _read_text(level / "cpu.cfs_period_us")
        if quota.strip().lstrip("-").isdigit() and int(quota) > 0 and period.strip().isdigit() and int(period) > 0:
            quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


# ---------------------------------------------------------------------- finding the group
@lru_cache(maxsize=None)
def group_dirs(controller: str) -> GroupDirs | None:
    """This process's directory for `controller` (a group does not change under a run)."""
    try:
        return find_dirs(controller, Path("/proc/self/cgroup").read_text(),
                         Path("/proc/self/mountinfo").read_text())
    except OSError:
        return None


def find_dirs(controller: str, proc_cgroup: str, mountinfo: str, root: Path = Path("/")) -> GroupDirs | None:
    """The group's directories from the texts of /proc/self/cgroup and /proc/self/mountinfo;
    `root` prefixes the mount points (a test's tree). A v1 hierarchy with the controller wins
    over the unified one (a hybrid machine mounts both, its controllers on v1)."""
    paths = {}  # "memory" or "" (v2) -> the group's path in its hierarchy
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for name in parts[1].split(",") if parts[1] else [""]:
                paths[name] = parts[2]
    for fstype, wanted in (("cgroup", controller), ("cgroup2", "")):
        for mount_root, mount_point, options in _cgroup_mounts(mountinfo, fstype):
            if wanted and wanted not in options or wanted not in paths:
                continue
            point = root / mount_point.lstrip("/")
            group = paths[wanted]
            inside = _below(group, mount_root)
            directory = point / inside if inside else point
            levels = [directory]
            while levels[-1] != point and point in levels[-1].parents:
                levels.append(levels[-1].parent)
            return GroupDirs(tuple(levels), v2=fstype == "cgroup2")
    return None


def _below(group: str, mount_root: str) -> str:
    """The group's path under a mount of `mount_root` (a container's mount starts below the
    hierarchy's root), compared by whole components: /docker/abcdef is not below /docker/abc.
    "" where the group is the mount's root or outside it (the mount is then the nearest we see)."""
    group_parts = [part for part in group.split("/") if part]
    root_parts = [part for part in mount_root.split("/") if part]
    if group_parts[:len(root_parts)] != root_parts:
        return ""
    return "/".join(group_parts[len(root_parts):])


def _cgroup_mounts(mountinfo: str, fstype: str) -> list[tuple[str, str, set[str]]]:
    """(root in the hierarchy, mount point, super options) of each mount of `fstype`
    (proc(5): "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue")."""
    mounts = []
    for line in mountinfo.splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] == fstype:
            mounts.append((fields[3], fields[4], set(tail[2].split(","))))
    return mounts


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    return int(text) if text.isdigit() else None


def _stat(path: Path) -> dict[str, int]:
    pairs = (line.split() for line in _read_text(path).splitlines())
    return {pair[0]: int(pair[1]) for pair in pairs if len(pair) == 2 and pair[1].isdigit()}
