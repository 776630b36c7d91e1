"""The processes of a run: the accelerator, the process group, the ranks of one machine, and
how a rank's process ends.

The accelerator is chosen here, before DeepSpeed is imported: CUDA with NCCL when a GPU
is visible, DeepSpeed's CPU accelerator with gloo otherwise (the user never sets
DS_ACCELERATOR). Without a launcher, one process sets RANK/WORLD_SIZE/MASTER_* itself.
"""
from __future__ import annotations

import contextlib
import io
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta

from zerofit.machine import opbuild
from zerofit.machine.accelerator import select_accelerator
from zerofit.recovery import elastic


@dataclass(frozen=True)
class Dist:
    """This process's place in the run: its global and local rank, the ranks in all, and
    whether it trains on CUDA (init_distributed's choice of accelerator)."""
    rank: int
    local_rank: int
    world_size: int
    on_gpu: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0



def init_distributed() -> Dist:
    """Join the launcher's process group (torchrun, deepspeed), or form a group of one."""
    on_gpu = select_accelerator()
    # DeepSpeed still calls collectives torch deprecated; the user can do nothing about it.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    # ... and barriers on a group it formed without device_id; the device is set before either
    warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context",
                            category=UserWarning)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    import deepspeed
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if on_gpu:
        torch.cuda.set_device(local_rank)
    if not torch.distributed.is_initialized():
        backend = "nccl" if on_gpu else "gloo"
        store = elastic.process_group_store()
        if store is not None:  # under torchrun: keys of this attempt's own; DeepSpeed adopts the group
            device = {"device_id": torch.device("cuda", local_rank)} if on_gpu else {}  # as DeepSpeed's own init
            torch.distributed.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                                 world_size=int(os.environ["WORLD_SIZE"]), **device)
        # the CPU accelerator builds its shm comm op here, and prints that it did on every start
        with opbuild.ops_unblocked(() if on_gpu else ("deepspeed_shm_comm",)), \
                contextlib.redirect_stdout(io.StringIO()):
            deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return Dist(int(os.environ["RANK"]), local_rank, int(os.environ["WORLD_SIZE"]), on_gpu)


# one rank of a machine may tokenize a large corpus for hours while the others wait for it
MACHINE_WAIT = timedelta(days=1)
MACHINE_POLL_S = 0.2


def machine_node(dist: Dist):
    """This machine's ranks as datacache.Node (one tokenizes, the others read what it kept),
    or None with one rank per machine. A gloo group per machine, of LOCAL_WORLD_SIZE
    consecutive ranks (torchrun and DeepSpeed's launcher number a machine's ranks so; where a
    launcher does not, the ranks still agree, and a rank that finds no rows kept tokenizes
    them itself). Its barrier is polled: a rank waiting in a blocking one runs no Python
    handler, and a launcher stopping the ranks after the first one failed would wait out its
    30 s before SIGKILL (see elastic's docstring)."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if dist.world_size < 2 or local_ranks < 2 or dist.world_size % local_ranks:
        return None
    import torch.distributed as td

    from zerofit.data.cache import Node  # tokenizers and datasets: the CLI starts without them
    from zerofit.data.files import DataError

    group, _ = td.new_subgroups(group_size=local_ranks, backend="gloo", timeout=MACHINE_WAIT)

    def wait() -> None:
        try:
            work = td.barrier(group=group, async_op=True)
            while not work.is_completed():
                time.sleep(MACHINE_POLL_S)
            work.wait()  # raises what the barrier met
        except RuntimeError:  # a peer's connection closed: the error is its to say
            raise DataError("a rank of this machine stopped while the data was read; its own error says "
                            "why") from None

    return Node(first=td.get_rank(group) == 0, ranks=local_ranks, wait=wait)


def finish_distributed(code: int) -> None:
    """End the process of a run that completed on every rank (not after an error: another
    rank may still be inside a collective, pytorch/torchtitan#1342). The process group is
    destroyed; then a process that a launcher started as one of several ranks ends here with
    `code`, skipping the interpreter's teardown: even after destroy_process_group a 2-rank
    CPU run (gloo) can abort at exit after its last line ("terminate called without an
    active exception", SIGABRT: a thread of the torch/gloo runtime still joinable when static
    objects are destroyed, pytorch/pytorch#190489): 3 of ~21 two-rank runs on a 2-core
    machine beside other work (tests and a stress loop of the tiny 2-rank run), none of 40
    since. Everything a run writes is closed before this (the checkpointer drained, metrics
    and timeline closed); only stdout and stderr are left to flush."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def end_after_error(code: int) -> int:
    """The exit `code` of a train that stopped on an error it explained; a process that joined
    a process group ends here, skipping the interpreter's teardown. That teardown can abort
    after the error's last line, as after a completed run (finish_distributed): a single-rank
    resume refused under a changed seed, after its DeepSpeed engine was built, exited -6
    ("terminate called without an active exception") instead of 1 in one CI run of ~440
    tests. The group is not destroyed: another rank may still be inside a collective. Every
    file a run writes is line-buffered or closed as the error unwinds (metrics, timeline, the
    last word), so only stdout and stderr are left to flush."""
    torch_distributed = sys.modules.get("torch.distributed")  # not imported: no group to leave
    if torch_distributed is None or not torch_distributed.is_available() or not torch_distributed.is_initialized():
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    """A TCP port free on this host now (for a process group's or a launcher's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
