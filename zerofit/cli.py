"""`zerofit <verb>`: the verbs and their arguments are registered here and nothing else happens
here; what each verb does is verbs.py's.

Exit codes: 0 success; 1 a user error (config, data, files, memory) with a one-line reason
first; 2 bad usage (argparse); 143 `train` stopped by SIGTERM (the step saved); 130 Ctrl-C.
"""
from __future__ import annotations

import argparse
import shutil
import sys

from zerofit.commands import cmd_chat, cmd_config, cmd_doctor, cmd_export, cmd_generate, cmd_lint, cmd_plan, cmd_train
from zerofit.config.schema import DEFAULT_HEADROOM
from zerofit.config.section import expand_path
from zerofit.core.errors import ConfigError, ZerofitError
from zerofit.core.timeline import human_bytes
from zerofit.plan.estimate import EXPORT_MAX_RAM_BYTES
from zerofit.recovery.peerwatch import TerminatedOutsideTheLoop
from zerofit.train.ranks import end_after_error


def at_least(minimum, kind=int):
    """An argparse type: a number no smaller than `minimum` (else a usage error, exit 2)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is below {minimum}")
        return value
    return parse


def probability(text: str) -> float:
    """An argparse type: a number in (0, 1] (top-p: 2 behaved as 1, 0 as nothing to sample from)."""
    value = at_least(0.0, float)(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def size(text: str) -> str:
    """An argparse type for SIZE flags: checked as the config will read it (memory.parse_bytes),
    so a typo is a usage error naming the flag, not the config key it becomes; kept as written."""
    from zerofit.core.timeline import parse_bytes

    try:
        parse_bytes(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("size=")) from None
    return text


def key_value(text: str) -> str:
    """An argparse type for --set: KEY=VALUE (else a usage error, exit 2)."""
    key, sep, _ = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. train.lr=3e-4)")
    return text


NVME_TEST_MIB = 256  # doctor --system's direct-I/O test size, unless --nvme-mib says


HELP_MAX_WIDTH = 100
CONFIG_KEYS = "(train's config keys: configfile.keys_help)"  # train's epilog, made when help is asked for


class TrainHelp(argparse.HelpFormatter):
    """train's help at the terminal's width, at most HELP_MAX_WIDTH columns: its own flags, then
    every config key on one line (the defaults and whole docs are `zerofit config --example`'s)."""

    def __init__(self, prog: str, **kwargs):
        kwargs.setdefault("width", min(shutil.get_terminal_size().columns, HELP_MAX_WIDTH) - 2)
        super().__init__(prog, **kwargs)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text != CONFIG_KEYS:
            return super()._fill_text(text, width, indent)
        from zerofit.config.load import keys_help  # imports the planner's choices: only for help

        return keys_help(width)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: the embedded demo)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                        help="override one config key, e.g. --set train.lr=3e-4 (repeatable)")
    parser.add_argument("--run-dir", metavar="DIR", help="run directory (overrides run_dir)")


def add_hardware_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=at_least(1), default=1, metavar="N", help="ranks (GPUs) to plan for (default 1)")
    parser.add_argument("--gpu-mem", metavar="SIZE", type=size,
                        help="GPU memory per rank, e.g. 24GiB (plans for CUDA even here)")
    parser.add_argument("--host-mem", metavar="SIZE", type=size,
                        help="host RAM budget, e.g. 64GiB (default: available RAM, within a cgroup limit)")
    parser.add_argument("--cpu-cores", type=at_least(1), metavar="N", help="CPU cores for CPU-Adam (default: this machine's)")
    parser.add_argument("--disk-free", metavar="SIZE", type=size,
                        help="free disk for checkpoints, e.g. 2TB (default: measured "
                        "where run_dir is, on this machine)")
    parser.add_argument("--accelerator", choices=["cuda", "cpu"], help="plan for this accelerator (default: what is here)")
    parser.add_argument("--seq-len", type=at_least(8), metavar="N", help="tokens per sequence")
    parser.add_argument("--micro-batch", type=at_least(1), metavar="N", help="sequences per rank per forward/backward")
    parser.add_argument("--json", action="store_true", help="print JSON")


