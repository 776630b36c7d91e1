"""LLaMA-Factory's datasets as zerofit's data section: the `dataset` / `eval_dataset` names
looked up in dataset_info.json (data/parser.py: file_name, formatting, columns, tags; an
entry's `columns` names every column read, system / history / tools only when named),
val_size, packing and max_samples (hparams/data_args.py). Pure but for `read_dataset_info`;
lfconfig.translate calls `data_section`."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerofit.config.data import OPTIONAL_FIELDS, column_fields
from zerofit.core.errors import ConfigError

if TYPE_CHECKING:
    from zerofit.integrations.llamafactory.config import Translation

# a turn's (speaker, text) keys zerofit reads, and per LLaMA-Factory tag the speaker names it reads
TURN_KEYS = {("from", "value"), ("role", "content")}
SPEAKERS = {"user_tag": {"human", "user"}, "assistant_tag": {"gpt", "assistant"}, "system_tag": {"system"},
            "observation_tag": {"observation", "tool"}, "function_tag": {"function_call"}}
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
# dataconfig.OPTIONAL_FIELDS under LLaMA-Factory's names (its query is zerofit's input)
OPTIONAL_KEYS = tuple({"input": "query"}.get(name, name) for name in OPTIONAL_FIELDS)


def names(value: Any) -> list[str]:
    """LLaMA-Factory's comma-separated names (`dataset: a,b`, `lora_target: q_proj,v_proj`) or a YAML list."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return [str(name) for name in value] if isinstance(value, list) else [] if value is None else [str(value)]


def data_section(lf: dict, out: Translation, stage: str, dataset_info: dict | None, dataset_dir: str) -> None:
    """data.path / eval_path from the dataset names, their format and columns, max_samples,
    packing and the hold-out."""
    if stage == "pt":
        out.set("data.format", "text", "stage: pt")
    if not names(lf.get("dataset")):
        out.refused.append("dataset: missing -- name the training data (dataset_info.json entries)")
    entries = {}
    for key, zerofit_key in (("dataset", "data.path"), ("eval_dataset", "data.eval_path")):
        listed = names(lf.get(key))
        if listed and dataset_info is None:
            out.refused.append(f"{key}: {', '.join(listed)} -- no dataset_info.json in {dataset_dir} (dataset_dir, read "
                               f"from the directory zerofit runs in, as LLaMA-Factory does): run from "
                               f"LLaMA-Factory's directory, or set dataset_dir")
            continue
        paths = []
        for name in listed:
            entry = _entry(name, dataset_info, dataset_dir, out)
            if entry is not None:
                paths.append(os.path.join(dataset_dir, entry["file_name"]))
                entries[name] = entry
        if paths:
            out.set(zerofit_key, paths if len(paths) > 1 else paths[0], f"{key} in {dataset_dir}/dataset_info.json")
        if key == "eval_dataset" and len(listed) > 1:
            out.notes.append(f"eval_dataset {', '.join(listed)} are evaluated as one eval set (LLaMA-Factory "
                             f"reports each)")
    if entries:
        (_pretraining_columns if stage == "pt" else _formats)(entries, out)
    if lf.get("mix_strategy", "concat") != "concat":
        out.refused.append(f"mix_strategy: {lf['mix_strategy']} -- zerofit concatenates the datasets (concat)")
    if "max_samples" in lf:
        out.set("data.max_samples", lf["max_samples"], "max_samples")
    _packing(lf, out, stage)
    _hold_out(lf, out)


