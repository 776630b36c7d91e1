"""Local files -> tokenized, loss-masked, packed (or padded) sequences -> per-rank batches.

The stages: datafiles (files -> rows, through HF `datasets`), tokenizing (rows -> examples,
prompts masked so only answers are learned), rowlayout (examples cut to seq_len, relabelled
where data.train_on_prompt / mask_history learn other tokens, laid out in rows); here the
train/eval split, the Sequences they make, and the batches. The batch order is a pure
function of (seed, position): a resumed run continues the very same stream, on any number
of ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from zerofit.config.data import DataConfig
from zerofit.core.console import HIDDEN, Shown
from zerofit.data import cache
from zerofit.data.files import DataError, data_entries
from zerofit.data.rows import (
    isolate_examples,
    pack,
    packing_layout,
    pad,
    relabelled,
    rows_of_whole_examples,
    tail_padding,
    truncated,
)
from zerofit.data.tokenize import IGNORE, Read, read_examples
from zerofit.demo import DEMO_DATA


@dataclass
class Sequences:
    """Fixed-length training rows: token ids and labels, both [n, seq_len] int arrays."""
    input_ids: np.ndarray
    labels: np.ndarray
    skipped_rows: int = 0
    skipped_reasons: list[str] = field(default_factory=list)
    prompt_only_rows: int = 0     # rows of seq_len tokens without one answer token: nothing to learn
    longest_example: int = 0      # tokens of the longest example, for the advice on seq_len
    formats: tuple[str, ...] = ()  # the row formats read (text | alpaca | messages), for the chat template
    lengths: np.ndarray | None = None  # per row, the tokens before its padding (None: concatenated, all seq_len)
    positions: np.ndarray | None = None  # data.neat_packing: per token, its place in its example within the row
    cut: tuple[int, int, int] = (0, 0, 0)  # `truncated`'s (examples cut to seq_len, answer, prompt tokens lost)
    layout: str = "concatenated"  # packing_layout (padded | whole | concatenated), or synthetic
    truncation: str = "balanced"  # data.truncation, which made `cut`
    examples: int = 0             # the examples (rows read and tokenized) the sequences were laid out from
    capped: bool = False          # data.max_samples cut the rows read: some entry gave that many
    unread_columns: list[str] = field(default_factory=list)  # left out: data.columns names another for the field

    @property
    def packed(self) -> bool:
        """data.packing: what a prompt-only row is, and the advice about it."""
        return self.layout != "padded"

    def cut_note(self, seq_len: int) -> str:
        """What cutting examples to seq_len cost; "" when none was longer."""
        examples, answer_lost, prompt_lost = self.cut
        if not examples:
            return ""
        return (f"{examples} examples longer than train.seq_len {seq_len} were cut to it (data.truncation "
                f"{self.truncation}), losing {answer_lost} answer tokens and {prompt_lost} prompt tokens (the longest "
                f"example has {self.longest_example} tokens): raise train.seq_len to learn them whole")

    def dropped_note(self, seq_len: int) -> str:
        """Why `prompt_only_rows` rows were dropped and what would keep them; "" when none were."""
        if not self.prompt_only_rows:
            return ""
        rows = f"packed rows of {seq_len} tokens holding no answer token" if self.packed else \
            f"rows whose answer starts beyond train.seq_len {seq_len}"
        keep = "raise train.seq_len, or set data.truncation: balanced (a long prompt is cut, its answer kept)" \
            if self.truncation == "head" else "raise train.seq_len"
        return (f"dropped {self.prompt_only_rows} {rows} (the longest example has {self.longest_example} tokens): "
                f"{keep} to learn from them")

    def layout_note(self) -> str:
        """How the examples fill the rows, for the data line: `packed whole (3.1% padding)`."""
        said = {"concatenated": "examples concatenated into rows", "synthetic": "random tokens, every one learned",
                "whole": "examples packed whole", "padded": "one example per row"}[self.layout]
        if self.lengths is None or not len(self):  # no rows (every one dropped): no padding share
            return said
        return f"{said} ({1 - self.lengths.sum() / self.input_ids.size:.1%} padding)"

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def trained_tokens(self) -> int:
        """The labels the loss counts (`targets`: a row's first label is never predicted)."""
        return targets(self.labels)


def to_sequences(examples: list, cfg: DataConfig, tokenizer, seq_len: int, skipped: int = 0,
                 reasons: list[str] = (), formats: tuple[str, ...] = (), keep_tail: bool = False,
                 capped: bool = False, unread: list[str] = ()) -> Sequences:
    """Packed or padded rows of the examples (packing_layout), cut to seq_len and relabelled
    (rowlayout.truncated, relabelled) first. Concatenating drops the tail that
    does not fill a row, unless `keep_tail` (an eval set: a small one would otherwise vanish),
    which pads it. `capped`: data.max_samples cut the rows they were read from; `unread`: the
    columns left out of them."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    longest, count = max((len(e_ids) for e_ids, _ in examples), default=0), len(examples)
    layout = packing_layout(cfg, formats)
    cut = (0, 0, 0)  # concatenating splits an example, cuts none
    if layout != "concatenated":
        examples, cut = truncated(examples, seq_len, cfg.truncation, last_first=cfg.mask_history)
    examples = relabelled(examples, cfg.train_on_prompt, cfg.mask_history)
    lengths = None  # concatenated rows: every token real
    if layout == "whole":
        examples, lengths = rows_of_whole_examples(examples, seq_len, pad_id)
    elif layout == "concatenated" and keep_tail:
        examples = examples + [tail_padding(examples, seq_len, pad_id)]
    ids, labels = pad(examples, seq_len, pad_id) if layout == "padded" else pack(examples, seq_len)
    positions = isolate_examples(examples, labels) if cfg.neat_packing else None
    # A row must hold a learned token past its first: the loss predicts token t+1 from t, so a label
    # at position 0 (an answer's last token spilled into the next packed row) is never counted,
    # and a row without another would make the mean loss 0/0, a NaN.
    learnable = targets(labels, per_row=True) > 0
    if layout == "padded":
        lengths = np.minimum([len(e_ids) for e_ids, _ in examples], seq_len).astype(np.int64)
    return Sequences(ids[learnable], labels[learnable], skipped, list(reasons), int((~learnable).sum()),
                     longest, formats,
                     lengths[learnable] if lengths is not None else None,
                     positions[learnable] if positions is not None else None, cut, layout, cfg.truncation,
                     count, capped, list(unread))


def build_sequences(files: list[Path] | list[list[Path]], cfg: DataConfig, tokenizer, seq_len: int,
                    keep_tail: bool = False, shown: Shown = HIDDEN) -> Sequences:
    """The sequences of the files (read_examples: paths, or per data.path entry a list of them)."""
    return sequences_of(read_examples(files, cfg, tokenizer, shown), cfg, tokenizer, seq_len, keep_tail)


def sequences_of(read: Read, cfg: DataConfig, tokenizer, seq_len: int, keep_tail: bool = False) -> Sequences:
    return to_sequences(read.examples, cfg, tokenizer, seq_len, read.skipped, read.reasons, read.formats, keep_tail,
                        read.capped, read.unread)


def synthetic_sequences(n: int, seq_len: int, vocab_size: int, seed: int) -> Sequences:
    """Random tokens, every one learned: for throughput benchmarks, not for learning."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, size=(n, seq_len), dtype=np.int64)
    return Sequences(ids, ids.copy(), layout="synthetic")


def load_splits(cfg: DataConfig, tokenizer, seq_len: int, seed: int, vocab_size: int, shown: Shown = HIDDEN,
                run_dir: Path | None = None, node: cache.Node | None = None) -> tuple[Sequences, Sequences]:
    """(train, eval) sequences. Eval is data.eval_path, else a seeded eval_fraction (or
    eval_examples) of the rows, split before packing so no example straddles the two, and
    after data.max_samples cut each entry (LLaMA-Factory's get_dataset splits after it).
    Tokenizing shows its progress as `shown` says; with `run_dir` the tokenized rows are kept
    for the next start (datacache: data.cache_dir, else RUN_DIR/data-cache), by one rank of
    each machine when a `node` of several ranks is given."""
    if cfg.path == "synthetic":
        full = synthetic_sequences(cfg.synthetic_samples, seq_len, vocab_size, seed)
        n_eval = held_out_count(cfg, len(full), "random sequences of data.synthetic_samples")
        return Sequences(full.input_ids[n_eval:], full.labels[n_eval:], layout=full.layout,
                         examples=len(full) - n_eval), \
            Sequences(full.input_ids[:n_eval], full.labels[:n_eval], layout=full.layout, examples=n_eval)

    entries = [[DEMO_DATA]] if cfg.path == "demo" else data_entries(cfg.path)
    examples, skipped, reasons, formats, capped, unread = cache.read(entries, cfg, tokenizer, run_dir, "train",
                                                                         shown, node)
    if cfg.eval_path:
        held_out = cache.read(data_entries(cfg.eval_path, "data.eval_path"), cfg, tokenizer, run_dir, "eval",
                                  shown, node)
        splits = (to_sequences(examples, cfg, tokenizer, seq_len, skipped, reasons, formats, capped=capped,
                               unread=unread),
                  sequences_of(held_out, cfg, tokenizer, seq_len, keep_tail=True))
    else:
        order = np.random.default_rng(seed).permutation(len(examples))
        n_eval = held_out_count(cfg, len(examples), "examples read")
        held, kept = np.sort(order[:n_eval]), np.sort(order[n_eval:])
        splits = (to_sequences([examples[i] for i in kept], cfg, tokenizer, seq_len, skipped, reasons, formats,
                               capped=capped, unread=unread),
                  to_sequences([examples[i] for i in held], cfg, tokenizer, seq_len, formats=formats, keep_tail=True))
    check_vocabulary(splits, len(tokenizer), vocab_size)
    return splits


def held_out_count(cfg: DataConfig, rows: int, what: str) -> int:
    """The rows held out for eval: data.eval_examples, else data.eval_fraction of `rows`. A
    count must leave rows to train on."""
    if cfg.eval_examples is None:
        return int(rows * cfg.eval_fraction)
    if cfg.eval_examples >= rows:
        cut = f" (data.max_samples {cfg.max_samples} kept the first rows of each entry)" if cfg.max_samples else ""
        raise DataError(f"data.eval_examples {cfg.eval_examples} would hold out all {rows} {what}{cut}, leaving none "
                        f"to train on: set it below {rows} (or use data.eval_fraction), or add data")
    return cfg.eval_examples


FINGERPRINT_SCHEME = "train:"  # the hash covers the training split's tokens only


def fingerprint(train_set: Sequences) -> str:
    """xxh3-128 of the training rows' token ids and labels: the same files, tokenizer and data
    settings give the same value, so a resume can tell that the data its position counts in
    changed (a few GB/s: seconds for a billion tokens). The eval split is not in it: another
    eval set leaves the position meaning what it did."""
    import xxhash

    digest = xxhash.xxh3_128()
    for array in (train_set.input_ids, train_set.labels):
        digest.update(np.ascontiguousarray(array).data)
    return FINGERPRINT_SCHEME + digest.hexdigest()


def check_vocabulary(splits: tuple[Sequences, ...], tokenizer_size: int, vocab_size: int) -> None:
    """Token ids the model's embedding has rows for: an id at or past vocab_size fails in the
    first forward ("index out of range"), after the model was built. zerofit does not resize
    embeddings (under ZeRO-3 the rows are partitioned, and new rows would need training)."""
    highest = max((int(s.input_ids.max()) for s in splits if s.input_ids.size), default=-1)
    if highest >= vocab_size:
        raise DataError(f"the data has token id {highest} but the model's vocabulary holds {vocab_size} "
                        f"(the tokenizer has {tokenizer_size} tokens): use the model's own tokenizer "
                        f"(model.tokenizer), or for a model built from a config give it vocab_size >= "
                        f"{tokenizer_size}")


# ------------------------------------------------------------------------ batches
def targets(labels: np.ndarray, per_row: bool = False):
    """The labels a causal-LM loss counts: each row's past its first (token t predicts t+1)."""
    counted = (labels[:, 1:] != IGNORE).sum(axis=1)
    return counted if per_row else int(counted.sum())


class MicroBatch(NamedTuple):
    """One forward's rows: token ids, labels, and per token its place in its example under
    data.neat_packing (None otherwise: positions 0..seq_len-1, the model's own)."""
    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray | None = None


def batch_of(seqs: Sequences, rows) -> MicroBatch:
    return MicroBatch(seqs.input_ids[rows], seqs.labels[rows],
                      seqs.positions[rows] if seqs.positions is not None else None)


class Batches:
    """Micro batches for one rank. Global micro batch j takes sequences
    [j*B*W, (j+1)*B*W) of the epoch's seeded permutation, rank r its slice r*B:(r+1)*B,
    so `position` (micro batches consumed) is all a resume on W ranks needs; on another
    number of ranks carried_position converts it."""

    def __init__(self, seqs: Sequences, micro_batch: int, rank: int, world: int, seed: int, position: int = 0):
        self.seqs, self.micro_batch, self.rank, self.world, self.seed = seqs, micro_batch, rank, world, seed
        self.per_epoch = len(seqs) // (micro_batch * world)
        if self.per_epoch == 0:
            dropped = seqs.dropped_note(seqs.input_ids.shape[-1])
            fix = ("add data, or lower train.micro_batch_size (where the planner chose it, lower "
                   "train.global_batch_size: it splits that)")
            raise DataError(f"the data gives {len(seqs)} sequences, fewer than one micro batch on every rank "
                            f"({micro_batch} x {world}); " + (dropped or fix))
        self.position = position
        self._order_epoch, self._order = -1, None
        self._targets = None  # per sequence, the labels the loss counts (targets)

    def _order_for(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.seqs))
            self._order_epoch = epoch
        return self._order

    @property
    def epoch(self) -> float:
        return self.position / self.per_epoch

    def _rows(self, position: int) -> np.ndarray:
        """Every rank's sequences of the global micro batch at `position`, this rank's the
        slice [rank x micro, (rank + 1) x micro)."""
        epoch, index = divmod(position, self.per_epoch)
        per_batch = self.micro_batch * self.world
        return self._order_for(epoch)[index * per_batch:(index + 1) * per_batch]

    def _mine(self, rows: np.ndarray) -> np.ndarray:
        return rows[self.rank * self.micro_batch:(self.rank + 1) * self.micro_batch]

    def tokens_between(self, start: int, stop: int) -> int:
        """Tokens, padding left out, of every rank's micro batches at positions [start, stop):
        what the run processed in that span (tokens/s counts these, not seq_len per row)."""
        if self.seqs.lengths is None:
            return (stop - start) * self.micro_batch * self.world * self.seqs.input_ids.shape[-1]
        return sum(int(self.seqs.lengths[self._rows(position)].sum()) for position in range(start, stop))

    def step_targets(self, accum: int) -> tuple[list[int], int]:
        """The tokens the loss counts (labels past each row's first) in this rank's next `accum`
        micro batches, and in every rank's: what one optimizer step's token-weighted mean divides
        by. The order is a pure function of (seed, position), so every rank knows every rank's
        count without a collective; the position does not move."""
        if self._targets is None:
            self._targets = targets(self.seqs.labels, per_row=True)
        batches = [self._rows(position) for position in range(self.position, self.position + accum)]
        return ([int(self._targets[self._mine(rows)].sum()) for rows in batches],
                sum(int(self._targets[rows].sum()) for rows in batches))

    def next(self) -> MicroBatch:
        rows = self._mine(self._rows(self.position))
        self.position += 1
        return batch_of(self.seqs, rows)


