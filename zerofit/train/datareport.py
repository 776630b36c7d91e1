"""The data line a run's start says (rank 0): examples and sequences, where the eval set comes
from, which tokens are learned, the layout; and the warnings about the data: columns and files
not read, rows skipped or cut, an empty eval set, a chat template the rows do not use.
"""
from __future__ import annotations

from zerofit.config.schema import Config
from zerofit.core.console import counted, say, warn
from zerofit.data import chatlayout, files
from zerofit.data import pipeline as data
from zerofit.train import runfiles


def report_data(train_set: data.Sequences, eval_set: data.Sequences, config: Config, tokenizer) -> None:
    laid_out = chatlayout.layouts(train_set.formats, tokenizer, config.data.alpaca_template)
    held = f"{eval_set.examples}{max_samples_note(config, eval_set, 'data.eval_path') or ' from data.eval_path'}" \
        if config.data.eval_path else f"{eval_set.examples} held out ({held_out_by(config)})"
    say(f"data: {train_set.examples} examples{max_samples_note(config, train_set, 'data.path')}, eval {held} -> "
        f"{len(train_set)} train / {len(eval_set)} eval sequences, {train_set.trained_tokens} tokens learned per "
        f"epoch{learned_note(config)}, {train_set.layout_note()}"
        f"{f'; {laid_out}' if laid_out else ''}")
    if config.data.eval_path and "eval_fraction" in config.data.model_fields_set:
        warn(f"data.eval_fraction {config.data.eval_fraction} is not used: the eval set is data.eval_path")
    for name, sequences in (("", train_set), ("eval ", eval_set)):  # eval: data.eval_path's own rows
        if sequences.unread_columns:
            warn(f"not read: {'; '.join(sequences.unread_columns[:3])}"
                 f"{f' and in {len(sequences.unread_columns) - 3} more files' if len(sequences.unread_columns) > 3 else ''}")
        if sequences.skipped_rows:
            warn(f"skipped {counted(sequences.skipped_rows, f'bad {name}row')} (data.skip_bad_rows), e.g. "
                 f"{sequences.skipped_reasons[0]}")
    for directory in files.unread_splits(config.data.path, config.data.eval_path):
        warn(f"a saved DatasetDict is read by its train split: not read {directory}; name a split's "
             f"directory (DIR/<split>) in data.path or data.eval_path to read it")
    left_out = files.left_out_files(config.data.path, config.data.eval_path)
    if left_out:
        warn(f"not read (zerofit reads .jsonl, .json, .parquet and saved datasets): "
             f"{', '.join(map(files.shown_left_out, left_out[:5]))}"
             f"{f' and {len(left_out) - 5} more' if len(left_out) > 5 else ''}")
    if train_set.prompt_only_rows:
        warn(train_set.dropped_note(config.train.seq_len))
    for name, sequences in (("", train_set), ("eval set: ", eval_set)):
        if sequences.cut[0]:
            warn(name + sequences.cut_note(config.train.seq_len))
    if config.model.chat_template and chatlayout.trained_chat_template(train_set.formats, tokenizer,
                                                                         config.data.alpaca_template) is not None:
        warn(f"model.chat_template is not what the rows are laid out by ({laid_out or 'text rows'}), so the run's "
             f"tokenizer and exports carry that layout instead")
    ends = runfiles.generation_ends(config, tokenizer, train_set.formats)
    stop = chatlayout.stop_problem(tokenizer, train_set.formats, ends,
                                   config.data.alpaca_template)
    if stop:
        warn(stop)
    if not len(eval_set) and (config.eval.every_steps or config.eval.at_end):
        fix = "none of data.eval_path's rows holds an answer to learn" if config.data.eval_path else \
            f"raise {held_out_key(config)}, or set data.eval_path"
        warn(f"the eval set is empty: no eval loss will be measured ({fix})")


def learned_note(config: Config) -> str:
    """Which tokens the data line's `tokens learned` are, where not only the answers."""
    if config.data.train_on_prompt:
        return " (the prompts too: data.train_on_prompt)"
    return " (each conversation's last answer only: data.mask_history)" if config.data.mask_history else ""


def held_out_key(config: Config) -> str:
    """The key that says how many training rows are held out."""
    return "data.eval_fraction" if config.data.eval_examples is None else "data.eval_examples"


def held_out_by(config: Config) -> str:
    """held_out_key with its value."""
    key = held_out_key(config)
    return f"{key} {getattr(config.data, key.removeprefix('data.'))}"


def max_samples_note(config: Config, sequences: data.Sequences, key: str) -> str:
    """What data.max_samples left of `key`'s rows, for the data line; "" when it cut none."""
    return f" from the first {config.data.max_samples} rows of each {key} entry (data.max_samples)" \
        if sequences.capped else ""
