"""The accelerator a process trains on, chosen before DeepSpeed is imported: CUDA with NCCL
when a GPU is visible, DeepSpeed's CPU accelerator with gloo otherwise (the user never sets
DS_ACCELERATOR); and DeepSpeed kept quiet in the verbs that only read its files."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import sys
from pathlib import Path

from zerofit.core.files import write_atomic
from zerofit.machine.hardware import cache_root

# /proc/cpuinfo's lines that say what the CPU is (not its clock of the moment)
CPU_IDENTITY = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")


def select_accelerator() -> bool:
    """True when training runs on CUDA. Must run before `import deepspeed`."""
    import torch

    remember_cpu_info()
    on_gpu = torch.cuda.is_available()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_gpu else "cpu")
    return os.environ["DS_ACCELERATOR"] == "cuda"


def remember_cpu_info() -> None:
    """py-cpuinfo's get_cpu_info runs `python cpuinfo.py --json` in a subprocess (about a second)
    and DeepSpeed asks it at every start, three times (op_builder's cpu_arch and simd_width,
    cpu_adam): answered once per CPU, kept as JSON in zerofit's cache, and once per process."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then falls back to lscpu itself
        return
    if getattr(cpuinfo.get_cpu_info, "remembered", False):
        return
    probe = cpuinfo.get_cpu_info

    @functools.cache
    def get_cpu_info() -> dict:
        path = cpu_info_path(getattr(cpuinfo, "CPUINFO_VERSION_STRING", ""))
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # never asked on this CPU, or a damaged file: asked again
            info = probe()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(info))
        except OSError:  # a read-only home: asked again next time
            pass
        return info

    get_cpu_info.remembered = True
    cpuinfo.get_cpu_info = get_cpu_info


def cpu_info_path(version: str) -> Path:
    """The cache file of this CPU: named by what /proc/cpuinfo says it is and py-cpuinfo's version."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    identity = sorted({line for line in lines if line.split(":")[0].strip() in CPU_IDENTITY})
    key = hashlib.sha256("\n".join([version, str(os.cpu_count()), *identity]).encode()).hexdigest()[:16]
    return cache_root() / f"cpuinfo-{key}.json"


def only_errors(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


@contextlib.contextmanager
def deepspeed_quietly():
    """Around the DeepSpeed imports and reads of the verbs that only read its files (export):
    DeepSpeed says "Setting accelerator to CPU", its op builders print "[WARNING] async_io
    requires the dev libaio", zero_to_fp32 prints progress, none of it the user's to act on.
    The accelerator is chosen first, DeepSpeed's logger keeps only errors from now on, and
    what is printed inside the block is dropped unless the block fails: then it goes to stderr
    ahead of the error."""
    select_accelerator()
    deepspeed_logger = logging.getLogger("DeepSpeed")  # deepspeed/utils/logging.py's
    if only_errors not in deepspeed_logger.filters:
        deepspeed_logger.addFilter(only_errors)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            yield
    except BaseException:
        sys.stderr.write(said.getvalue())
        raise
    finally:  # a logger DeepSpeed made inside the block writes to stdout, not to `said`, after it
        for handler in deepspeed_logger.handlers:
            if getattr(handler, "stream", None) is said:
                handler.setStream(sys.stdout)
