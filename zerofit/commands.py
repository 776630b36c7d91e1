"""What each `zerofit <verb>` does with its parsed arguments: `cmd_<verb>(args)` returns the
exit code (cli.py registers the verbs and their arguments). Each imports the module that does
the work when it runs, so `zerofit --help` stays quick.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from zerofit.config.schema import Config, TrainConfig
from zerofit.core.errors import ConfigError
from zerofit.recovery import elastic
from zerofit.train.ranks import end_after_error


def load_config(args) -> Config:
    from zerofit.config.load import load

    # as a JSON string, which YAML reads as the text it is (not 2024 the number, 0755 octal)
    overrides = list(args.overrides) + ([f"run_dir={json.dumps(args.run_dir)}"] if args.run_dir else [])
    if getattr(args, "on_oom", None):
        overrides.append(f"memory.on_oom={args.on_oom}")
    return load(args.config, overrides)


def cmd_train(args) -> int:
    from zerofit.train import ranks

    config = load_config(args)  # a bad config is said at once, before DeepSpeed's import (seconds)
    check_named_files(config, resume=args.resume)  # and a file it names that is not there
    ranks.select_accelerator()  # before that import, which otherwise guesses and says so on stdout
    from zerofit.train.loop import train

    if args.verify:
        config.checkpoint.verify = args.verify
    run_dir = Path(config.run_dir).absolute()
    made = next((d for d in reversed([run_dir, *run_dir.parents]) if not d.exists()), None)  # the topmost new one
    first_rank = int(os.environ.get("RANK", "0")) == 0  # (the process group is not up yet)
    try:
        result = train(config, resume=args.resume)
    except ConfigError:
        if first_rank:  # a start that found an error leaves nothing it made, nor its pid
            from zerofit.core import runlock

            runlock.leave_as_found(run_dir, made)
        raise
    except KeyboardInterrupt:  # the steps since the newest checkpoint are lost: say which one that is
        from zerofit.train.resume import where_to_go_on

        if first_rank:  # a terminal's Ctrl-C reaches every rank: one says it
            print(f"zerofit: interrupted; {where_to_go_on(config)}", file=sys.stderr)
        return end_after_error(130)
    except RuntimeError as e:
        if not elastic.peer_gone(e):
            raise
        from zerofit.train.resume import resume_command

        raise ConfigError(elastic.peer_gone_message(e, resume_command(config), config.run_dir)) from None
    # 128 + SIGINT or SIGTERM, as a shell reports it
    code = (130 if result.interrupted else 143) if result.stopped_by_signal else 0
    ranks.finish_distributed(code)  # every rank finished (an error raised past this)
    return code


def check_named_files(config: Config, resume: bool | None = None, data: bool = True) -> None:
    """Every file and directory the config names is there, each problem on a line of one error:
    the model's (models.model_file_problems), the data files, zero.nvme_path's parent, a --resume's
    checkpoints. Only the file system is read, before any heavy import: a misspelt data.path was
    said 226 s after the start, after the process group, the op build and the model. `data`:
    False where the data may be on another machine (`zerofit plan`)."""
    from zerofit import models
    from zerofit.checkpoint import files as checkpoint
    from zerofit.data.files import data_entries

    problems = models.model_file_problems(config.model)
    if data and config.data.path not in ("demo", "synthetic"):  # the built-in sources (loadpeak.BUILT_IN)
        problems.append(models.problem_of(data_entries, config.data.path))
    if data and config.data.eval_path:
        problems.append(models.problem_of(data_entries, config.data.eval_path, "data.eval_path"))
    if config.zero.nvme_path:
        problems.append(models.problem_of(check_nvme_path, Path(config.zero.nvme_path)))
    # as resume.refuse_resume_without_checkpoint (which imports torch) does on rank 0 later
    root = Path(config.run_dir) / "checkpoints"
    if resume is True and int(os.environ.get("RANK", "0")) == 0 and not checkpoint.published(root):
        problems.append(f"--resume: no checkpoint under {root}; run without --resume to start fresh")
    problems = [problem for problem in problems if problem]
    if len(problems) > 1:
        raise ConfigError(f"{len(problems)} files or directories the config names are not usable:\n  "
                          + "\n  ".join(problems))
    if problems:
        raise ConfigError(problems[0])


def check_nvme_path(path: Path) -> None:
    """zero.nvme_path a file, or under a parent that is not there (nvme.make_swap_dir creates
    the directory itself, not its parents: most likely a typo)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"zero.nvme_path={path} is a file, not a directory; name a directory for DeepSpeed's "
                          f"swap files")
    if not path.exists() and path.parent.exists() and not path.parent.is_dir():
        raise ConfigError(f"zero.nvme_path={path} is not usable: Not a directory: {path.parent} is a file; use a "
                          f"writable directory on a local ext4/xfs disk for DeepSpeed's swap files")
    if not path.exists() and not path.parent.is_dir():
        raise ConfigError(f"zero.nvme_path={path} is not usable: {path.parent} does not exist (a typo? the swap "
                          f"directory is created, its parents are not: create them first if this is the path meant)")


