"""NVMe offload (ZeRO-Infinity) that either works or says why before it starts.

DeepSpeed's optimizer swapper writes with O_DIRECT through libaio and never checks a
write's result (swaplayout.py explains the rules it follows): a full disk, a path whose
direct-I/O block does not divide a transfer, or any I/O error leaves a swap file short,
and the next read aborts the process with "file_offset + buffer nbytes > file bytes".
So, on the run's side:
- `resolve_aio`: the aio settings (the path's cached sweep, else DeepSpeed's defaults),
  adjusted so every transfer is whole direct-I/O blocks of the path;
- `preflight`: async_io buildable (libaio), the path writable with O_DIRECT, free space
  for the predicted swap files, the pinned-memory limit for the swapper's buffers;
- `SwapGuard`: after every step, each swap file must have the bytes DeepSpeed wrote;
  otherwise stop before DeepSpeed reads it back (the previous checkpoint stays whole);
- `restore_optimizer_state`: an exact resume (DeepSpeed 0.19.8's load_checkpoint copies
  the swap files back but skips the optimizer file, which holds the step counts, the
  sub groups kept in RAM, and the list of swapped moments).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from dataclasses import fields
from pathlib import Path

from zerofit.checkpoint import zerofiles
from zerofit.config.schema import Config
from zerofit.core import faults
from zerofit.core.console import warn
from zerofit.core.errors import ConfigError
from zerofit.core.files import write_atomic
from zerofit.core.timeline import human_bytes
from zerofit.machine import hardware
from zerofit.nvme import aiotune, swaplayout
from zerofit.nvme.swaplayout import Aio, aligned_aio, transfer_problems

LIBAIO_FIX = ("install libaio's headers: `apt-get install libaio-dev` (Debian/Ubuntu) or `yum install "
              "libaio-devel` (RHEL/Fedora); in a conda env `conda install -c conda-forge libaio` and "
              "`export CFLAGS=-I$CONDA_PREFIX/include LDFLAGS=-L$CONDA_PREFIX/lib` before the run "
              "(DeepSpeed's build reads them); `ds_report` shows what DeepSpeed sees")
# Where a compiler finds libaio.h and the linker libaio.so when nothing says otherwise (gcc's
# default search dirs on Debian/Ubuntu and RHEL); ZEROFIT_AIO_SEARCH_DIRS (colon-separated)
# replaces them, for a libaio installed elsewhere.
SEARCH_DIRS_VARIABLE = "ZEROFIT_AIO_SEARCH_DIRS"
SYSTEM_AIO_DIRS = ("/usr/include", "/usr/local/include", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                   "/usr/lib64", "/usr/lib", "/usr/local/lib", "/lib/x86_64-linux-gnu", "/lib64")
FREE_SPACE_FACTOR = 1.10   # filesystem metadata and gradient fragments beyond the planned bytes


class NvmeError(ConfigError):
    """NVMe offload cannot work as configured; the message has the numbers and the fix."""


def uses_nvme(config: Config) -> bool:
    return "nvme" in (config.zero.offload_optimizer, config.zero.offload_param)


def swap_root(config: Config) -> str:
    """Where this run's swap files go: a folder of its own under zero.nvme_path, so two runs
    sharing a disk never read each other's files (DeepSpeed's names repeat across runs)."""
    key = hashlib.sha256(str(Path(config.run_dir).resolve()).encode()).hexdigest()[:10]
    return str(Path(config.zero.nvme_path) / f"zerofit-{key}")


def clear_swap(config: Config, local_rank: int) -> None:
    """Swap files of an earlier process are stale (a resume copies the checkpoint's back):
    removed by each node's first rank before the engine is built."""
    if uses_nvme(config) and local_rank == 0:
        shutil.rmtree(swap_root(config), ignore_errors=True)


def remove_rank_swap(config: Config, rank: int) -> None:
    """At the end of a run: this rank's swap files (optimizer and parameters) are worth
    nothing once the process ends (the checkpoint holds its own copy, a resume copies it
    back) and can be most of the disk: removed, each rank its own folders."""
    if uses_nvme(config):
        root = Path(swap_root(config))
        for folder in root.glob(f"zero_stage_*/*/rank{rank}"):
            shutil.rmtree(folder, ignore_errors=True)
        # the folders above them once the last rank's are gone (another rank's still there: kept).
        # Ranks prune at once: os.walk skips a folder another rank removed under it.
        for folder, _, _ in os.walk(root, topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(folder)


# --------------------------------------------------------------------- aio settings
AIO_KEYS = [f.name for f in fields(Aio)]


def resolve_aio(config: Config, spec, world_size: int) -> tuple[Config, list[str], list[str]]:
    """(config with every zero.aio_* set, notes, problems). Unset fields come from the
    sweep cached for the path, else DeepSpeed's defaults; unset fields are then adjusted
    so every optimizer transfer is whole direct-I/O blocks (swaplayout.aligned_aio). A
    problem that remains, or one a user-set field causes, is returned for preflight."""
    zero = config.zero
    if not zero.nvme_path:
        return config, [], []
    tuned = aiotune.read_tuning(zero.nvme_path) or {}
    chosen = {k: getattr(zero, f"aio_{k}") for k in AIO_KEYS if getattr(zero, f"aio_{k}") is not None}
    aio = Aio(**{**Aio().to_json(), **tuned.get("aio", {}), **chosen})
    notes = [f"aio settings from the sweep cached in {aiotune.cache_path(zero.nvme_path)}"] if tuned else []
    problems: list[str] = []
    dio = tuned.get("dio_alignment") or _dio_alignment(Path(zero.nvme_path))
    if dio and optimizer_may_swap(config):
        groups = swaplayout.sub_group_members(spec, world_size, zero.sub_group_size)
        fixed, changes = aligned_aio(groups, aio, dio)
        user_changed = [k for k in chosen if getattr(fixed, k) != chosen[k]]
        remaining = transfer_problems(groups, fixed, dio)
        if user_changed or remaining:
            why = remaining or transfer_problems(groups, aio, dio)
            problems.append(f"{zero.nvme_path} takes direct I/O in {dio}-byte blocks, and DeepSpeed would write "
                            f"pieces that are not whole blocks ({'; '.join(why[:3])}); such a write fails "
                            f"silently and the next read aborts with 'file_offset + buffer nbytes > file bytes'. "
                            + (f"Fix: unset zero.aio_{', zero.aio_'.join(user_changed)} (zerofit picks "
                               f"{', '.join(f'{k}={getattr(fixed, k)}' for k in user_changed)})" if user_changed and
                               not remaining else "Fix: put zero.nvme_path on a filesystem with 512-byte blocks "
                               "(`blockdev --getss DEVICE` says 512), or change zero.sub_group_size"))
        else:
            aio = fixed
            notes += changes
    zero = zero.model_copy(update={f"aio_{k}": v for k, v in aio.to_json().items()})
    return config.model_copy(update={"zero": zero}), notes, problems


def optimizer_may_swap(config: Config) -> bool:
    """The optimizer's states may go to NVMe: set so, or left to the planner, which chooses
    NVMe where the host cannot hold them (choice.candidates, stage 3 only)."""
    zero = config.zero
    return zero.offload_optimizer == "nvme" or ("offload_optimizer" not in zero.model_fields_set and zero.stage == 3)


def aio_of(config: Config) -> Aio:
    """The resolved aio settings of a config (DeepSpeed's defaults for unset fields)."""
    zero = config.zero
    return Aio(**{k: getattr(zero, f"aio_{k}") for k in AIO_KEYS if getattr(zero, f"aio_{k}") is not None})


def _dio_alignment(path: Path) -> int | None:
    """The path's direct-I/O block when it can be probed here (None: not there yet)."""
    try:
        return aiotune.probe_dio_alignment(path) if path.is_dir() else None
    except OSError:
        return None


# ------------------------------------------------------------------------ preflight
def preflight(config: Config, plan, on_gpu: bool, problems: list[str] = ()) -> str | None:
    """Everything that would make NVMe offload fail once training runs, checked now:
    None when it can work, else the reasons with numbers and fixes (one per line)."""
    if not uses_nvme(config):
        return None
    found = list(problems)
    path = Path(config.zero.nvme_path)
    found += filter(None, [path_problem(path), libaio_problem() or async_io_problem(on_gpu)])
    if kind := ram_filesystem(path):
        warn(f"zero.nvme_path {path} is on {kind}, which lives in host RAM: {RAM_BACKED_FIX} (fine for a test)")
    nvme = plan.devices.get("nvme")
    if nvme is not None and path.is_dir():
        full = 0 if faults.armed("nospace", "nvme", 1) else None  # the drill: a full disk
        found += filter(None, [space_problem(path, nvme.total_bytes, full)])
    locked = sum(v for k, v in plan.devices["host"].components.items() if k.endswith("_locked"))
    found += filter(None, [memlock_problem(locked)])
    return "\n".join(f"NVMe offload: {p}" for p in found) or None


RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def ram_filesystem(path: Path) -> str | None:
    """The filesystem type when `path` lies on one held in RAM (tmpfs, ramfs), from
    /proc/mounts (the longest mount point that holds it); None otherwise or unknown."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    resolved = str(Path(path).resolve())
    holding = [(point, kind) for point, kind in mounts
               if resolved == point or resolved.startswith(point.rstrip("/") + "/")]
    kind = max(holding, key=lambda m: len(m[0]))[1] if holding else None
    return kind if kind in RAM_FILESYSTEMS else None


RAM_BACKED_FIX = ("the swap files take the RAM that NVMe offload is meant to free; use a directory on a local "
                  "NVMe drive")


def make_swap_dir(path: Path) -> None:
    """Create zero.nvme_path's directory itself, not its parents: a path whose parent does not
    exist is most likely a typo (/nvme/zerofti), and `mkdir -p` would put the swap files, and
    the disk measured for them, on whatever disk holds the nearest existing parent (often /)."""
    if not path.is_dir() and not path.parent.exists():
        raise OSError(errno.ENOENT, f"{path.parent} does not exist (a typo? the swap directory is created, its parents "
                                    f"are not: create them first if this is the path meant)")
    path.mkdir(exist_ok=True)


def mount_point(path: Path) -> Path:
    """The mount the path's files land on (what a free-space figure and a bandwidth are of)."""
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def path_problem(path: Path) -> str | None:
    if path.exists() and not path.is_dir():
        return f"zero.nvme_path={path} is a file, not a directory; name a directory for DeepSpeed's swap files"
    try:
        make_swap_dir(path)
        aiotune.probe_dio_alignment(path)
    except OSError as e:
        return (f"zero.nvme_path={path} is not usable: {e.strerror or e}; DeepSpeed opens its swap files with "
                f"O_DIRECT: use a writable directory on a local ext4/xfs disk (not tmpfs, NFS or overlay)")
    return None


def space_problem(path: Path, needed_bytes: int, free_bytes: int | None = None) -> str | None:
    free = shutil.disk_usage(path).free if free_bytes is None else free_bytes
    want = int(needed_bytes * FREE_SPACE_FACTOR)
    if free >= want:
        return None
    return (f"{human_bytes(free)} free under {path}, the swap files need {human_bytes(needed_bytes)} "
            f"(+{FREE_SPACE_FACTOR - 1:.0%}); a full disk makes DeepSpeed's writes fail silently and the run abort later. Free "
            f"{human_bytes(want - free)}, pick another zero.nvme_path, or offload less (zero.offload_param)")


def memlock_problem(locked_bytes: int) -> str | None:
    """DeepSpeed's swap buffers are mlock'ed: over RLIMIT_MEMLOCK (without CAP_IPC_LOCK)
    its allocation fails ("mlock failed to allocate") and the process aborts."""
    limit = hardware.memlock_limit()
    if not locked_bytes or limit is None or limit >= locked_bytes:
        return None
    return (f"the swap buffers lock {human_bytes(locked_bytes)} of RAM, `ulimit -l` allows {human_bytes(limit)}: "
            f"raise it (`ulimit -l unlimited`, `* - memlock unlimited` in /etc/security/limits.conf, or "
            f"`docker run --ulimit memlock=-1`)")


def aio_search_dirs() -> list[Path]:
    """The dirs DeepSpeed's JIT build of async_io looks in for libaio: the system's (or
    ZEROFIT_AIO_SEARCH_DIRS), CFLAGS -I / LDFLAGS -L (DeepSpeed passes them on, builder.py
    has_function), CPATH, LIBRARY_PATH and an active conda env."""
    override = os.environ.get(SEARCH_DIRS_VARIABLE)
    dirs = [d for d in override.split(":") if d] if override is not None else list(SYSTEM_AIO_DIRS)
    for flag, variable in (("-I", "CFLAGS"), ("-L", "LDFLAGS")):
        dirs += [t[2:] for t in os.environ.get(variable, "").split() if t.startswith(flag) and len(t) > 2]
    for variable in ("CPATH", "C_INCLUDE_PATH", "LIBRARY_PATH"):
        dirs += [d for d in os.environ.get(variable, "").split(":") if d]
    if os.environ.get("CONDA_PREFIX"):
        dirs += [f"{os.environ['CONDA_PREFIX']}/include", f"{os.environ['CONDA_PREFIX']}/lib"]
    return [Path(d) for d in dirs]


def libaio_problem() -> str | None:
    """DeepSpeed loads async_io through its JIT builder, which first compiles and links a
    test program against libaio (op_builder/async_io.py is_compatible: `has_function(
    'io_submit', ('aio',))`) on every run: libaio.h and libaio.so (libaio-dev) must be there,
    the runtime libaio.so.1 alone is not enough. Skipped when async_io was prebuilt into
    the DeepSpeed install (DS_BUILD_AIO=1)."""
    try:
        from deepspeed.git_version_info import installed_ops

        if installed_ops.get("async_io", False):
            return None
    except ImportError:
        pass
    dirs = aio_search_dirs()
    missing = [name for name in ("libaio.h", "libaio.so") if not any((d / name).is_file() for d in dirs)]
    if not missing:
        return None
    return (f"DeepSpeed's async_io op cannot be built: {' and '.join(missing)} not found in "
            f"{', '.join(map(str, dirs[:4]))}{', ...' if len(dirs) > 4 else ''} (libaio-dev is missing). "
            f"Fix: {LIBAIO_FIX}")


def async_io_problem(on_gpu: bool) -> str | None:
    """Can DeepSpeed build (or load its cached build of) the async_io op here? Building it
    now turns a build failure into a clear error before the model is loaded."""
    if on_gpu:
        fix_arch_list()
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            return f"DeepSpeed's async_io op cannot be built: libaio was not found. Fix: {LIBAIO_FIX}"
        aiotune.load_aio_op()
    except Exception as e:  # noqa: BLE001 - any build failure is reported with its text
        return f"DeepSpeed's async_io op failed to build: {type(e).__name__}: {str(e)[:300]}. Fix: {LIBAIO_FIX}"
    return None


def fix_arch_list() -> str | None:
    """DeepSpeed's CUDA op builder reads TORCH_CUDA_ARCH_LIST as major.minor[+PTX]
    (op_builder/builder.py compute_capability_args: `int(part)`), so an arch-specific entry
    such as 9.0a fails with "invalid literal for int() with base 10: '0a'" (what the GPU
    machine's async_io build met; with TORCH_CUDA_ARCH_LIST=9.0 set it built). Unset or
    holding such entries, it is set, for this process, to the visible GPUs' compute
    capabilities (what DeepSpeed's JIT build probes anyway); returns the new value when
    it changed it."""
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    tokens = arch.replace(" ", ";").split(";")
    if arch and all(re.fullmatch(r"\d+\.\d+(\+PTX)?", t) for t in tokens if t):
        return None
    import torch

    ccs = sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    if not ccs:
        return None
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(ccs)
    return os.environ["TORCH_CUDA_ARCH_LIST"]


# ------------------------------------------------------------------- during the run
class SwapGuard:
    """After each step: every optimizer swap file holds what DeepSpeed wrote into it. A
    short one means a write failed (DeepSpeed does not notice): stop now, before the next
    step reads it and aborts, and before a checkpoint copies it."""

    def __init__(self, ds_engine):
        optimizer = getattr(ds_engine, "optimizer", None)
        self.swapper = getattr(optimizer, "optimizer_swapper", None)
        self.expected: dict[str, int] = {}
        if self.swapper is None:
            return
        for i, flat in enumerate(optimizer.fp32_partitioned_groups_flat):
            if optimizer._swappable_optimizer_subgroup(i):
                self.expected[flat.ds_id] = self._bytes(optimizer.fp16_partitioned_groups_flat_numel[i])

    def _bytes(self, numel: int) -> int:
        return int(self.swapper._io_aligned_numel(int(numel))) * self.swapper.swap_element_size

    def expected_bytes(self, name: str) -> int | None:
        """What DeepSpeed writes into a file of this name (optimizer_utils.py names them)."""
        gradient = re.fullmatch(r"(.+)_gradient_(\d+)_(\d+)\.tensor\.swp", name)
        if gradient:
            return self._bytes(int(gradient.group(3)))
        state = re.fullmatch(r"(?:exp_avg-|exp_avg_sq-)?(.+)\.tensor\.swp", name)
        return self.expected.get(state.group(1)) if state else None

    def problem(self) -> str | None:
        if self.swapper is None:
            return None
        folder = Path(self.swapper.swap_folder)
        for path in sorted(folder.glob("*.tensor.swp")):
            want, have = self.expected_bytes(path.name), path.stat().st_size
            if want is not None and have < want:
                free = shutil.disk_usage(folder).free
                return (f"NVMe swap file {path} has {have:,} bytes, DeepSpeed wrote {want:,}: a write failed "
                        f"({human_bytes(free)} free there; DeepSpeed's async I/O does not report a full disk or "
                        f"an I/O error) and that optimizer state is lost. Stopped before DeepSpeed reads it back; "
                        f"free space on {folder.parents[3]} and resume from the newest checkpoint")
        return None

    def check(self) -> None:
        problem = self.problem()
        if problem:
            raise NvmeError(problem)


def restore_optimizer_state(ds_engine, load_dir: Path) -> None:
    """Finish DeepSpeed's resume of an NVMe-offloaded optimizer with DeepSpeed's own loader.

    engine.load_checkpoint copies `offloaded_tensors/` back into the swap folder and
    rebuilds the 16-bit weights from it, but skips `_load_zero_checkpoint` for NVMe, so
    the optimizer file never loads: Adam's step counts restart, the sub groups kept in RAM
    keep their fresh values, and the swapper forgets the moments' files (a moment is swapped
    only while optimizer.state holds a tensor of its size). Here the optimizer file is read
    through DeepSpeed (`_get_all_zero_checkpoints`), each swapped moment (saved as an empty
    tensor) is given a size-only placeholder (one element, expanded) so the swapper reads it
    back from its file, and stage3's `load_state_dict` restores the rest as for CPU offload."""
    import torch
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    optimizer = ds_engine.optimizer
    state_dicts = ds_engine._get_all_zero_checkpoints(str(load_dir.parent), load_dir.name)
    if state_dicts is None:
        raise NvmeError(f"{load_dir} has no optimizer files; it cannot resume an NVMe-offloaded optimizer")
    # state_dict() lists the fp32 sub groups param group by param group (_set_fp32_optimizer_param_groups)
    order = [i for group in range(len(optimizer.optimizer.param_groups)) for i in range(len(optimizer.fp16_groups))
             if optimizer.sub_group_to_group_id[i] == group]
    for state_dict in state_dicts:
        if state_dict is None:
            continue  # another rank's file: DeepSpeed loads only this rank's, and stage3 reads that one alone
        saved = state_dict[OPTIMIZER_STATE_DICT]["state"]
        for index, sub_group in enumerate(order):
            if index not in saved or not optimizer._swappable_optimizer_subgroup(sub_group):
                continue
            numel = int(optimizer.fp16_partitioned_groups_flat_numel[sub_group])
            for key, value in saved[index].items():
                if torch.is_tensor(value) and value.numel() == 0:
                    saved[index][key] = torch.zeros(1, dtype=value.dtype).expand(numel)
    optimizer.checkpoint_event_prologue()
    with views_released_before_the_copy(optimizer):
        optimizer.load_state_dict(state_dicts, load_optimizer_states=True,
                                  load_from_fp32_weights=ds_engine.zero_load_from_fp32_weights(),
                                  param_shapes=ds_engine._get_zero_param_shapes())
    optimizer.checkpoint_event_epilogue()


def record_sub_groups(optimizer, rank_dir: Path) -> None:
    """zerofiles.SUB_GROUPS_FILE for this rank: per sub group (the optim file's fp32_flat_groups order),
    its elements and the swap file holding its fp32 masters (None: kept in RAM, saved in the
    optim file)."""
    groups = [{"numel": int(optimizer.fp16_partitioned_groups_flat_numel[i]),
               "file": f"{flat.ds_id}.tensor.swp" if optimizer._swappable_optimizer_subgroup(i) else None}
              for i, flat in enumerate(optimizer.fp32_partitioned_groups_flat)]
    write_atomic(rank_dir / zerofiles.SUB_GROUPS_FILE, json.dumps({"sub_groups": groups}, indent=1))


def pipelined(swapper) -> bool:
    """DeepSpeed's PipelinedOptimizerSwapper with its writes overlapped (zero.nvme_pipeline)."""
    return swapper is not None and getattr(swapper, "async_swap_out", False)


def release_swapped_views(swapper) -> None:
    """Empty the swapped sub groups' fp32 master and moment tensors between steps, as
    DeepSpeed's one-at-a-time swapper does after every swap out (`release_swap_buffers`).

    DeepSpeed 0.19.8's PipelinedOptimizerSwapper (zero.nvme_pipeline) returns a written sub
    group's pinned buffers to its pool but leaves those tensors viewing them
    (`_complete_swap_out` assigns `torch.Tensor()` to its loop variable). A checkpoint's
    optimizer file then saves whatever the pool holds by then as that sub group's master
    weights and moments, and a resume copies it over the model: measured, a resumed run's
    loss 7.01 where the uninterrupted one had 6.09 at the first step after it (hidden 256,
    five swapped sub groups). Nothing is in flight between steps: the step's last sub group
    swaps out synchronously after waiting for the one before it."""
    if not pipelined(swapper):
        return
    for info in swapper.swap_params_info.values():
        info.release_memory()


@contextlib.contextmanager
def views_released_before_the_copy(optimizer):
    """stage3 `_rigid_load_state_dict` walks every sub group through the swapper (swap in,
    swap out, then `_post_step`) and only then copies the saved fp32 partitions over the live
    ones, skipping a swapped sub group because its live partition is empty. The pipelined
    swapper leaves it viewing a pool buffer (release_swapped_views), so the copy fails on the
    size (524,288 vs 0). Released at that `_post_step`, the load is the one-at-a-time
    swapper's, and resumes bit for bit (tests/test_nvme.py)."""
    swapper = optimizer.optimizer_swapper
    if not pipelined(swapper):
        yield
        return
    post_step = optimizer._post_step

    def post_step_then_release(timer_names):
        post_step(timer_names)
        release_swapped_views(swapper)

    optimizer._post_step = post_step_then_release
    try:
        yield
    finally:
        del optimizer._post_step  # the class's method again
