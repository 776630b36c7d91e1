"""`zerofit doctor --system` (syscheck.py): machine checks, direct I/O on an NVMe path, the memlock limit, exit code."""
import errno
import os
import resource
import shutil
from pathlib import Path

import pytest
from conftest import run_zerofit

from zerofit.doctor import system
from zerofit.machine import hardware
from zerofit.nvme import preflight as nvme


def test_system_checks(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROFIT_CACHE_DIR", str(tmp_path / "cache"))  # the aio sweep's cache
    disk = tmp_path / "disk"
    checks = system.check_system(nvme_path=str(disk), nvme_mib=16)
    names = [c.name for c in checks]
    assert names[:7] == ["GPU", "driver / CUDA", "host RAM", "CPU cores", "pinned-memory limit (ulimit -l)", "libaio",
                         "DeepSpeed async_io"]
    cores = checks[3]
    assert cores.detail.startswith(f"{hardware.cpu_cores()} for this process of {os.cpu_count()} on the machine")
    assert cores.status == ("warn" if hardware.cpu_cores() < 4 else "pass") and (cores.status == "pass" or cores.fix)
    assert all(c.status in ("pass", "warn", "fail") for c in checks)
    assert all(c.fix for c in checks if c.status == "fail")
    by_end = {c.name.rsplit(" ", 1)[-1]: c for c in checks if c.name.startswith("NVMe path")}
    assert "GB/s over 16 MiB" in by_end["write"].detail and "GB/s over 16 MiB" in by_end["read"].detail
    if "tuning" in by_end:  # the aio sweep runs when nothing failed (async_io built)
        assert "cached in" in by_end["tuning"].detail
    assert not list(disk.iterdir())  # the test files are gone
    (tmp_path / "a_file").write_text("")
    unusable = system.check_direct_io(tmp_path / "a_file" / "swap", 16)
    assert unusable[0].status == "fail" and "writable directory" in unusable[0].fix
    typo = system.check_direct_io(tmp_path / "no" / "such" / "swap", 16)  # mkdir -p measured the disk of /
    assert typo[0].status == "fail" and f"{tmp_path / 'no' / 'such'} does not exist (a typo?" in typo[0].detail
    assert not (tmp_path / "no").exists()
    assert f"free on {nvme.mount_point(disk)}" in by_end["write"].detail


def test_a_direct_io_read_that_cannot_open_is_a_failed_check(tmp_path, monkeypatch):
    """The write went through, the read's O_DIRECT open is refused: a failed check naming it
    (the written file's descriptor was closed a second time, raising EBADF instead)."""
    real_open = os.open

    def refuse_reading(path, flags, *mode):
        if not flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *mode)

    monkeypatch.setattr(os, "open", refuse_reading)
    checks = system.check_direct_io(tmp_path / "swap", 8)
    assert checks[0].status == "fail" and "direct I/O failed: Permission denied" in checks[0].detail
    assert not list((tmp_path / "swap").iterdir())  # its test file removed


@pytest.mark.skipif(nvme.ram_filesystem(Path("/dev/shm")) is None, reason="no tmpfs at /dev/shm here")
def test_a_ram_backed_nvme_path_is_warned_of(tmp_path):
    """tmpfs passes every speed check (it is RAM): said, since swap files there take the RAM
    NVMe offload is meant to free."""
    shm = Path("/dev/shm") / f"zerofit-test-{os.getpid()}"
    try:
        checks = system.check_direct_io(shm, 16)
        fs = [c for c in checks if c.name.endswith("filesystem")]
        assert len(fs) == 1 and fs[0].status == "warn" and "tmpfs" in fs[0].detail
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert nvme.ram_filesystem(tmp_path) in (None, "tmpfs")  # whatever the test dir is on, no error
    assert nvme.ram_filesystem(Path("/proc")) is None


def test_memlock_limit_is_judged():
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, hard))
        check = system.check_memlock()
        if hardware.has_ipc_lock():  # root in most containers: mlock is not bound by the limit
            assert check.status == "pass" and "64 KiB" in check.detail and "CAP_IPC_LOCK" in check.detail
        else:
            assert check.status == "warn" and "64 KiB" in check.detail and "ulimit -l unlimited" in check.fix
        # the planner judges the same limit the same way (it noted a limit CAP_IPC_LOCK lifts)
        assert (hardware.memlock_limit() is None) == hardware.has_ipc_lock()
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


@pytest.mark.e2e
def test_system_cli_exit_code_follows_failures(tmp_path):
    done = run_zerofit(["doctor", "--system", "--nvme-path", str(tmp_path), "--nvme-mib", "8"], check=False,
                       env={"ZEROFIT_CACHE_DIR": str(tmp_path / "cache")})
    statuses = [line.split("│")[2].strip() for line in done.stdout.splitlines() if line.count("│") == 5]
    assert {"pass", "warn", "fail"} >= set(statuses) - {""} and "pass" in statuses
    failed = "fail" in statuses
    assert done.returncode == (1 if failed else 0), done.stdout
    assert "NVMe path" in done.stdout and "async_io" in done.stdout
    assert "real_accelerator" not in done.stdout + done.stderr  # DeepSpeed's detection line headed the table


def _table_statuses(stdout: str) -> dict[str, str]:
    """doctor --system's table: each check's first line holds its name and status."""
    rows = [line.split("│") for line in stdout.splitlines() if line.count("│") == 5]
    return {cells[1].strip(): cells[2].strip() for cells in rows if cells[2].strip()}


@pytest.mark.e2e
def test_missing_libaio_fails_only_when_nvme_is_asked_for(tmp_path, monkeypatch):
    """Without libaio (the probe looks in an empty directory only) NVMe offload is unavailable:
    a warn with the way to enable it, unless --nvme-path asks for NVMe: then a fail."""
    empty = tmp_path / "no-libaio"
    empty.mkdir()
    monkeypatch.setenv(nvme.SEARCH_DIRS_VARIABLE, str(empty))
    problem = nvme.libaio_problem()
    assert problem and "libaio-dev" in problem
    warned, failed = system.check_libaio(problem, nvme_wanted=False), system.check_libaio(problem, nvme_wanted=True)
    assert warned.status == "warn" and "NVMe offload" in warned.detail and "unavailable" in warned.detail
    assert "apt-get install libaio-dev" in warned.fix and "async_io op then builds" in warned.fix
    assert failed.status == "fail" and "NVMe offload fails" in failed.detail
    assert system.check_async_io(problem, nvme_wanted=False).status == "warn"
    assert system.check_async_io(problem, nvme_wanted=True).status == "fail"
    for name in ("libaio.h", "libaio.so"):  # what the probe looks for, there
        (empty / name).write_text("")
    assert nvme.libaio_problem() is None and system.check_libaio(None, nvme_wanted=True).status == "pass"

    env = {nvme.SEARCH_DIRS_VARIABLE: str(tmp_path / "nothing-here"), "ZEROFIT_CACHE_DIR": str(tmp_path / "cache")}
    plain = run_zerofit(["doctor", "--system"], check=False, env=env)
    statuses = _table_statuses(plain.stdout)
    assert statuses["libaio"] == "warn" and statuses["DeepSpeed async_io"] == "warn", plain.stdout
    assert plain.returncode == (1 if "fail" in statuses.values() else 0), plain.stdout
    nvme_run = run_zerofit(["doctor", "--system", "--nvme-path", str(tmp_path / "swap"), "--nvme-mib", "8"],
                           check=False, env=env)
    assert _table_statuses(nvme_run.stdout)["libaio"] == "fail" and nvme_run.returncode == 1, nvme_run.stdout
