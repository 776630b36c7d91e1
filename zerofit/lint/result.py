"""What `zerofit lint` finds and returns (Finding, LintResult), and the helpers its checks share."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from zerofit.config.schema import TrainConfig

# DeepSpeed's own defaults where a key is absent (runtime/zero/config.py).
DS_DEFAULT_SUB_GROUP_SIZE = 1_000_000_000


@dataclass
class Finding:
    level: str          # "error" or "warning"
    key: str
    message: str
    fix: str = ""


@dataclass
class LintResult:
    path: str
    findings: list[Finding] = field(default_factory=list)
    plan: dict | None = None            # plan JSON when a model was given

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    def to_json(self) -> dict:
        return {"path": self.path, "ok": not self.errors, "findings": [asdict(f) for f in self.findings],
                "plan": self.plan}


class TrainerArgs(NamedTuple):
    """What HF Trainer / LLaMA-Factory set beside the DeepSpeed JSON, which the plan needs:
    the sequence length, --per_device_train_batch_size (else the JSON's, else 1),
    --gradient_checkpointing, and a peft LoRA's rank and target modules (None: full fine-tuning)."""
    seq_len: int = TrainConfig.model_fields["seq_len"].default
    micro_batch: int | None = None
    gradient_checkpointing: bool = True
    lora_rank: int | None = None
    lora_targets: list[str] | None = None


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parses_as_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return isinstance(value, str)
