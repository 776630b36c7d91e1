"""What a run directory holds besides its checkpoints and records: the directory itself (made,
writable, its subdirectories not files), config.yaml as resolved, ds_config.json, plan.json,
and model/ (the HF config, the tokenizer with the template the data trained, and a
generation_config.json where the template's turn end is not EOS) that exports and chat read.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from zerofit import models
from zerofit.config.load import dump_yaml
from zerofit.config.schema import UNRECORDED, Config, changed_settings
from zerofit.core.console import say
from zerofit.core.errors import ConfigError
from zerofit.core.files import write_atomic
from zerofit.data import chatlayout
from zerofit.plan import render


def usable_run_dir(run_dir: Path) -> Path:
    """The run directory, made if need be; one that cannot be is a user error, said first. One
    inside another run's checkpoints/ (a checkpoint given as the run) is refused: a new run
    written there would be deleted by that run's retention."""
    owner = checkpoints_owner(run_dir)
    if owner is not None:
        raise ConfigError(f"run_dir {run_dir} is inside the checkpoints of the run {owner}, not a run directory: "
                          f"resume that run with --run-dir {owner} (it loads the newest checkpoint that verifies), "
                          f"export a checkpoint with `zerofit export {run_dir}`, or set run_dir to a directory of "
                          f"its own")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "it is a file" if run_dir.is_file() else e.strerror or str(e)
        raise ConfigError(f"run_dir {run_dir} cannot be made ({why}); set run_dir (or --run-dir) to a "
                          f"directory you can write") from None
    if not os.access(run_dir, os.W_OK):
        raise ConfigError(f"run_dir {run_dir} is not writable (a read-only filesystem or another user's "
                          f"directory); set run_dir (or --run-dir) to a directory you can write")
    for name in RUN_SUBDIRECTORIES:
        if (run_dir / name).exists() and not (run_dir / name).is_dir():
            raise ConfigError(f"{run_dir / name} is a file where the run keeps its {name}/ directory; move it "
                              f"away, or set run_dir (or --run-dir) to another directory")
    return run_dir


RUN_SUBDIRECTORIES = ("checkpoints", "model", "postmortem")  # what a run makes inside its run_dir
RUN_FILES = ("config.yaml", "plan.json", "ds_config.json")  # written at every start (write_run_files)
# What describes a run's checkpoints besides their files: the model directory an export reads (the
# HF config, the tokenizer and its chat template) and the config they were trained under.
RUN_DESCRIPTION = ("model", *RUN_FILES)


def checkpoints_owner(path: Path) -> Path | None:
    """The run whose checkpoints/ holds `path` (a `step-N`, an `earlier-*`, a file in one), if any."""
    for directory in [path.absolute(), *path.absolute().parents]:
        if directory.name == "checkpoints" and all((directory.parent / name).is_file() for name in RUN_FILES):
            return directory.parent
    return None


def changed_unrecorded(run_dir: Path, config: Config) -> list[str]:
    """`section.key old -> new` for the UNRECORDED settings that differ from the run's last start
    (its config.yaml, before write_run_files replaces it); none where there is no readable one."""
    try:
        before = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return []
    if not isinstance(before, dict):
        return []
    after = config.model_dump(mode="json")
    return changed_settings({key: before.get(key) or {} for key in UNRECORDED}, {key: after[key] for key in UNRECORDED})


def write_run_files(run_dir: Path, config: Config, ds_config: dict, tokenizer, hf_config, plan: dict,
                    chat_template: str | None = None) -> None:
    """config.yaml (resolved, with the planner's choices), ds_config.json (what DeepSpeed
    gets), plan.json (the prediction) and model/ (the HF config and tokenizer an export needs,
    the tokenizer with `chat_template`, the layout the data trained, when given)."""
    # whole or not at all: a start killed mid-write left an empty config.yaml, the file the resume hints name
    render.write_plan(run_dir, plan)  # the run dir was made first thing (usable_run_dir)
    write_atomic(run_dir / "config.yaml", dump_yaml(config))
    write_atomic(run_dir / "ds_config.json", json.dumps(ds_config, indent=2))
    hf_config.save_pretrained(run_dir / "model")
    own_template = tokenizer.chat_template
    written = run_dir / "model" / "chat_template.jinja"  # as transformers saves it: said once, not at each resume
    if chat_template and chat_template != own_template and not (written.is_file() and written.read_text() == chat_template):
        say(f"model/: the tokenizer's chat template is now the layout the data trains "
            f"({'alpaca' if chat_template == chatlayout.ALPACA_CHAT_TEMPLATE else 'role: text'}), so chat and "
            f"exports prompt the model as it learned")
    tokenizer.chat_template = chat_template or own_template
    if not tokenizer.chat_template:  # save_pretrained leaves an earlier run's template file, which exports would carry
        for stale in ("chat_template.jinja", "chat_template.json"):
            (run_dir / "model" / stale).unlink(missing_ok=True)
    try:
        tokenizer.save_pretrained(run_dir / "model")
    finally:
        tokenizer.chat_template = own_template


def generation_ends(config: Config, tokenizer, formats: tuple[str, ...]) -> set[int]:
    """The tokens generation stops at: model.path's generation config's, and the special token that
    ends the template's assistant turn where that is not EOS (chatlayout.turn_end_id)."""
    end = chatlayout.turn_end_id(tokenizer, formats, config.data.alpaca_template)
    return models.generation_eos(config.model) | ({end} if end is not None else set())


def write_generation_config(run_dir: Path, config: Config, tokenizer, hf_config, formats: tuple[str, ...]) -> None:
    """model/generation_config.json listing the template's turn end among the end tokens, where
    the rows learn to end their answers with it and not EOS (Llama-3's <|eot_id|> under
    model.chat_template: llama3 on a base model, whose EOS is <|end_of_text|>): exports, `zerofit
    chat`, transformers' generate and vLLM stop there, as LLaMA-Factory's replacing EOS with it
    makes theirs stop. Otherwise none (an export writes config.json's end tokens)."""
    path = run_dir / "model" / "generation_config.json"
    end = chatlayout.turn_end_id(tokenizer, formats, config.data.alpaca_template)
    config_eos = hf_config.eos_token_id if isinstance(hf_config.eos_token_id, list) else [hf_config.eos_token_id]
    ends = models.generation_eos(config.model) or {*config_eos, tokenizer.eos_token_id} - {None}
    if end is None or end in ends:
        path.unlink(missing_ok=True)  # an earlier start's, for rows laid out otherwise
        return
    text = json.dumps({**model_generation_fields(config, hf_config), "eos_token_id": sorted(ends) + [end]},
                      indent=2) + "\n"
    if not (path.is_file() and path.read_text() == text):  # said once, not at each resume
        write_atomic(path, text)
        say(f"model/generation_config.json: generation also stops at {tokenizer.convert_ids_to_tokens(end)} "
            f"(id {end}), which ends the template's assistant turn (not EOS), as the rows learn it")


def model_generation_fields(config: Config, hf_config) -> dict:
    """model.path's generation_config.json (its sampling defaults too), else the HF config's BOS
    and padding ids; a file that is not JSON counts as none (models.generation_eos reads it so)."""
    own = Path(config.model.path or "") / "generation_config.json"
    if config.model.path and own.is_file():
        try:
            fields = json.loads(own.read_text())
            if isinstance(fields, dict):
                return fields
        except (OSError, ValueError):
            pass
    return {key: getattr(hf_config, key) for key in ("bos_token_id", "pad_token_id")
            if getattr(hf_config, key, None) is not None}
