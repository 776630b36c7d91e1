"""A training process's last word, when it dies where Python cannot say so (SIGKILL from the
kernel's OOM killer or a person, a crash in native code): a record for `zerofit doctor`, and
under torchrun its failure counted in the agent store.

`peerwatch.failure_announced` starts this as a small process beside each training process and
holds the write end of a pipe to its stdin. A process that ends by way of Python (a normal
end, an exception it announced itself, the peer watcher's exit) writes DONE first; an end of
the pipe without DONE means it died outright. Then this writes RECORD (where it died: the
time; the doctor puts it beside the rank's last memory record) and, under torchrun with
several ranks, adds one to the failure count the ranks' watchers read (peerwatch.FAILURES_KEY):
a peer on another node leaves at once instead of waiting in a collective.

It ignores SIGTERM and SIGINT: torchrun signals a worker's whole process group
(elastic/multiprocessing/subprocess_handler.py, os.killpg) and this must outlive the worker to
speak. It imports torch and the rest of zerofit only when it has something to say.

    python -m zerofit.recovery.lastword RECORD_PATH RANK   (stdin: the process's pipe)
"""
from __future__ import annotations

import signal
import sys
import time

from zerofit.core.files import write_atomic
from zerofit.recovery.peerwatch import DONE, announce_failure


def main() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    record_path, rank = sys.argv[1], int(sys.argv[2])
    said = sys.stdin.buffer.read()  # until the process's end closes: when it exits, however it exits
    if said == DONE:
        return
    died = time.time()
    import json
    from pathlib import Path


    # the record first: it takes milliseconds, while the announcement waits up to elastic.FAILING_TIMEOUT
    # for a store that is gone when torchrun has already ended (the doctor found no record for 10 s)
    Path(record_path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(record_path), json.dumps({"rank": rank, "time": died}))
    announce_failure()  # then the peers waiting in a collective


if __name__ == "__main__":
    main()