def add_inference_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_OR_ADAPTER_DIR",
                        help="a model directory (what `zerofit export` writes), or a peft adapter directory "
                             "(`export --adapter-only`), run on its base")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=128, metavar="N", help="tokens to generate (128)")
    parser.add_argument("--min-new-tokens", type=int, default=0, metavar="N",
                        help="generate at least N tokens even past end-of-sequence (benchmarks)")
    parser.add_argument("--temperature", type=at_least(0.0, float), metavar="T",
                        help="sample at temperature T (0: greedy). Without --temperature, --top-p and --top-k "
                             "decoding is greedy")
    parser.add_argument("--top-p", type=probability, metavar="P",
                        help="sample from the likeliest tokens holding probability P (alone: at temperature 1)")
    parser.add_argument("--top-k", type=at_least(1), metavar="K",
                        help="sample from the K likeliest tokens (alone: at temperature 1)")
    parser.add_argument("--seed", type=int, help="sampling seed")
    parser.add_argument("--gpu-mem", metavar="SIZE", type=size,
                        help="GPU budget, e.g. 12GiB: layers beyond it run from CPU RAM (default: the whole GPU)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                        help="compute dtype (auto: the saved dtype on a GPU, fp32 on a CPU)")
    add_trust_remote_code(parser)


def add_trust_remote_code(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the model's own Python code (auto_map in its config.json); read it first. Never "
                             "taken from a model's, adapter's or run's files")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerofit", description="Fine-tune models larger than the GPU on DeepSpeed ZeRO-3 with CPU/NVMe offload, "
        "planned so that it does not run out of memory.",
        epilog="exit codes: 0 success; 1 a user error (the reason on the first line, with the fix); 2 bad usage; "
               "143 train stopped by SIGTERM (the step saved); 130 Ctrl-C")
    parser.add_argument("--version", action="version", version=f"zerofit {__import__('zerofit').__version__}")
    # The deepspeed launcher passes --local_rank=N before the verb (it also sets LOCAL_RANK).
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    train = verbs.add_parser("train", help="plan, then train on DeepSpeed ZeRO (no arguments: the embedded demo)",
                             epilog=CONFIG_KEYS, formatter_class=TrainHelp)
    add_config_args(train)
    resume = train.add_mutually_exclusive_group()
    resume.add_argument("--resume", dest="resume", action="store_true", default=None,
                        help="continue from the newest valid checkpoint (fail if there is none)")
    resume.add_argument("--no-resume", dest="resume", action="store_false",
                        help="start over even when the run dir holds checkpoints")
    train.add_argument("--verify", choices=["sizes", "full"],
                       help="how resume checks a checkpoint against its manifest: file sizes, or full (sizes and "
                            "xxh3 hash of every byte; default: checkpoint.verify)")
    train.add_argument("--on-oom", choices=["stop", "retry"],
                       help="after an OOM post-mortem: stop (exit 1), or restart from the newest checkpoint "
                            "with safer settings (sets memory.on_oom; several ranks: under torchrun --max-restarts N)")
    train.set_defaults(run=cmd_train)

    doctor = verbs.add_parser("doctor", help="explain a run's memory (report.html), check the machine (--system), "
                                             "or write a reproduction script (--repro)")
    doctor.add_argument("run_dir", nargs="?", metavar="RUN_DIR",
                        help="a zerofit run directory, or an HF Trainer output_dir with MemoryGuardCallback")
    doctor.add_argument("--out", metavar="FILE", help="where report.html (or with --repro, the script) goes "
                                                      "(default: inside RUN_DIR)")
    doctor.add_argument("--system", action="store_true", help="check this machine: GPU, driver, RAM, ulimit -l, "
                                                              "NVMe direct I/O, libaio / async_io")
    doctor.add_argument("--nvme-path", metavar="DIR", help="with --system: measure direct-I/O bandwidth here")
    doctor.add_argument("--nvme-mib", type=int, default=NVME_TEST_MIB, metavar="N",
                        help="with --nvme-path: MiB to write/read")
    doctor.add_argument("--repro", action="store_true", help="write a standalone reproduction script for RUN_DIR")
    doctor.add_argument("--hashes", action=argparse.BooleanOptionalAction, default=True,
                        help="verify the checkpoints as a resume does, every file's xxh3 hash until the newest intact "
                             "one (default; --no-hashes: sizes only, faster on large checkpoints)")
    doctor.set_defaults(run=cmd_doctor, verb_parser=doctor)  # its usage errors show its own usage

    plan = verbs.add_parser("plan", help="predict GPU, host and disk peaks and choose the fastest DeepSpeed config that fits")
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="M", help="preset, config.json or model directory")
    source.add_argument("--config", metavar="FILE", help="a zerofit run config to plan")
    source.add_argument("--presets", action="store_true", help="list the model presets (random init from a config)")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                      help="override one config key (repeatable)")
    add_hardware_args(plan)
    plan.add_argument("--grad-accum", type=int, metavar="N", help="micro batches per optimizer step")
    plan.add_argument("--global-batch", type=int, metavar="N", help="sequences per optimizer step, all ranks")
    plan.add_argument("--precision", choices=["bf16", "fp16", "fp32"])
    plan.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None)
    plan.add_argument("--stage", type=int, choices=[0, 1, 2, 3])
    plan.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"])
    plan.add_argument("--offload-param", choices=["none", "cpu", "nvme"])
    plan.add_argument("--nvme-path", metavar="DIR", help="NVMe directory (makes NVMe offload a candidate)")
    plan.add_argument("--nvme-free", metavar="SIZE", type=size,
                      help="free space at --nvme-path for the swap files, e.g. 2TB (default: measured there, on this "
                      "machine); a disk of its own, apart from the checkpoints'")
    plan.add_argument("--headroom", type=float, metavar="F", help=f"fraction of each budget kept free (default {DEFAULT_HEADROOM})")
    plan.add_argument("--explain", action="store_true", help="show the cost terms and the candidates")
    plan.add_argument("--ds-config", metavar="FILE", help="write the plan's DeepSpeed config for HF Trainer / "
                      "LLaMA-Factory (deepspeed=FILE; the keys the Trainer fills are \"auto\")")
    plan.set_defaults(run=cmd_plan)

    lint = verbs.add_parser("lint", help="validate a DeepSpeed JSON with DeepSpeed's own schema; flag risky values")
    lint.add_argument("file", metavar="DS_CONFIG_JSON")
    lint.add_argument("--model", metavar="M", help="preset, config.json or model directory: also plan the config")
    add_hardware_args(lint)
    lint.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                      help="HF Trainer's --gradient_checkpointing (default: planned with it)")
    lint.add_argument("--lora-rank", type=at_least(1), metavar="R", help="plan a peft LoRA run of rank R")
    lint.add_argument("--lora-targets", metavar="NAMES", type=lambda v: [n.strip() for n in v.split(",") if n.strip()],
                      help="its target modules, comma-separated (default: the architecture's, as zerofit's lora)")
    lint.set_defaults(run=cmd_lint)

    config = verbs.add_parser("config", help="print the resolved config, or --example for every key")
    add_config_args(config)
    config.add_argument("--example", action="store_true", help="every key with its default and doc")
    config.add_argument("--from-llamafactory", metavar="FILE",
                        help="print a LLaMA-Factory training YAML (its dataset_info.json read from dataset_dir) as "
                             "zerofit's config, their defaults written out where zerofit's differ; --set applies "
                             "on top")
    config.set_defaults(run=cmd_config)

    export = verbs.add_parser("export", help="ZeRO-3 checkpoint -> Hugging Face safetensors model, under a RAM cap")
    export.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a run directory (its newest complete checkpoint) or one checkpoint directory")
    export.add_argument("--out", required=True, metavar="DIR", help="the model directory to write")
    export.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="weights dtype (bf16)")
    export.add_argument("--max-ram", metavar="SIZE", type=size,
                        help=f"peak host RAM of the export process (default {human_bytes(EXPORT_MAX_RAM_BYTES)}; it reads "
                        f"in blocks that fit)")
    export.add_argument("--shard-size", metavar="SIZE", type=size, help="largest safetensors file (default 5GB)")
    export.add_argument("--verify", action="store_true",
                        help="load the export and compare its logits with DeepSpeed's own reconstruction; for "
                             "LoRA with peft's merge_and_unload of the same weights (holds the model twice in RAM); "
                             "an export that fails it is not published")
    export.add_argument("--overwrite", action="store_true", help="replace an earlier export at --out (a model or adapter directory)")
    export.add_argument("--model-dir", metavar="DIR",
                        help="config.json + tokenizer (default: RUN_DIR/model, or next to a DeepSpeed checkpoint)")
    export.add_argument("--adapter-only", action="store_true",
                        help="LoRA runs: write a peft adapter directory (chat/generate run it on its base) "
                             "instead of merging the adapters into the base")
    export.add_argument("--base", metavar="DIR",
                        help="LoRA runs: the base model directory, when it is no longer at the run's model.path "
                             "(it must be the same weights: its fingerprint is checked)")
    export.add_argument("--hashes", action=argparse.BooleanOptionalAction, default=True,
                        help="check the checkpoint's file hashes (xxh3 of every byte, as a resume does), not only "
                             "sizes, before reading: a damaged checkpoint is skipped for the newest good one "
                             "(default; --no-hashes: sizes only, faster)")
    add_trust_remote_code(export)
    export.set_defaults(run=cmd_export)

    generate = verbs.add_parser("generate", help="complete a prompt with a model directory, within a GPU budget")
    add_inference_args(generate)
    prompts = generate.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", metavar="TEXT", help="the text to continue (no chat template)")
    prompts.add_argument("--prompts-file", metavar="FILE",
                         help="many prompts, generated in batches: one per line, or JSONL with a \"prompt\" key")
    generate.add_argument("--batch-size", type=at_least(1), default=8, metavar="N",
                          help="prompts generated together with --prompts-file (8)")
    generate.add_argument("--out", metavar="FILE", help="with --prompts-file: write the JSONL here (default: stdout)")
    generate.set_defaults(run=run_generate)

    chat = verbs.add_parser("chat", help="interactive chat (the tokenizer's chat template, streamed tokens)")
    add_inference_args(chat)
    chat.set_defaults(run=cmd_chat)
    return parser


