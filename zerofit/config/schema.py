"""The one typed config: every knob zerofit has, documented where it is declared.

It is the single source of truth: `--help` of `zerofit train`, the example YAML
(`zerofit config --example`) and the DeepSpeed dict (dsconfig.build) are all generated
from these classes. Unknown keys are errors naming the nearest valid key; bad values
name the field, the value and what is allowed. The sections' shared base is section.py's; the
data section, with the column tables its rows are read by, is dataconfig.py's.

Fields the user did not set are free for the planner to choose (pydantic's
`model_fields_set` tells them apart); fields the user set are constraints it keeps.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from zerofit.config.data import DataConfig
from zerofit.config.section import Section
from zerofit.core.errors import ConfigError
from zerofit.core.timeline import parse_bytes

OffloadDevice = Literal["none", "cpu", "nvme"]
Precision = Literal["bf16", "fp16", "fp32"]


class ModelConfig(Section):
    path: str | None = None
    """Local Hugging Face model directory (config.json + weights + tokenizer), loaded
    with from_pretrained under ZeRO-3 partitioned init. Exclusive with `config`."""
    config: str | None = None
    """Random init instead of weights: a config.json file, a directory holding one, or a
    preset name (`zerofit plan --presets` lists them). Exclusive with `path`."""
    tokenizer: str | None = None
    """Tokenizer directory. Default: `path`; for the `demo` preset the bundled demo tokenizer."""
    chat_template: str | None = None
    """A Jinja chat template file (.jinja) to render conversations and alpaca rows with, instead of
    the tokenizer's own or where it has none: a base model trained on chat data, or the template
    LLaMA-Factory's `template:` wrote. Or a bundled template's name, LLaMA-Factory's template of that
    name (system, user and assistant turns, tool calls and their answers): alpaca, chatml, default,
    empty, gemma, llama2, llama3, mistral, phi, qwen, qwen3_nothink, vicuna. The run's tokenizer, and
    so the export, carry it."""
    gradient_checkpointing: bool = True
    """Recompute activations in backward (HF gradient_checkpointing_enable, non-reentrant)."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel passed to transformers. eager keeps per layer and head a sequence x sequence
    matrix for the backward (the planner counts it); for models without SDPA (Gemma-2)."""
    trust_remote_code: bool = False
    """Allow custom modelling code shipped inside a local model directory."""

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if self.path and self.config:
            raise ValueError("set either model.path (weights) or model.config (random init), not both")
        if not self.path and not self.config:
            raise ValueError("set model.path (a local HF model directory) or model.config "
                             "(a config.json or a preset name such as 'demo')")
        return self



class LoraConfig(Section):
    """Low-rank adapters (Hu et al. 2021, arXiv:2106.09685) trained with peft on the frozen,
    ZeRO-3-partitioned base: only the adapters get gradients and optimizer state, and
    checkpoints hold only them (the base is rebuilt from model.path / model.config + seed)."""
    enabled: bool = False
    """Train LoRA adapters instead of every weight (needs `pip install zerofit[lora]`, i.e. peft)."""
    r: int = Field(16, ge=1)
    """Rank of each adapter: A is r x in_features, B is out_features x r."""
    alpha: int = Field(32, ge=1)
    """Scale numerator: the adapter's output is multiplied by alpha / r."""
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    """Dropout on the adapter's input (training only)."""
    target_modules: list[str] | None = None
    """Modules that get adapters. A plain name (`q_proj`) matches every module whose name
    ends with it, as in peft; a pattern with * ? [ ] (`model.layers.1*.mlp.*_proj`) is
    matched against the full module name; `all` (LLaMA-Factory) or `all-linear` (peft) is every
    Linear layer but the output head. Default per architecture: Llama, Mistral, Qwen2,
    Qwen3, Gemma q,k,v,o,gate,up,down projections; GPT-NeoX query_key_value, dense,
    dense_h_to_4h, dense_4h_to_h; Phi-3 qkv_proj, o_proj, gate_up_proj, down_proj; any
    other model every nn.Linear except the output head (lm_head)."""
    modules_to_save: list[str] = []
    """Modules trained fully and saved with the adapter (e.g. `lm_head`, `embed_tokens` after
    adding tokens); each carries full Adam state, so they cost like full fine-tuning."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Which biases train: none; all biases of the model; only those of adapted modules."""

    @field_validator("target_modules", "modules_to_save", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """`--set lora.target_modules=q_proj,v_proj`: a comma-separated string is the list."""
        return [name.strip() for name in value.split(",") if name.strip()] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _names(self) -> "LoraConfig":
        if self.target_modules is not None and not [t for t in self.target_modules if t.strip()]:
            raise ValueError("lora.target_modules is empty; leave it unset for the architecture's default "
                             "or list module names such as [q_proj, v_proj]")
        both = set(self.target_modules or ()) & set(self.modules_to_save)
        if both:
            raise ValueError(f"{sorted(both)} is in both lora.target_modules and lora.modules_to_save; "
                             f"a module either gets an adapter or is trained fully")
        return self


class TrainConfig(Section):
    seq_len: int = Field(1024, ge=8)
    """Tokens per sequence."""
    micro_batch_size: int = Field(1, ge=1)
    """Sequences per rank per forward/backward."""
    grad_accum_steps: int = Field(1, ge=1)
    """Micro batches accumulated per optimizer step."""
    global_batch_size: int | None = Field(None, ge=1)
    """Sequences per optimizer step over all ranks. Set it and leave micro_batch_size /
    grad_accum_steps unset: the planner picks micro x accumulation x world size that match
    it, the fastest that fits. Unset: micro_batch_size x grad_accum_steps x world size."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps to run. Exclusive with `epochs`; one of the two is required."""
    chunked_loss: bool = True
    """Compute the loss without vocab-sized fp32 tensors (zerofit/loss.py: same value and
    gradient as HF's, ~5x less logits memory, so larger micro batches fit); false: HF's own
    loss (model(..., labels=...))."""
    heap_step_temporaries: bool = False
    """Keep the optimizer step's host temporaries on glibc's heap, reused every step, instead
    of fresh mmaps page-faulted each time (zerofit/machine/hostalloc.py; with the optimizer offloaded
    and parameters on the GPU: the 16-bit copy of each sub-group). Faster where that copy is a
    large part of the step (bench/results/README.md). Off by default: the heap keeps
    freed temporaries resident and fragments (about 8 temporaries' worth; the planner counts
    planner.HEAP_TEMPORARIES_HELD = 9 of the largest as host RAM)."""
    cpu_threads: int | None = Field(None, ge=1)
    """CPU threads per rank (torch's pool and DeepSpeedCPUAdam's OpenMP loop). Default: the
    cores this process may use divided by the node's ranks (one fewer with
    checkpoint.async_save, for the writer thread, when that leaves at least two), also when
    torchrun has set OMP_NUM_THREADS=1 (its default for several ranks, which leaves the CPU
    optimizer one core); any other OMP_NUM_THREADS is kept."""
    epochs: float | None = Field(None, gt=0)
    """Passes over the training data, converted to the fewest optimizer steps that make them (the
    last step may run into the next pass by less than one step)."""
    lr: float = Field(2e-5, gt=0)
    """Peak learning rate."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup, down to min_lr_ratio x lr (cosine, linear); every schedule warms up over
    warmup_steps. HF's names `cosine_with_min_lr` and `constant_with_warmup` read as cosine and
    constant (HF's own `constant` skips warmup: set warmup_steps 0 for it)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup: optimizer step s (counted from 1) runs at s / warmup_steps of `lr`, so the
    first step is not wasted at 0 and step warmup_steps reaches `lr`."""
    warmup_ratio: float | None = Field(None, ge=0.0, lt=1.0)
    """Warmup as a share of the run's optimizer steps (HF's warmup_ratio; transformers 5 takes it
    as a warmup_steps below 1): ceil(ratio x steps) warmup steps, counted once the data and the
    plan give the step count. Instead of warmup_steps."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """The decay's floor as a fraction of `lr` (cosine and linear): reached one step past the
    last, which runs just above it."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Global gradient-norm clipping; 0 disables it."""
    precision: Precision = "bf16"
    """Training precision of parameters and activations (master weights stay fp32)."""
    seed: int = 42
    """Seed for init, data order and dropout; a resumed run continues the same stream."""

    @field_validator("lr_schedule", mode="before")
    @classmethod
    def _hf_schedule_names(cls, value):
        """transformers.get_scheduler's names for what zerofit's schedules are."""
        return {"cosine_with_min_lr": "cosine", "constant_with_warmup": "constant"}.get(value, value)

    @model_validator(mode="after")
    def _one_warmup(self) -> "TrainConfig":
        if self.warmup_ratio is not None and self.warmup_steps:
            raise ValueError("set train.warmup_steps or train.warmup_ratio, not both")
        return self

    @model_validator(mode="after")
    def _one_length(self) -> "TrainConfig":
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set train.max_steps or train.epochs")
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError("set train.max_steps or train.epochs, not both")
        return self


class ZeroConfig(Section):
    stage: Literal[0, 1, 2, 3] = 3
    """ZeRO stage (3 partitions parameters, gradients and optimizer states)."""
    offload_optimizer: OffloadDevice = "cpu"
    """Where fp32 master weights and Adam moments live; cpu/nvme run DeepSpeedCPUAdam."""
    offload_optimizer_ratio: float = Field(1.0, gt=0.0, le=1.0)
    """Fraction of optimizer states offloaded (partial offload, ZeRO-3 only); the rest
    stays on the GPU and steps there."""
    offload_param: OffloadDevice = "none"
    """Where 16-bit parameters live between uses (ZeRO-3 only)."""
    param_buffer_size: int = Field(100_000_000, ge=1)
    """NVMe parameters: elements per page-locked swap buffer (offload_param.buffer_size, 5 of
    them); each must hold the largest parameter partition (DeepSpeed asserts "More elements
    than buffer size" at start-up). Unset: that partition, at least DeepSpeed's 1e8."""
    nvme_path: str | None = None
    """Directory for NVMe offload swap files (required with nvme), on a local disk that takes
    O_DIRECT; each run keeps its files in its own `zerofit-<hash>` folder there. Setting it
    also lets the planner choose NVMe when host RAM is short (`zerofit doctor --system
    --nvme-path DIR` measures the disk and tunes the aio settings below for it)."""
    nvme_pipeline: bool = False
    """NVMe optimizer offload: read the next sub group's state and write the previous one's
    while the current one steps (DeepSpeed offload_optimizer pipeline_read/pipeline_write),
    instead of swap in, step, swap out one after the other. Costs two more sub groups of
    page-locked swap buffers (buffer_count 12 instead of 4; the largest sub group is the
    embedding when it exceeds sub_group_size), and the first step holds Adam's new moments
    (8 bytes per swapped parameter) until it ends. Same losses bit for bit. Unset: the
    planner turns it on when host RAM holds both and its time model says it is faster."""
    pin_memory: bool = True
    """Page-locked host buffers for offload: faster transfers, RAM that cannot be swapped."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward."""
    reduce_bucket_size: int = Field(50_000_000, ge=1)
    """Elements per gradient reduce bucket."""
    prefetch_bucket_size: int = Field(50_000_000, ge=0)
    """Elements of parameters prefetched ahead of use (stage3_prefetch_bucket_size)."""
    param_persistence_threshold: int = Field(100_000, ge=0)
    """Parameters smaller than this stay gathered on every rank (stage3_param_persistence_threshold)."""
    max_live_parameters: int = Field(1_000_000_000, ge=0)
    """Upper bound of gathered parameter elements resident at once (stage3_max_live_parameters)."""
    max_reuse_distance: int = Field(1_000_000_000, ge=0)
    """Keep a released parameter if it is reused within this many elements (stage3_max_reuse_distance)."""
    sub_group_size: int = Field(100_000_000, ge=1)
    """Elements per optimizer-step sub group. Without optimizer offload DeepSpeed's default 1e9
    allocates up to 6 bytes per element of gradient temporaries on the GPU in the step (most
    often fatal in the first step after a save); offloaded, each sub group's 16-bit copy passes
    through host RAM (2 bytes per element). 1e8 is the safe default."""
    gather_16bit_weights_on_save: bool = False
    """Also write a consolidated 16-bit model at each save (a host-RAM and time spike): DeepSpeed's
    gathered 16-bit state dict (HF's key names; with LoRA peft's, the base and the adapters unmerged) as
    pytorch_model.bin in the checkpoint, as its save_16bit_model writes it; `zerofit export`
    makes a model directory from a checkpoint afterwards instead."""
    aio_block_size: int | None = Field(None, ge=4096)
    """NVMe offload: bytes per async I/O request (DeepSpeed aio.block_size); optimizer sub
    groups smaller than max(1 MiB, this) are not swapped but kept in host RAM. Unset: the
    value `zerofit doctor --system --nvme-path` tuned for the path (cached), else
    DeepSpeed's 1 MiB, raised if needed so every write is whole direct-I/O blocks."""
    aio_queue_depth: int | None = Field(None, ge=1)
    """NVMe offload: requests in flight per I/O thread (aio.queue_depth). Unset: tuned, else 8."""
    aio_intra_op_parallelism: int | None = Field(None, ge=1)
    """NVMe offload: I/O threads each transfer is split over (aio.intra_op_parallelism).
    Unset: tuned, else 1."""
    aio_single_submit: bool | None = None
    """NVMe offload: submit requests one by one instead of in batches (aio.single_submit).
    Unset: tuned, else false."""
    aio_overlap_events: bool | None = None
    """NVMe offload: submit new requests while others complete (aio.overlap_events).
    Unset: tuned, else true."""

    @model_validator(mode="after")
    def _offload_needs(self) -> "ZeroConfig":
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError(f"zero.offload_param={self.offload_param} needs zero.stage=3 (got {self.stage})")
        if self.offload_optimizer == "nvme" and self.stage != 3:  # stage_1_and_2.py: cpu_offload = device != none
            raise ValueError(f"zero.offload_optimizer=nvme needs zero.stage=3: DeepSpeed's stage {self.stage} optimizer "
                             f"keeps its states in CPU memory whatever the device (use offload_optimizer=cpu there)")
        if "nvme" in (self.offload_optimizer, self.offload_param) and not self.nvme_path:
            raise ValueError("NVMe offload needs zero.nvme_path, a directory on a fast local disk")
        if self.offload_optimizer_ratio < 1.0 and self.stage != 3:
            raise ValueError("zero.offload_optimizer_ratio < 1 (partial offload) needs zero.stage=3")
        return self


class CheckpointConfig(Section):
    every_steps: int = Field(500, ge=0)
    """Save every N optimizer steps (500, HF Trainer's save_steps), or sooner when every_minutes
    comes first; 0: no step schedule."""
    every_minutes: float = Field(30.0, ge=0.0)
    """Also save once this many minutes have passed since the last save (or the start), whichever of
    the two schedules comes first: a run of slow steps loses at most this much; 0: no time schedule.
    With both 0 a run saves only at the end (save_final) and on SIGTERM or Ctrl-C."""
    keep_last: int = Field(2, ge=1)
    """Keep the newest K checkpoints (the newest valid one is kept in any case)."""
    keep_every: int = Field(0, ge=0)
    """Also keep every checkpoint whose step is a multiple of M (0: none)."""
    save_final: bool = True
    """Save when training ends."""
    save_on_sigterm: bool = True
    """On SIGTERM (preemption; torchrun passes it to every rank) save the step the loop is at,
    then stop (exit 143): nothing since the last checkpoint is lost. The save is published
    atomically, so a SIGKILL that cuts it short leaves the previous checkpoint in place."""
    async_save: bool = False
    """Write checkpoints in the background while training continues: the loop stalls only
    while the state is copied to host memory; at most one save is in flight."""
    async_host_max_gib: float | None = Field(None, gt=0)
    """Host RAM the async snapshot buffer may hold per rank (it holds one checkpoint's
    share of the rank, reused by every save). Default: half the plan's host budget
    (plan.host_mem, else the RAM available at start), as the planner counts it. A save that
    does not fit is written synchronously, with a warning."""
    direct_io: bool = True
    """Write checkpoint files with O_DIRECT (from an aligned buffer straight to the disk: no
    page-cache copy, no kernel writeback threads taking cores from the CPU optimizer while
    an async save runs); filesystems that refuse it are written through the page cache."""
    zip_crc32: bool = False
    """Compute the zip CRC-32 of every record torch.save writes. Off (the default), records
    carry a zero CRC: torch.load reads them as before and resume verifies every file by its
    xxh3 hash in the manifest, but zip tools (python -m zipfile -t) report them as corrupt.
    The CRC is a serial pass over every byte in the writer, which slows an async save
    (bench/results/README.md)."""
    verify: Literal["sizes", "full"] = "full"
    """How resume checks a checkpoint against its manifest: `sizes` of every file, or
    `full`: sizes and xxh3 hashes of every byte (bound by the disk read, which the load
    repeats: ~8 s per 18 GB on the GPU machine). `zerofit train --verify` overrides it."""
    on_error: Literal["continue", "stop"] = "stop"
    """When a save fails (disk full, I/O error): keep training, or stop cleanly. Either
    way the failed checkpoint is discarded and the previous one stays loadable."""


class EvalConfig(Section):
    every_steps: int = Field(0, ge=0)
    """Evaluate every N optimizer steps; 0 only at the end."""
    max_sequences: int | None = Field(None, ge=1)
    """Caps an evaluation at the eval set's first N sequences; unset, the whole set is evaluated
    (as HF Trainer does). The same sequences however the run is split into micro batches and
    ranks (the planner's split, an OOM retry's smaller micro batch), so eval losses compare."""
    at_end: bool = True
    """Evaluate once more when training ends."""


class LogConfig(Section):
    every_steps: int = Field(1, ge=1)
    """Progress update cadence in optimizer steps; the plain lines written where stderr is no
    terminal come at most once every 5 s besides, and at the last step (metrics.jsonl gets
    every step)."""
    progress: bool = True
    """Show the progress bar (plain lines instead when stderr, where zerofit writes, is not a terminal)."""
    tensorboard: bool = False
    """Also write TensorBoard event files into RUN_DIR/tensorboard (needs `pip install tensorboard`)."""

    @field_validator("tensorboard")
    @classmethod
    def _installed(cls, value: bool) -> bool:
        """Said when the config is read, not once the data is loaded and the engine built."""
        import importlib.util

        if value and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("log.tensorboard needs the tensorboard package: pip install tensorboard "
                             "(or zerofit[tensorboard])")
        return value


class MemoryConfig(Section):
    watchdog_threshold: float = Field(0.9, gt=0.0, le=1.0)
    """Act when GPU or host memory use crosses this fraction of the budget."""
    watchdog_action: Literal["warn", "save", "stop"] = "warn"
    """What the watchdog does: warn, save a checkpoint pre-emptively, or save and stop."""
    on_oom: Literal["stop", "retry"] = "stop"
    """After an OOM post-mortem: stop, or restart from the newest checkpoint with a safer plan
    (in the process with one rank; with several, through `torchrun --max-restarts N`)."""
    history_max_entries: int = Field(100_000, ge=0)
    """CUDA allocator events kept for the OOM snapshot (torch.cuda.memory._record_memory_history
    with Python stacks, the newest N); 0 turns the recording off."""
    expandable_segments: bool = True
    """Let the CUDA allocator's segments grow in place (PyTorch's expandable_segments) so that
    freed pieces between activations do not strand a large late request; a setting of
    expandable_segments in PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF wins over this."""


class ElasticConfig(Section):
    lost_node_after_s: float = Field(120.0, ge=0.0)
    """Under torchrun with several nodes: a node whose heartbeat (counted up every second in
    torchrun's store by a thread of its local rank 0, from the process group's start) has not
    moved for this long, or has not moved once this long after the watchers started, is lost whole (a machine down, its
    network gone), and every rank leaves at once for torchrun to
    restart or stop them, instead of waiting in a collective for NCCL's timeout (10 min). The
    same for the store itself not answering that long. 0: off."""


DEFAULT_HEADROOM = 0.1  # plan.headroom's; planner.predict's for callers without a config


class PlanConfig(Section):
    enabled: bool = True
    """Let the planner choose the unset zero.* and batch fields, and refuse plans that do not
    fit. Off: the config runs as given; the prediction is still recorded (plan.json)."""
    gpu_mem: str | None = None
    """GPU memory budget per rank, e.g. `24GiB` (default: the GPU's free memory at start)."""
    host_mem: str | None = None
    """Host RAM budget per node, e.g. `64GiB` (default: probed available RAM, within the cgroup's memory
    limit where there is one)."""
    headroom: float = Field(DEFAULT_HEADROOM, ge=0.0, lt=0.9)
    """Fraction of each budget kept free."""

    @field_validator("gpu_mem", "host_mem", mode="before")
    @classmethod
    def _size_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _sizes(self) -> "PlanConfig":
        for key in ("gpu_mem", "host_mem"):  # at load, not once DeepSpeed has started
            size = parse_bytes(getattr(self, key), f"plan.{key}")
            if size is not None and size < 2**20:  # `24`: a unit left out, not a 24-byte budget
                raise ConfigError(f"plan.{key}={getattr(self, key)!r} is {size} bytes; write the unit, e.g. 24GiB")
        return self


# The sections that do not decide the numbers a run computes (how it saves, evaluates, logs and
# watches memory): left out of the fingerprint a checkpoint records; a resume names their changes
# against the run's config.yaml (runfiles.changed_unrecorded).
# The keys the planner chooses when a config leaves them unset (plan.enabled): the example
# YAML comments them out, the key reference marks them, plan.choose fills them in.
DECIDED = {"zero": ("offload_optimizer", "offload_optimizer_ratio", "offload_param", "param_buffer_size", "reduce_bucket_size",
                    "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
                    "nvme_pipeline"),
           "train": ("micro_batch_size", "grad_accum_steps"), "model": ("gradient_checkpointing",)}


UNRECORDED = ("checkpoint", "eval", "log", "memory", "elastic")


class Config(Section):
    run_dir: str = "runs/run"
    """Where the run's files go (config, plan, metrics, memory, checkpoints)."""
    model: ModelConfig
    lora: LoraConfig = LoraConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig
    zero: ZeroConfig = ZeroConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    log: LogConfig = LogConfig()
    memory: MemoryConfig = MemoryConfig()
    elastic: ElasticConfig = ElasticConfig()
    plan: PlanConfig = PlanConfig()

    def fingerprinted(self) -> dict:
        """What decides the numbers a run computes (not where it logs or saves: UNRECORDED):
        model.chat_template by its text's hash, not its path (a template moved is none changed,
        one edited in place is)."""
        values = self.model_dump(mode="json", exclude={"run_dir", *UNRECORDED})
        template = Path(self.model.chat_template or "")
        if self.model.chat_template and template.is_file():
            values["model"]["chat_template"] = f"sha256 {hashlib.sha256(template.read_bytes()).hexdigest()[:12]}"
        return values

    def fingerprint(self) -> str:
        """Hash of `fingerprinted()`."""
        return hashlib.sha256(json.dumps(self.fingerprinted(), sort_keys=True).encode()).hexdigest()[:16]


def changed_settings(before: dict, after: dict, prefix: str = "") -> list[str]:
    """`section.key old -> new` for every setting that differs between two config dumps. A key one
    dump lacks and the other holds as None (unset) is no change."""
    changes = []
    for key in sorted(set(before) | set(after)):
        old = before.get(key, "(unset)")
        new = after.get(key, "(unset)")
        if (old, new) in (("(unset)", None), (None, "(unset)")) or (old == "(unset)" and new in ({}, [])):
            continue  # a key added since, left unset (None, or an empty mapping or list)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += changed_settings(old, new, f"{prefix}{key}.")
        elif old != new:
            changes.append(f"{prefix}{key} {short(old)} -> {short(new)}")
    return changes


def short(value: Any, width: int = 40) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= width else text[:width - 3] + "..."
