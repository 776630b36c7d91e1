"""A torchrun worker's last word: its failure counted in torchrun's agent store when it dies
where Python cannot say so (SIGKILL from the kernel's OOM killer or a person, a segfault).

`elastic.failure_announced` starts this as a small process beside each worker of a torchrun
job of several ranks and holds the write end of a pipe to its stdin. A worker that ends by way
of Python (a normal end, an exception it announced itself, the peer watcher's exit) writes
DONE first; an end of the pipe without DONE means the worker died outright, and this adds one
to the failure count the ranks' watchers read (elastic.FAILURES_KEY): a peer on another node
then leaves at torchrun's SIGTERM instead of waiting out the 30 s before its SIGKILL.

It ignores SIGTERM and SIGINT: torchrun signals a worker's whole process group
(elastic/multiprocessing/subprocess_handler.py, os.killpg) and this must outlive the worker to
speak. It imports torch and the rest of zerofit only when it has something to say.

    python -m zerofit.lastword   (stdin: the worker's pipe; torchrun's environment)
"""
from __future__ import annotations

import signal
import sys

DONE = b"done"


def main() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    said = sys.stdin.buffer.read()  # until the worker's end closes: when it exits, however it exits
    if said != DONE:
        from zerofit.elastic import announce_failure

        announce_failure()


if __name__ == "__main__":
    main()