def plan_overrides(args) -> list[str]:
    """Shape and hardware flags of plan/lint as config overrides (they become constraints)."""
    flags = {"seq_len": "train.seq_len", "micro_batch": "train.micro_batch_size", "grad_accum": "train.grad_accum_steps",
             "global_batch": "train.global_batch_size", "precision": "train.precision",
             "gradient_checkpointing": "model.gradient_checkpointing", "stage": "zero.stage",
             "offload_optimizer": "zero.offload_optimizer", "offload_param": "zero.offload_param",
             "gpu_mem": "plan.gpu_mem", "host_mem": "plan.host_mem", "nvme_path": "zero.nvme_path",
             "headroom": "plan.headroom"}
    values = {key: getattr(args, flag) for flag, key in flags.items() if getattr(args, flag, None) is not None}
    out = [f"{key}={json.dumps(value) if isinstance(value, str) else value}" for key, value in values.items()]
    return list(getattr(args, "overrides", [])) + out


def cmd_plan(args) -> int:
    if args.presets:  # counted from the shapes: no torch, no model built
        from zerofit.models import PRESETS, preset_params

        for name, fields in PRESETS.items():
            print(f"{name:14} {preset_params(name):>14,} parameters  {fields.get('model_type')}, "
                  f"{fields.get('num_hidden_layers')} layers, hidden {fields.get('hidden_size')}, "
                  f"vocabulary {fields.get('vocab_size')}")
        return 0
    # a bad config, model or file is said before planview's imports (torch, transformers: seconds)
    if args.config:
        from zerofit.config.load import load

        check_named_files(load(args.config, plan_overrides(args)), data=False)  # data: maybe on the machine planned for
    else:
        from zerofit.models import named_config_file

        named_config_file(args.model)
    from zerofit.plan.render import plan, plan_json, render

    # a config for HF Trainer is planned as HF Trainer runs: its own loss, with vocab-sized fp32 logits
    hf_side = ["train.chunked_loss=false"] if args.ds_config else []
    decision, spec, hw = plan(args.model, args.config, plan_overrides(args) + hf_side, args.world_size,
                              args.accelerator, args.cpu_cores, args.disk_free, args.nvme_free)
    if args.json:
        print(json.dumps(plan_json(decision, spec, hw), indent=2))
        if not decision.plan.fits:  # the exit status's reason, where a person reads (stdout is the JSON's)
            from zerofit.core.console import warn

            warn("nothing fits (\"fits\": false in the JSON; `zerofit plan` without --json says what would)")
    else:
        render(decision, spec, hw, explain=args.explain)
    if args.ds_config:
        write_trainer_ds_config(decision, Path(args.ds_config), hw.on_gpu)
    return 0 if decision.plan.fits else 1