@dataclass(frozen=True)
class BatchShape:
    """What a Batches position counts in: ranks, sequences per micro batch, sequences per epoch."""
    world: int
    micro_batch: int
    sequences: int

    @property
    def per_epoch(self) -> int:
        return self.sequences // (self.micro_batch * self.world)


def carried_position(position: int, old: BatchShape, new: BatchShape) -> int:
    """The Batches position in `new` that continues where `position` in `old` stopped: the same
    epoch, the same share of its sequences consumed, rounded up to whole micro batches. With the
    same sequences (another rank count, an OOM retry's micro batch) that share is exactly the
    sequences already seen, so none is seen twice; with other sequences (seq_len, packing or the
    data changed) the epoch's permutation is another one, so only its share carries over."""
    epoch, index = divmod(position, old.per_epoch)
    consumed = index * old.micro_batch * old.world * new.sequences  # in units of 1 / old.sequences
    new_index = -(-consumed // (old.sequences * new.micro_batch * new.world))
    if new_index >= new.per_epoch:
        epoch, new_index = epoch + 1, 0
    return epoch * new.per_epoch + new_index


def eval_batches(seqs: Sequences, micro_batch: int, rank: int, world: int, limit: int | None = None):
    """This rank's micro batches of the eval set's first `limit` sequences (all of them when
    None), in file order: the same sequences however they are split into micro batches and
    ranks (the tail that did not fill a global batch was dropped: 1 and 2 ranks evaluated 4 and
    8 sequences of one set). A global batch's sequences are shared out evenly; a rank left
    without one runs a forward anyway (ZeRO-3's forward is collective) on a row whose labels are
    all ignored, which the token-weighted eval loss does not count."""
    total = len(seqs) if limit is None else min(len(seqs), limit)
    for start in range(0, total, micro_batch * world):
        share = -(-(min(start + micro_batch * world, total) - start) // world)
        lo = min(start + rank * share, total)
        hi = min(lo + share, start + micro_batch * world, total)
        if hi > lo:
            yield batch_of(seqs, slice(lo, hi))
        else:
            stand_in = batch_of(seqs, slice(0, 1))
            yield stand_in._replace(labels=np.full_like(stand_in.labels, IGNORE))
