"""What a run reports: metrics.jsonl (and TensorBoard) one line per optimizer step, the
progress line, and the RunResult the loop returns."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from zerofit.core import timeline as memory
from zerofit.core.errors import ConfigError
from zerofit.core.files import open_unlinked, read_jsonl, write_atomic


@dataclass
class RunResult:
    run_dir: Path
    step: int
    train_loss: float | None
    eval_loss: float | None
    resumed_from: str | None
    stopped_by_signal: bool = False
    interrupted: bool = False  # the signal was a first Ctrl-C (exit 130), not SIGTERM (143)


class MetricsLog:
    """metrics.jsonl: one JSON object per optimizer step (rank 0). On resume the lines
    after the checkpoint's step are dropped so the file is one clean curve."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, keep_upto: int):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._file = self._writer = None
        if not enabled:
            return
        # a line torn by a crash (or a full disk) is dropped with the steps after the checkpoint
        kept = [record for record in read_jsonl(self.path) if record.get("step", 0) <= keep_upto] \
            if keep_upto else []
        write_atomic(self.path, "".join(json.dumps(record) + "\n" for record in kept))
        self._file = open_unlinked(self.path, append=True)  # a link planted there is refused
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("log.tensorboard needs the tensorboard package: pip install tensorboard") from None

            # a resume drops the events past the checkpoint's step, as metrics.jsonl drops its lines
            self._writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=keep_upto + 1 if keep_upto else None)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        if self._writer:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._writer.add_scalar(key, value, record["step"])

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        if self._file:
            self._file.close()
        if self._writer:
            self._writer.close()


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def progress_info(record: dict, step_records: list[dict], on_gpu: bool, gpu_budget: int) -> str:
    info = f"loss {record['loss']:.4f} lr {record['lr']:.2e} {record['tokens_per_s']:,.0f} tok/s " \
           f"{memory.budget_summary(step_records, on_gpu, gpu_budget)}"
    return info
