"""The accelerator a process trains on, chosen before DeepSpeed is imported: CUDA with NCCL
when a GPU is visible, DeepSpeed's CPU accelerator with gloo otherwise (the user never sets
DS_ACCELERATOR); and DeepSpeed kept quiet in the verbs that only read its files."""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys


def select_accelerator() -> bool:
    """True when training runs on CUDA. Must run before `import deepspeed`."""
    import torch

    on_gpu = torch.cuda.is_available()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_gpu else "cpu")
    return os.environ["DS_ACCELERATOR"] == "cuda"


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