def run_generate(args) -> int:
    """One --prompt (verbs.cmd_generate), or a --prompts-file in batches (infer.cmd_generate_prompts)."""
    if args.prompts_file:
        from zerofit.infer.generate import cmd_generate_prompts

        return cmd_generate_prompts(args)
    return cmd_generate(args)


def check_doctor_arguments(parser, args) -> None:
    """doctor's three modes take their own arguments: a mix is a usage error, not one ignored."""
    if args.system and (args.run_dir or args.repro):
        parser.error("doctor --system checks this machine; it takes no RUN_DIR or --repro (run those separately)")
    if not args.system and not args.run_dir:
        parser.error("doctor needs RUN_DIR (or --system)")
    if not args.system and (args.nvme_path or args.nvme_mib != NVME_TEST_MIB):
        parser.error("--nvme-path and --nvme-mib go with doctor --system")


# the arguments that name files or directories: `~` and $VARIABLES expanded, as in a config (a
# quoted "~/models/my out" was a directory named `~` in the working directory)
PATH_ARGUMENTS = ("config", "run_dir", "model_dir", "out", "nvme_path", "model", "ds_config", "file",
                  "from_llamafactory", "source", "base", "prompts_file")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in PATH_ARGUMENTS:
        if isinstance(getattr(args, name, None), str):
            setattr(args, name, expand_path(getattr(args, name)))
    if args.verb == "doctor":
        check_doctor_arguments(args.verb_parser, args)
    try:
        return args.run(args)
    except ZerofitError as e:
        print(f"zerofit: error: {e}", file=sys.stderr)
        return end_after_error(1)
    except KeyboardInterrupt:
        print("zerofit: interrupted", file=sys.stderr)
        return end_after_error(130)
    except TerminatedOutsideTheLoop as e:
        print(f"zerofit: {e}", file=sys.stderr)
        return end_after_error(143)

