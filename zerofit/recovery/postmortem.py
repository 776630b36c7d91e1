"""OOM post-mortem: a CUDA or host out-of-memory error inside the training loop is caught,
explained and, where possible, survived.

Into RUN_DIR/postmortem/ (rank r > 0: postmortem/rank{r}/) go:
  snapshot.pickle   the CUDA caching allocator's snapshot with the last allocation events
                    (torch.cuda.memory._record_memory_history, started with the run and
                    bounded by memory.history_max_entries); open it at pytorch.org/memory_viz
  report.json       what happened, the numbers, plan vs measured, findings, the fix
  report.md         the same for people (and bug reports)
  retry-config.yaml the safer configuration
An emergency checkpoint of the last completed step is published when the state is
consistent; the process then exits 1 with a one-screen explanation, or, with
memory.on_oom=retry (`zerofit train --on-oom retry`), restarts from the newest
checkpoint with the safer settings: in this process with one rank, through torchrun's
restarts with several (elastic.py).

A host OOM the kernel answers with SIGKILL cannot be caught by anyone: the watchdog is
the defence there, and the process's last word (zerofit/recovery/lastword.py) leaves a record that
`zerofit doctor` explains beside the last memory record. Python's MemoryError and torch's CPU
allocator failures are caught.

The words (the explanation, report.md, the retry line) are oomreport.py's, from the report alone.
"""
from __future__ import annotations

import gc
import json
import os
import re
import time
import traceback
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

from zerofit.checkpoint import files as checkpoint
from zerofit.checkpoint.files import newest_checkpoint_bytes
from zerofit.config.load import dump_yaml, set_dotted, validate
from zerofit.config.schema import Config
from zerofit.core import faults
from zerofit.core.console import say, warn
from zerofit.core.errors import ConfigError
from zerofit.core.files import read_json, write_atomic
from zerofit.core.timeline import effective_records, gpu_bytes, host_rss_bytes, read_timeline
from zerofit.findings.detectors import detect, fragmented_request
from zerofit.findings.facts import RunFacts, facts_from
from zerofit.findings.measured import plan_vs_measured
from zerofit.machine.procenv import allocator_setting
from zerofit.recovery import elastic
from zerofit.recovery.oomreport import (
    MAX_RETRIES,
    directory_of,
    explanation,
    render_markdown,
    retry_message,
    why_not_retried,
)

# the settings would_fit changes: recorded with each OOM and each start, so the doctor advises
# from the settings that ran out of memory and names what a retry changed
MEMORY_SETTINGS = ("train.micro_batch_size", "train.grad_accum_steps", "model.gradient_checkpointing",
                   "zero.offload_param", "zero.offload_optimizer", "zero.offload_optimizer_ratio", "zero.pin_memory",
                   "zero.sub_group_size", "zero.prefetch_bucket_size", "zero.max_live_parameters",
                   "zero.gather_16bit_weights_on_save", "memory.expandable_segments")
TRAINING_PHASES = ("forward", "backward", "optimizer_step")
NEXT_PHASE = {"forward": "backward", "backward": "optimizer_step"}  # the order train_step observes them


class OutOfMemoryStop(ConfigError):
    """The run ran out of memory; the message is the one-screen explanation (exit 1)."""


@dataclass
class OomEvent:
    step: int                   # the step that was running
    phase: str                  # forward | backward | optimizer_step | eval | save
    device: str                 # gpu | host
    message: str                # the error's text, first lines
    requested_bytes: int | None
    gpu: dict = field(default_factory=dict)
    host_rss: int = 0
    snapshot: str | None = None
    snapshot_note: str = ""
    rank: int = 0
    world_size: int = 1