def write_trainer_ds_config(decision, path: Path, on_gpu: bool) -> None:
    """The plan's DeepSpeed config as HF Trainer takes it, and the Trainer arguments that
    carry the plan's batch split and precision (the config leaves them "auto")."""
    from zerofit.core.console import say, warn
    from zerofit.plan import deepspeed
    from zerofit.plan.choose import overflow

    if overflow(decision.plan, exclude=("disk",)):
        warn(f"{path} not written: nothing fits (above); a DeepSpeed config of this plan would run out of memory")
        return
    config, shape = decision.config, decision.plan.shape
    ds = deepspeed.for_hf_trainer(deepspeed.build(config, shape.world_size, on_gpu))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # as doctor --out and export --out make theirs
        path.write_text(json.dumps(ds, indent=2) + "\n")
    except OSError as e:
        raise ConfigError(f"--ds-config {path} cannot be written ({e.strerror}); give a file path in a directory "
                          f"that exists and you can write") from None
    flags = [f"--per_device_train_batch_size {shape.micro_batch}", f"--gradient_accumulation_steps {shape.grad_accum}"]
    flags += ["--gradient_checkpointing"] if shape.gradient_checkpointing else []
    flags += {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(shape.precision, [])
    disk = " (only zerofit's checkpoint disk falls short above, which this config does not use)" \
        if not decision.plan.fits else ""
    say(f"wrote {path}{disk}: HF Trainer / LLaMA-Factory `--deepspeed {path}` with the plan's {' '.join(flags)}, "
        f"and PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment, as the plan assumes (zerofit "
        f"sets it for its own runs)")
    # transformers (integrations/deepspeed.py, deepspeed_init) hands a DeepSpeed optimizer every
    # trainable parameter as one group, where its own AdamW leaves biases and norm weights undecayed
    say("its optimizer section makes DeepSpeed's Adam the Trainer's optimizer (CPU Adam under offload), which the "
        "Trainer hands every parameter in one group: --weight_decay then decays norm weights and biases too "
        "(zerofit's own runs and the Trainer's AdamW exempt them); the Trainer's default --weight_decay 0 is the "
        "same either way")
    if config.zero.stage == 3:  # the plan prices evals as zerofit runs them (engine.release_gathered)
        say("with evals, give the Trainer zerofit.integrations.hf_trainer.MemoryGuardCallback(): it partitions what each eval batch "
            "leaves gathered, as the plan assumes; HF Trainer does not, and each step after an eval would gather "
            "its window on top (bench/results/hf_eval_leftovers-llama-1.5b.json)")


def cmd_lint(args) -> int:
    from zerofit.lint import check as lint

    spec = hw = None
    if args.model:
        from zerofit.config.load import validate
        from zerofit.plan import render as planview
        from zerofit.plan import spec as modelspec

        spec = modelspec.from_name(args.model)
        raw = {"model": {"config": args.model}, "train": {"max_steps": 1}, "plan": {"gpu_mem": args.gpu_mem,
                                                                                   "host_mem": args.host_mem}}
        hw = planview.probe_for(validate(raw), args.accelerator, args.cpu_cores, args.disk_free)
    trainer = lint.TrainerArgs(args.seq_len or TrainConfig.model_fields["seq_len"].default, args.micro_batch, args.gradient_checkpointing is not False,
                               args.lora_rank, args.lora_targets)
    result = lint.lint(lint.read(args.file), args.file, spec, hw, args.world_size, trainer, args.model or "")
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        lint.render(result)
    return 1 if result.errors else 0


def cmd_config(args) -> int:
    from zerofit.config.load import dump_yaml, example_yaml

    if args.example:
        if args.config or args.overrides:  # every key with its default: no config of yours goes into it
            raise ConfigError("config --example prints every key with its default; without --example, "
                              "`zerofit config --config FILE [--set k=v]` prints your config resolved")
        print(example_yaml(), end="")
        return 0
    if args.from_llamafactory:
        return print_translation(args)
    config = load_config(args)
    if not config.plan.enabled:
        print(dump_yaml(config), end="")
        return 0
    from zerofit.plan.choose import free_keys

    free = free_keys(config)
    print("# the resolved config. Keys marked `planner` are not set, so the planner chooses them at the start\n"
          "# (the value shown is only the default); `zerofit plan --config FILE` shows its choice.")
    print(dump_yaml(config, marked=free, mark="planner"), end="")
    return 0


def print_translation(args) -> int:
    """`zerofit config --from-llamafactory FILE [--set k=v]`: their YAML as zerofit's, checked
    as `zerofit train` will read it; what trains otherwise than theirs, and what is left to do,
    on stderr."""
    from zerofit.config.load import parse_override, validate
    from zerofit.core.console import warn
    from zerofit.integrations.llamafactory import config as lfconfig

    if args.config:
        raise ConfigError("--from-llamafactory FILE is the config to translate; drop --config")
    source = Path(args.from_llamafactory)
    translation = lfconfig.from_file(source)
    if translation.refused:
        raise ConfigError(f"{source} cannot be trained as LLaMA-Factory would ({len(translation.refused)} "
                          f"problem{'s' * (len(translation.refused) > 1)}):\n  " + "\n  ".join(translation.refused))
    for item in args.overrides or []:
        translation.override(*parse_override(item))
    validate(translation.raw())  # a translation train would refuse is said here, naming the key
    print(lfconfig.render(translation, str(source)), end="")
    for item in translation.notes:
        warn(item)
    for key, item in translation.todo.items():
        warn(f"before `zerofit train`: {key}: {item}")
    return 0


def cmd_export(args) -> int:
    from zerofit.export.checkpoint import export

    export(args.source, args.out, dtype=args.dtype, max_ram=args.max_ram, shard_size=args.shard_size,
           verify=args.verify, overwrite=args.overwrite, model_dir=args.model_dir, hashes=args.hashes,
           adapter_only=args.adapter_only, base=args.base, trust_remote_code=args.trust_remote_code)
    return 0



def cmd_generate(args) -> int:
    from zerofit.core.console import counted, say
    from zerofit.infer.generate import generate, sampling_from
    from zerofit.infer.load import describe, load

    loaded = load(args.model_dir, args.gpu_mem, args.dtype, trust_remote_code=args.trust_remote_code)
    result = generate(loaded, args.prompt, sampling_from(args))
    print(result.text)
    say(f"{counted(result.new_tokens, 'new token')} in {result.seconds:.2f} s: {result.tokens_per_s:.1f} tokens/s "
        f"(prompt {counted(result.prompt_tokens, 'token')}; {describe(loaded)})")
    if result.ended_at_eos:
        say("the model ended the sequence (end-of-sequence token)"
            + ("" if result.text.strip() else " at once, so the completion is empty; --min-new-tokens N makes it "
               "go on, or give a prompt in the layout it was trained on (`zerofit chat` applies its template)"))
    return 0


def cmd_chat(args) -> int:
    from zerofit.infer.generate import chat, sampling_from

    chat(args.model_dir, sampling_from(args), args.gpu_mem, args.dtype, trust_remote_code=args.trust_remote_code)
    return 0


def cmd_doctor(args) -> int:
    if args.system:
        from zerofit.doctor.system import check_system, print_checks

        checks = check_system(args.nvme_path, args.nvme_mib)
        print_checks(checks)
        return 1 if any(c.status == "fail" for c in checks) else 0
    if args.repro:
        from zerofit.doctor.repro import write_repro

        print(f"reproduction script: {write_repro(args.run_dir, args.out)}")
        return 0
    from zerofit.doctor.run import doctor

    doctor(args.run_dir, args.out, hashes=args.hashes)
    return 0
