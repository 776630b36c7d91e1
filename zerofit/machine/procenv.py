"""What one rank's process runs with, set before DeepSpeed loads its ops: its CPU threads
(torch's pool and the OpenMP loops of DeepSpeed's CPU ops) and the CUDA allocator's settings.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from zerofit.config.schema import Config
from zerofit.machine.hardware import cpu_cores


def node_cores_and_ranks() -> tuple[int, int]:
    """The cores this process may run on (hardware.cpu_cores) and the ranks the launcher
    started on this node."""
    return cpu_cores(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def cpu_threads_per_rank(configured: int | None, cores: int, local_ranks: int, omp_env: str | None,
                         under_torchrun: bool, writer_core: bool = False) -> tuple[int, str | None]:
    """Threads for one rank's CPU work (torch's pool, DeepSpeedCPUAdam's OpenMP loop) and,
    when zerofit overrides the environment, a line saying so. Default: the cores this
    process may run on, shared by the ranks of the node (what steptime.step_time_terms
    assumes). torchrun sets OMP_NUM_THREADS=1 whenever it starts more than one rank
    (torch/distributed/run.py), which leaves the CPU optimizer one core per rank, enough to make
    two GPUs slower than one. An OMP_NUM_THREADS set to anything else is the user's.
    `writer_core` (async saves) leaves one core of the default to the checkpoint writer when
    at least two remain: an OpenMP loop such as CPU-Adam's runs at the pace of its slowest
    thread, so one thread sharing its core with the writer slows the whole optimizer step."""
    share = cores // max(1, local_ranks)
    reserved = 1 if writer_core and share > 2 else 0
    fair_share = max(1, share - reserved)
    if configured:
        return configured, None
    torchrun_default = under_torchrun and local_ranks > 1 and (omp_env or "").strip() == "1"
    if omp_env and omp_env.strip().isdigit() and int(omp_env) > 0 and not torchrun_default:
        return int(omp_env), None
    if not torchrun_default:
        return fair_share, None
    kept = f", {reserved} kept for the checkpoint writer" if reserved else ""
    return fair_share, (f"torchrun set OMP_NUM_THREADS=1 for its {local_ranks} ranks; zerofit gives each rank "
                        f"{fair_share} CPU thread{'s' if fair_share > 1 else ''} ({cores} cores / {local_ranks} ranks"
                        f"{kept}; train.cpu_threads sets it)")


def apply_cpu_threads(config: Config) -> str | None:
    """Set this rank's CPU threads before DeepSpeed loads its ops: OMP_NUM_THREADS is read by
    the OpenMP runtime of DeepSpeed's JIT-built ops (cpu_adam, the CPU accelerator's shm
    comm) when they load, torch.set_num_threads sets torch's own pool."""
    import torch

    cores, local_ranks = node_cores_and_ranks()
    threads, note = cpu_threads_per_rank(config.train.cpu_threads, cores, local_ranks, os.environ.get("OMP_NUM_THREADS"),
                                         "TORCHELASTIC_RUN_ID" in os.environ, config.checkpoint.async_save)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return note


ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def allocator_variables(environ: Mapping[str, str]) -> str:
    """What the allocator variables say, both names' settings (torch reads either)."""
    return ",".join(environ[name] for name in ALLOC_CONF_VARIABLES if environ.get(name))


def allocator_setting(wanted: bool, environ: Mapping[str, str]) -> str | None:
    """The CUDA allocator setting zerofit applies: expandable segments, unless the config
    turns them off or the user's allocator variables already say either way."""
    if not wanted or any("expandable_segments" in environ.get(name, "") for name in ALLOC_CONF_VARIABLES):
        return None
    return EXPANDABLE_SEGMENTS


def use_expandable_segments(config: Config, on_gpu: bool) -> None:
    """Expandable segments for the run (memory.expandable_segments). Why: a large request late
    in the backward (DeepSpeed's fp64 copy of an offloaded gradient partition for its norm,
    stage3.py _constant_buffered_norm2: 1.86 GiB per 250M elements) fails when the cached
    segments are split among activations, although enough of them is free in split pieces.
    Segments that grow in place leave no such pieces."""
    setting = allocator_setting(config.memory.expandable_segments, os.environ)
    if not on_gpu or setting is None:
        return
    import torch

    # PyTorch parsed its variables when CUDA started (a GPU cap may already have allocated);
    # the setting applies to every segment the allocator maps from now on
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(setting)
    user = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = f"{user},{setting}" if user else setting  # the timeline records it