@dataclass
class Session:
    """What the loop lends the post-mortem: set by `attach` once built, read after an OOM."""
    config: Config
    dist: object = None
    engine: object = None
    saver: object = None
    state: object = None
    timeline: object = None
    progress: object = None
    retry: bool = False  # an OOM retry in this process: the same run, its records go on

    def begin(self, dist) -> None:
        """Right after the device is chosen: remember it, start the allocator history."""
        self.dist = dist
        start_recording(self.config, dist)

    def attach(self, **parts) -> None:
        for name, value in parts.items():
            setattr(self, name, value)

    def release(self) -> weakref.ref | None:
        """Drop the attempt's parts; the weak reference to its engine says afterwards whether
        anything still holds it (and the memory it holds)."""
        if self.saver is not None:
            self.saver.close(self.state.step if self.state else 0)  # publish a save in flight, restore SIGTERM
        gone = None
        if self.engine is not None:
            gone = weakref.ref(self.engine)
            release(self.engine)
        self.engine = self.saver = self.state = self.timeline = self.progress = None
        return gone


# ---------------------------------------------------------------------- the policy
def run_with_oom_policy(run, config: Config, resume: bool | None):
    """`run(config, resume, session)`; on an OOM: post-mortem, then stop (exit 1) or retry
    from the newest checkpoint with safer settings (memory.on_oom)."""
    retries_left = MAX_RETRIES if config.memory.on_oom == "retry" else 0
    retry = False
    while True:
        session = Session(config, retry=retry)
        try:
            return run(config, resume, session)
        except Exception as error:  # MemoryError and torch.OutOfMemoryError are Exceptions
            if not is_oom(error):
                raise
            event = capture(error, session)
        # Outside the except block: the traceback (and the frames holding the failed
        # step's tensors) is gone, so the emergency save finds the memory free again.
        free_memory()
        report = conclude(event, session)
        engine_left = session.release()
        del session
        free_memory()
        safer = report.get("safer_config")
        if retries_left and safer and event.world_size == 1:
            if engine_left is not None and engine_left() is not None:
                warn("the failed attempt's DeepSpeed engine is still referenced after its release: the memory it "
                     "holds stays in use, and the retry plans with less")
            retries_left -= 1
            faults.disarm("oom", "step", event.step)  # an injected OOM stands for the old settings
            say(retry_message(report, retries_left))
            config, resume, retry = validate(safer), None, True
            continue
        report["retries_used_up"] = config.memory.on_oom == "retry" and not retries_left
        if event.world_size > 1:  # no rank retries alone: torchrun's next attempt, if any, learns what to do
            retry = config.memory.on_oom == "retry" and safer
            report["handed_over"] = elastic.hand_over(directory_for(Path(config.run_dir), event.rank), event,
                                                      validate(safer) if retry else None,
                                                      report["changes"] if retry else [],
                                                      "" if retry else why_not_retried(config, safer))
        raise OutOfMemoryStop(explanation(report))


def is_oom(error: BaseException) -> bool:
    import torch

    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def free_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # cuBLAS keeps a workspace per handle and stream in the caching allocator, which
            # empty_cache does not free: a few of them pin whole segments the retry then lacks
            clear_workspaces = getattr(torch.cuda, "clear_cublas_workspaces", None) or \
                getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces:
                clear_workspaces()
            torch.cuda.empty_cache()
            # freed pinned buffers go back to torch's caching host allocator, which keeps them;
            # it frees a block only once the copies recorded on it are done
            torch.cuda.synchronize()
            empty_host_cache = getattr(torch._C, "_accelerator_emptyHostCache", None) or \
                getattr(torch._C, "_host_emptyCache", None)
            if empty_host_cache:
                empty_host_cache()
    except RuntimeError:
        pass


# ---------------------------------------------------------------------- recording
def history_breaks_checkpointing(torch_version: str) -> bool:
    """torch 2.11 raises "SystemError: <built-in method apply of FunctionMeta> returned NULL"
    in autograd Functions (DeepSpeed's ZeRO-3 linear) under non-reentrant activation
    checkpointing while the allocator history records (pytorch/pytorch#179536, a regression
    from 2.10; seen on the GPU machine in every checkpointed run). No fixed release is
    known yet, so every version from 2.11 on is treated as affected."""
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 11)


