"""`zerofit <verb>`: the verbs are registered here and nothing else happens here.

Exit codes: 0 success; 1 a user error (config, data, files, memory) with a one-line reason
first; 2 bad usage (argparse).
"""
from __future__ import annotations

import argparse
import sys

from zerofit.config import Config, ConfigError, Section


def config_help() -> str:
    """Every config key and its doc, for `zerofit train --help` (generated, never stale)."""
    lines = ["config keys (YAML sections, or --set section.key=value):"]
    for name, field in Config.model_fields.items():
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, Section)):
            lines.append(f"  {name}: {field.description}")
            continue
        for key, sub in section.model_fields.items():
            doc = " ".join((sub.description or "").split())
            lines.append(f"  {name}.{key} = {sub.default!r}: {doc}" if sub.default is not None
                         else f"  {name}.{key}: {doc}")
    return "\n".join(lines)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: the embedded demo)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set train.lr=3e-4 (repeatable)")
    parser.add_argument("--run-dir", metavar="DIR", help="run directory (overrides run_dir)")


def load_config(args) -> Config:
    from zerofit.config import load

    overrides = list(args.overrides) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
    if getattr(args, "on_oom", None):
        overrides.append(f"memory.on_oom={args.on_oom}")
    return load(args.config, overrides)


# ---------------------------------------------------------------------------- verbs
def cmd_train(args) -> int:
    from zerofit.train import train

    train(load_config(args), resume=args.resume)
    return 0


def cmd_config(args) -> int:
    from zerofit.config import dump_yaml, example_yaml

    print(example_yaml() if args.example else dump_yaml(load_config(args)), end="")
    return 0


def cmd_doctor(args) -> int:
    if args.system:
        from zerofit.syscheck import check_system, print_checks

        checks = check_system(args.nvme_path, args.nvme_mib)
        print_checks(checks)
        return 1 if any(c.status == "fail" for c in checks) else 0
    if args.repro:
        from zerofit.repro import write_repro

        print(f"reproduction script: {write_repro(args.run_dir, args.out)}")
        return 0
    from zerofit.doctor import doctor

    doctor(args.run_dir, args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerofit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"zerofit {__import__('zerofit').__version__}")
    # The deepspeed launcher passes --local_rank=N before the verb (it also sets LOCAL_RANK).
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    train = verbs.add_parser("train", help="plan, then train on DeepSpeed ZeRO (no arguments: the embedded demo)",
                             epilog=config_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(train)
    resume = train.add_mutually_exclusive_group()
    resume.add_argument("--resume", dest="resume", action="store_true", default=None,
                        help="continue from the newest valid checkpoint (fail if there is none)")
    resume.add_argument("--no-resume", dest="resume", action="store_false",
                        help="start over even when the run dir holds checkpoints")
    train.add_argument("--on-oom", choices=["stop", "retry"],
                       help="after an OOM post-mortem: stop (exit 1), or restart from the newest checkpoint "
                            "with safer settings (sets memory.on_oom)")
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
    doctor.add_argument("--nvme-mib", type=int, default=256, metavar="N", help="with --nvme-path: MiB to write/read")
    doctor.add_argument("--repro", action="store_true", help="write a standalone reproduction script for RUN_DIR")
    doctor.set_defaults(run=cmd_doctor)

    config = verbs.add_parser("config", help="print the resolved config, or --example for every key")
    add_config_args(config)
    config.add_argument("--example", action="store_true", help="every key with its default and doc")
    config.set_defaults(run=cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb == "doctor" and not args.system and not args.run_dir:
        parser.error("doctor needs RUN_DIR (or --system)")
    try:
        return args.run(args)
    except ConfigError as e:
        print(f"zerofit: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("zerofit: interrupted", file=sys.stderr)
        return 130