def _entry(name: str, dataset_info: dict, dataset_dir: str, out: Translation) -> dict | None:
    """The dataset_info.json entry `name`, when zerofit can read its files."""
    entry = dataset_info.get(name)
    if not isinstance(entry, dict):
        out.refused.append(f"dataset {name}: not in {dataset_dir}/dataset_info.json")
        return None
    hub = next((entry[k] for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url") if k in entry), None)
    if hub is not None:
        out.refused.append(f"dataset {name}: a hub dataset ({hub}) and nothing downloads at run time: download it "
                           f"once (`hf download {hub} --repo-type dataset --local-dir DIR`), then name the files "
                           f"in its entry's file_name (or in data.path)")
        return None
    if not isinstance(entry.get("file_name"), str):
        out.refused.append(f"dataset {name}: its entry has no file_name (a file or directory under dataset_dir)")
        return None
    if entry["file_name"].endswith((".csv", ".txt", ".arrow")):
        out.refused.append(f"dataset {name}: {entry['file_name']} -- zerofit reads .json, .jsonl and .parquet files "
                           f"(and directories of them): convert it (`datasets.load_dataset(...).to_json(FILE)`)")
        return None
    for key, kind in (("columns", dict), ("tags", dict), ("formatting", str)):
        if key in entry and not isinstance(entry[key], kind):
            out.refused.append(f"dataset {name}: its {key} must be a {'mapping' if kind is dict else 'name'}, "
                               f"got {entry[key]!r}")
            return None
    if entry.get("formatting", "alpaca") not in ("alpaca", "sharegpt"):
        out.refused.append(f"dataset {name}: formatting {entry['formatting']} -- LLaMA-Factory's are alpaca and "
                           f"sharegpt (OpenAI's messages are sharegpt with role/content tags)")
        return None
    columns = entry.get("columns", {})
    if entry.get("ranking") or {"chosen", "rejected", "kto_tag"} & set(columns):
        out.refused.append(f"dataset {name}: preference data (ranking, chosen/rejected) is for DPO and reward "
                           f"models, which zerofit does not train")
        return None
    if {"images", "videos", "audios"} & set(columns):
        out.refused.append(f"dataset {name}: images, videos and audio are not offered (text models only)")
        return None
    if entry.get("num_samples"):
        out.refused.append(f"dataset {name}: num_samples {entry['num_samples']} (LLaMA-Factory resamples the "
                           f"dataset to that size) is not offered: drop it, or set max_samples for the first rows")
    return entry


def _pretraining_columns(entries: dict[str, dict], out: Translation) -> None:
    """Stage pt reads each entry's `prompt` column (dataset_info's {prompt: text} in its demos)."""
    named = {entry.get("columns", {}).get("prompt", "text") for entry in entries.values()}
    if len(named) > 1:
        out.refused.append(f"datasets {', '.join(entries)}: their text is in columns {', '.join(sorted(named))}; "
                           f"data.columns maps one name per field: rename the files' columns to one")
    elif named != {"text"}:
        out.set("data.columns", {"text": named.pop()}, "columns.prompt in dataset_info.json (stage pt's text)")


def _formats(entries: dict[str, dict], out: Translation) -> None:
    """data.format and data.columns from the entries' formatting, columns and tags: what each
    entry names read from its column, the optional fields it does not name left unread."""
    formats, columns = set(), {}
    for name, entry in entries.items():
        formatting = entry.get("formatting", "alpaca")
        tags = {**SHAREGPT_TAGS, **entry.get("tags", {})}
        if formatting == "sharegpt" and not _readable_turns(tags):
            out.refused.append(f"dataset {name}: tags {entry['tags']} -- zerofit reads turns as {{from, value}} or "
                               f"{{role, content}}, speakers human/user, gpt/assistant, system, observation/tool and "
                               f"function_call: rename the file's")
            continue
        formats.add("messages" if formatting == "sharegpt" and tags["role_tag"] == "role" else formatting)
        for key, column in _read_columns(formatting, entry.get("columns")).items():
            known = columns.setdefault(key, column)
            if column is not None and known is not None and known != column:
                out.refused.append(f"dataset {name}: its {key} column is {column}, another dataset's "
                                   f"{known}: data.columns maps one name per field; rename one file's")
            elif known is None and column is not None or column is None and known is not None:
                columns[key] = known or column  # read where one entry names it
                out.notes.append(f"dataset {name}: its {key} is read from a {known or column} column where a "
                                 f"file has one (another dataset's entry names it; LLaMA-Factory reads it only "
                                 f"for that one)")
    fmt = formats.pop() if len(formats) == 1 else "auto"
    if fmt != "auto":
        out.set("data.format", fmt, "formatting in dataset_info.json")
    own = column_fields(fmt)  # a column under the field's own name needs no mapping
    mapped = {key: column for key, column in columns.items() if column != own[key]}
    if mapped:
        out.set("data.columns", mapped, "columns in dataset_info.json; null: a column it does not name, which "
                                        "LLaMA-Factory does not read")


def _readable_turns(tags: dict) -> bool:
    return (tags["role_tag"], tags["content_tag"]) in TURN_KEYS and \
        all(tags[tag] in speakers for tag, speakers in SPEAKERS.items())


def _read_columns(formatting: str, columns: dict | None) -> dict[str, str | None]:
    """The columns LLaMA-Factory reads of an entry (data/parser.py, DatasetAttr): named ones;
    else prompt, query, response (alpaca) or messages (sharegpt) under their default names, and
    system, tools, history not at all."""
    if formatting == "alpaca":
        read = {"prompt": "instruction", "query": "input", "response": "output", "history": None} if columns is None \
            else {key: columns.get(key) for key in ("prompt", "query", "response", "history")}
    else:
        read = {"messages": "conversations"} if columns is None else {"messages": columns.get("messages")}
    read |= {key: (columns or {}).get(key) for key in ("system", "tools")}
    # a required column it does not name: zerofit's default name (LLaMA-Factory's reads nothing)
    return {key: column for key, column in read.items() if column is not None or key in OPTIONAL_KEYS}


def _packing(lf: dict, out: Translation, stage: str) -> None:
    if lf.get("neat_packing"):  # LLaMA-Factory: neat_packing sets packing
        if stage == "pt":
            out.refused.append("neat_packing: true -- LLaMA-Factory refuses it for stage pt")
        out.set("data.packing", True, "neat_packing: true (which packs)")
        out.set("data.neat_packing", True, "neat_packing")
    elif "packing" in lf:
        out.set("data.packing", lf["packing"], "packing")
    elif stage == "sft":
        out.set("data.packing", False, "LLaMA-Factory packs sft data only when packing: true")
    if lf.get("packing", stage == "pt") and "val_size" in lf:
        out.notes.append("val_size: LLaMA-Factory holds out packed rows of packed data; zerofit holds out examples "
                         "before packing")


def _hold_out(lf: dict, out: Translation) -> None:
    """val_size as LLaMA-Factory reads it (data_utils.split_dataset): above 1 a count of
    examples, an integer 1 one example, below 1 a fraction."""
    size = lf.get("val_size", 0)
    if "eval_dataset" in lf:
        if size:  # LLaMA-Factory: "Cannot specify `val_size` if `eval_dataset` is not None."
            out.refused.append(f"val_size: {size} beside eval_dataset -- LLaMA-Factory refuses the two together: "
                               f"drop one")
        return
    if size > 1 or size == 1 and isinstance(size, int):
        out.set("data.eval_examples", int(size), "val_size (a count)")
    elif 0 < size < 1:
        if size >= 0.5:
            out.refused.append(f"val_size: {size} -- zerofit holds out less than half of the rows (data.eval_fraction "
                               f"< 0.5): lower it, or give eval_dataset")
        out.set("data.eval_fraction", size, "val_size")
        out.notes.append(f"val_size {size}: LLaMA-Factory rounds the number of rows held out up, zerofit down (at "
                         f"most one fewer; data.eval_examples holds out an exact count)")
    elif size:
        out.refused.append(f"val_size: {size} -- holds out every row, none left to train on")
    else:
        out.set("data.eval_fraction", 0.0, "LLaMA-Factory's default val_size, 0: no hold-out")
        out.set("eval.at_end", False, "no eval set (val_size 0, no eval_dataset)")


def read_dataset_info(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); fix it, or set dataset_dir to another directory") from None
    if not isinstance(info, dict):
        raise ConfigError(f"{path} must hold a mapping of dataset names to entries, got {type(info).__name__}")
    return info