def start_recording(config: Config, dist) -> None:
    """Keep the last N allocator events (with Python stacks) for the OOM snapshot. Call
    after the device is chosen: the history is per device."""
    if not dist.on_gpu or not config.memory.history_max_entries:
        return
    import torch

    if config.model.gradient_checkpointing and history_breaks_checkpointing(torch.__version__):
        if dist.is_main:
            warn(f"allocator history off: torch {torch.__version__} with activation checkpointing fails inside "
                 f"autograd Functions while it records (pytorch/pytorch#179536); an OOM post-mortem will "
                 f"have no snapshot.pickle, the rest of it stays")
        return
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=config.memory.history_max_entries)


def dump_snapshot(directory: Path, on_gpu: bool) -> tuple[str | None, str]:
    if not on_gpu:
        return None, "no allocator snapshot: the run was on CPU (the CUDA allocator keeps it)"
    import torch

    path = directory / "snapshot.pickle"
    try:
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
    except Exception as e:  # the snapshot is a bonus; the report must still be written
        return None, f"allocator snapshot failed: {e}"
    return str(path), "open it at https://pytorch.org/memory_viz (drag the file in)"


# ---------------------------------------------------------------------- capture
def parse_requested_bytes(message: str) -> int | None:
    """The size the failed allocation asked for, from PyTorch's and numpy's messages:
    'Tried to allocate 2.00 GiB', 'you tried to allocate 1073741824 bytes',
    'Unable to allocate 3.2 GiB for an array'."""
    units = {"b": 1, "bytes": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    found = re.search(r"allocate\s+([\d.]+)\s*(bytes|[KMGT]i?B|B)\b", message, re.IGNORECASE)
    if not found:
        return None
    return int(float(found.group(1)) * units[found.group(2).lower()])


def failed_phase(error: BaseException, last_phase: str | None) -> str:
    """Which phase raised: save and eval by the loop function on the stack; inside a
    training step, the phase after the last one the timeline observed."""
    names = {frame.f_code.co_name for frame, _ in traceback.walk_tb(error.__traceback__)}
    if "save_checkpoint" in names:
        return "save"
    if "evaluate" in names:
        return "eval"
    return NEXT_PHASE.get(last_phase, "forward")


def directory_for(run_dir: Path, rank: int) -> Path:
    """The rank's post-mortem directory, made."""
    path = directory_of(run_dir, rank)
    path.mkdir(parents=True, exist_ok=True)
    return path


def capture(error: BaseException, session: Session) -> OomEvent:
    """In the except block, before anything else allocates: snapshot, readings, the
    timeline's `oom` record."""
    dist, timeline = session.dist, session.timeline
    on_gpu, rank = bool(dist and dist.on_gpu), dist.rank if dist else 0
    directory = directory_for(Path(session.config.run_dir), rank)
    snapshot, snapshot_note = dump_snapshot(directory, on_gpu)
    phase = failed_phase(error, timeline.last_phase if timeline else None)
    state_step = session.state.step if session.state else 0
    step = state_step + 1 if phase in TRAINING_PHASES else state_step
    message = "\n".join(str(error).strip().splitlines()[:6]) or type(error).__name__
    event = OomEvent(step, phase, oom_device(error, on_gpu), message, parse_requested_bytes(str(error)),
                     gpu_bytes(on_gpu), host_rss_bytes(), snapshot, snapshot_note, rank, dist.world_size if dist else 1)
    if timeline:
        try:
            timeline.mark(step, "oom", failed_phase=phase, device=event.device, requested_bytes=event.requested_bytes,
                          error=message.splitlines()[0][:300], settings=memory_settings(session.config))
        except (MemoryError, OSError):  # a host OOM may refuse even this; the report still follows
            pass
    return event


def memory_settings(config: Config) -> dict:
    """The values of MEMORY_SETTINGS in `config`."""
    raw = config.model_dump(mode="json")
    return {key: raw[key.split(".")[0]][key.split(".")[1]] for key in MEMORY_SETTINGS}


def oom_device(error: BaseException, on_gpu: bool) -> str:
    """gpu for the CUDA caching allocator's error (its message names CUDA), host otherwise
    (MemoryError, the CPU allocator's 'DefaultCPUAllocator: not enough memory')."""
    import torch

    if "CUDA" in str(error) or (on_gpu and isinstance(error, torch.OutOfMemoryError) and "CPU" not in str(error)):
        return "gpu"
    return "host"


# ---------------------------------------------------------------------- conclude
def conclude(event: OomEvent, session: Session) -> dict:
    """Emergency checkpoint, safer config, report.json/.md; returns the report."""
    if session.progress:
        session.progress.close()
    emergency, emergency_note = emergency_checkpoint(event, session)
    if session.timeline:
        session.timeline.close()
    config, run_dir = session.config, Path(session.config.run_dir)
    # as the doctor reads it: a retry's `start` rolls back the failed attempt's step records
    records = effective_records(read_timeline(run_dir, event.rank))
    facts = facts_from(records, read_json(run_dir / "ds_config.json"), config.model_dump(mode="json"),
                       read_json(run_dir / "plan.json"))
    safer, changes = would_fit(config, event, facts)
    directory = directory_for(run_dir, event.rank)
    if safer is not None:
        write_atomic(directory / "retry-config.yaml", dump_yaml(safer))
    report = {
        "event": asdict(event), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "run_dir": str(run_dir),
        "emergency_checkpoint": emergency, "emergency_note": emergency_note,
        "last_step": [r for r in records if r.get("step") in (event.step - 1, event.step)],
        "plan": plan_vs_measured(read_json(run_dir / "plan.json"), {event.rank: records}, newest_checkpoint_bytes(run_dir)),
        "findings": [f.to_dict() for f in detect(records, facts)],
        "changes": changes, "safer_config": safer.model_dump(mode="json") if safer else None,
        "retry_config": str(directory / "retry-config.yaml") if safer else None,
    }
    newest = checkpoint.published(run_dir / "checkpoints")  # what a retry resumes from
    report["resume_from"] = str(newest[0]) if newest else None
    keep_earlier_report(directory)
    write_atomic(directory / "report.json", json.dumps(report, indent=1, default=str))
    write_atomic(directory / "report.md", render_markdown(report))
    return report


def keep_earlier_report(directory: Path) -> None:
    """An earlier OOM's report.json/.md (a run retried before) become report-step-N.*."""
    earlier = read_json(directory / "report.json")
    if not earlier:
        return
    step = earlier.get("event", {}).get("step", "unknown")
    for suffix in (".json", ".md"):
        if (directory / f"report{suffix}").is_file():
            (directory / f"report{suffix}").replace(directory / f"report-step-{step}{suffix}")


def emergency_checkpoint(event: OomEvent, session: Session) -> tuple[str | None, str]:
    """Publish the last completed step when that state is whole: not inside an optimizer
    step (parameters half-updated), not with several ranks (a save needs them all)."""
    state, saver = session.state, session.saver
    if saver is None or state is None:
        return None, "not written: the OOM came before the engine was built"
    if event.world_size > 1:
        return None, "not written: a checkpoint needs every rank, and this rank failed alone"
    if event.phase == "optimizer_step":
        return None, "not written: the OOM hit inside the optimizer step, parameters may be half-updated"
    if state.step == 0:
        return None, "not written: no step had completed"
    path = saver.root / checkpoint.step_name(state.step)
    if saver.saved_step == state.step:
        saver.close(state.step)  # a save of this step may still be in flight: publish it
        if saver.saved_step == state.step:  # published, not failed
            return str(path), f"step {state.step} was already saved"
    state.extra["emergency"] = f"oom in {event.phase} of step {event.step}"
    try:
        saver.save(state)
        saver.close(state.step)  # durable before the process exits
    except Exception as e:  # a second OOM, a full disk: report it, keep the first error
        return None, f"not written: the save failed too ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    finally:
        state.extra.pop("emergency", None)
    if not (path / checkpoint.MANIFEST).is_file():  # checkpoint.on_error=continue swallowed a failure
        return None, "not written: the save failed (see the warning above)"
    return str(path), f"written after the OOM: resume continues from step {state.step}"


def would_fit(config: Config, event: OomEvent, facts: RunFacts) -> tuple[Config | None, list[str]]:
    """The configuration that should fit: one step safer along the fix the failed phase
    calls for, from the config that ran (the planner's choices in it). The result sets
    every field, so on a retry the planner only checks that it fits (and refuses if not)."""
    changes: dict[str, object] = {}
    zero, train_section, model = config.zero, config.train, config.model
    if event.device == "host":
        if zero.pin_memory:
            changes["zero.pin_memory"] = False
        if zero.gather_16bit_weights_on_save:
            changes["zero.gather_16bit_weights_on_save"] = False
    elif fragmented(event, facts) and not config.memory.expandable_segments and \
            allocator_setting(True, os.environ) is not None:
        changes["memory.expandable_segments"] = True  # the space was there, in pieces: nothing else need give
    elif event.phase in ("forward", "backward", "eval"):
        if train_section.micro_batch_size > 1:
            changes["train.micro_batch_size"] = train_section.micro_batch_size // 2
            changes["train.grad_accum_steps"] = train_section.grad_accum_steps * 2
        elif not model.gradient_checkpointing:
            changes["model.gradient_checkpointing"] = True
        elif zero.stage == 3 and zero.offload_param == "none":
            changes["zero.offload_param"] = "cpu"
        else:
            changes["zero.prefetch_bucket_size"] = zero.prefetch_bucket_size // 2
            changes["zero.max_live_parameters"] = zero.max_live_parameters // 2
    elif event.phase == "optimizer_step":
        if zero.sub_group_size > 100_000_000:
            changes["zero.sub_group_size"] = 100_000_000
        elif zero.offload_optimizer == "none":
            changes["zero.offload_optimizer"] = "cpu"
        elif zero.offload_optimizer_ratio < 1.0:
            changes["zero.offload_optimizer_ratio"] = 1.0
    elif event.phase == "save" and zero.gather_16bit_weights_on_save:
        changes["zero.gather_16bit_weights_on_save"] = False
    if not changes:
        return None, []
    raw = config.model_dump(mode="json")
    for key, value in changes.items():
        set_dotted(raw, key, value)
    return validate(raw), [f"{key}={value}" for key, value in changes.items()]


def fragmented(event: OomEvent, facts: RunFacts) -> bool:
    return fragmented_request(event.requested_bytes, event.gpu.get("gpu_alloc", 0), event.gpu.get("gpu_reserved", 0),
                              facts.gpu_budget)


def release(ds_engine) -> None:
    """Let go of an engine so that another one in this process (an OOM retry) finds its
    memory free. DeepSpeed's destroy() removes the engine's hooks; but ZeRO-3 also puts the
    model on a module-level stack (parameter_offload.FWD_MODULE_STACK: appended once per
    engine, never popped, and left with the half-run forward's modules after an OOM), which
    keeps the model, the engine and every buffer they hold alive, and a retry finds the first
    attempt's host memory still taken (bench/results/README.md: the in-process OOM retry).
    Once a step has run, a class-level lru_cache holds the engine's parameter coordinator and
    modules too. Both are DeepSpeed's internals (0.19.8): where a version lacks one, there is
    nothing of it to clear."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    try:
        ds_engine.destroy()
    except Exception as error:  # after an OOM mid-step its state may be half-built; the rest still goes

        warn(f"DeepSpeed's engine.destroy() failed ({type(error).__name__}: {error}); releasing what zerofit can")
    ours = {id(module) for module in ds_engine.module.modules()}
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if stack is not None:
        stack[:] = [m for m in stack if id(m) not in ours]
    # __params_to_release: @instrument_w_nvtx over @functools.lru_cache, keyed by (coordinator,
    # module, step); only a cache, so clearing it for every engine of the process is safe
    method = vars(PartitionedParameterCoordinator).get("_PartitionedParameterCoordinator__params_to_release")
    for cell in getattr(method, "__closure__", None) or ():
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()
