"""Examples -> rows of seq_len tokens: cut to seq_len (data.truncation), relabelled
(data.train_on_prompt, data.mask_history), then packed whole (best fit), concatenated, or
padded one per row (packing_layout); data.neat_packing's per-example positions."""
from __future__ import annotations

import bisect
import itertools

import numpy as np

from zerofit.config.data import DataConfig
from zerofit.data.tokenize import IGNORE

ROW_BYTES_PER_TOKEN = 16    # int64 ids and labels of a row (pack, pad); neat packing's positions 8 more
BUILD_BYTES_PER_TOKEN = 16  # while a row is built: its padding as two lists of 8-byte pointers (tail_padding)
ROWS_AT_LEAST = 2           # the training set's and the eval set's: each has a row, its last padded out


def rows_host_problem(seq_len: int, neat_packing: bool, host_bytes: int, where: str,
                      context: int | None = None) -> str | None:
    """Why the host cannot build the first rows of seq_len tokens, or None. Every layout makes at
    least ROWS_AT_LEAST rows of seq_len tokens however short the data (tail_padding, pad), so an
    absurd seq_len (1e9) was OOM-killed while tokenizing, with no message, minutes in. `context`:
    the model's max_position_embeddings, the usual length to ask for instead."""
    per_token = ROW_BYTES_PER_TOKEN + 8 * neat_packing
    needed = seq_len * per_token * ROWS_AT_LEAST + seq_len * BUILD_BYTES_PER_TOKEN
    if needed <= host_bytes:
        return None
    instead = f"the model's context is {context:,} tokens (max_position_embeddings)" if context else \
        "the longest example's tokens are enough"
    return (f"train.seq_len {seq_len:,} needs ~{needed / 2**30:.1f} GiB of host RAM before training starts: "
            f"{ROWS_AT_LEAST} rows (the training and eval sets' last, padded to seq_len) at {per_token} bytes a "
            f"token, and {BUILD_BYTES_PER_TOKEN} a token more while one is built; {where} holds "
            f"{host_bytes / 2**30:.1f} GiB. Lower train.seq_len: {instead}")


def pack(examples: list[tuple[list[int], list[int]]], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate examples into seq_len rows; the tail that does not fill a row is dropped."""
    ids = np.fromiter((t for e in examples for t in e[0]), dtype=np.int64)
    labels = np.fromiter((t for e in examples for t in e[1]), dtype=np.int64)
    rows = len(ids) // seq_len
    return ids[: rows * seq_len].reshape(rows, seq_len), labels[: rows * seq_len].reshape(rows, seq_len)


def rows_of_whole_examples(examples: list[tuple[list[int], list[int]]], seq_len: int,
                           pad_id: int) -> tuple[list[tuple[list[int], list[int]]], np.ndarray]:
    """Packing of prompted examples (LLaMA-Factory's greedy knapsack for its sft stage, with
    neat_packing or without): whole examples, longest first, each into the fullest row it still
    fits (best fit), every row closed by padding; `pack` then cuts at the row ends. An example
    is never split (a tail in the next row would be learned without its prompt); none is longer
    than seq_len (`truncated` cut them). The order is the examples' own for equal
    lengths: the same data makes the same rows, laid out in the order of each row's first
    example in the data. Returns the examples as laid out (each row's padding one more) and
    each row's tokens before its padding."""
    rows: list[list[int]] = []           # example indices per row
    rows_with: dict[int, list[int]] = {}  # room left -> the rows with that much (a stack)
    rooms: list[int] = []                # the room values some row has, sorted: at most seq_len of them
    for index in sorted(range(len(examples)), key=lambda i: -len(examples[i][0])):
        length = len(examples[index][0])
        at = bisect.bisect_left(rooms, length)  # the least room that takes it: the fullest row it fits
        if at == len(rooms):
            room, row = seq_len, len(rows)
            rows.append([])
        else:
            room = rooms[at]
            row = rows_with[room].pop()
            if not rows_with[room]:
                del rooms[at]
        rows[row].append(index)
        if room > length:
            if not rows_with.setdefault(room - length, []):
                bisect.insort(rooms, room - length)
            rows_with[room - length].append(row)
    out, used = [], []
    for row in sorted(rows, key=min):  # in data order: an eval cap takes the data's first examples, not its longest
        members = [examples[i] for i in row]
        out += members + [tail_padding(members, seq_len, pad_id)]
        used.append(sum(len(e_ids) for e_ids, _ in members))
    return out, np.array(used, dtype=np.int64)


def tail_padding(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> tuple[list[int], list[int]]:
    """The padding that fills the examples' last packed row (nothing learned in it): packed
    after them, it is one more example to isolate_examples, so no token attends to it."""
    missing = -sum(len(e_ids) for e_ids, _ in examples) % seq_len
    return [pad_id] * missing, [IGNORE] * missing


def isolate_examples(examples: list[tuple[list[int], list[int]]], labels: np.ndarray) -> np.ndarray:
    """data.neat_packing over `pack`'s rows: per token its position in its example, restarting
    at every example and at every row (rows_of_whole_examples lays them out so that none
    crosses a row end; were one to, its tail would start again, and positions never pass
    seq_len: learned position tables hold no more). transformers reads a fall in the position
    ids as a new sequence and masks attention across it (masking_utils.find_packed_sequence_indices,
    when use_cache is off, as engine.build_model sets). `labels` loses each example's first label in place: token t
    predicts t + 1, and an example's first token is not predicted from the one before it."""
    rows, seq_len = labels.shape
    lengths = np.array([len(e_ids) for e_ids, _ in examples], dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    flat = np.arange(rows * seq_len)
    in_example = flat - np.repeat(starts, lengths)[: rows * seq_len]
    labels.flat[starts[starts < rows * seq_len]] = IGNORE
    return np.minimum(in_example, flat % seq_len).reshape(rows, seq_len)


def truncated(examples: list[tuple[list[int], list[int]]], seq_len: int, how: str,
              last_first: bool = False) -> tuple[list[tuple[list[int], list[int]]], tuple[int, int, int]]:
    """The examples cut to seq_len (data.truncation; `last_first`: a balanced cut keeps the last
    turns first, data.mask_history), and what that cost: (examples cut, answer tokens lost,
    prompt tokens lost)."""
    out, cut, answer_lost, prompt_lost = [], 0, 0, 0
    for ids, labels in examples:
        if len(ids) > seq_len:
            kept = head_of(len(ids), seq_len) if how == "head" else balanced_cut(labels, seq_len, last_first)
            lost_answer = sum(label != IGNORE for label in labels) - sum(labels[i] != IGNORE for i in kept)
            cut, answer_lost, prompt_lost = cut + 1, answer_lost + lost_answer, \
                prompt_lost + len(ids) - len(kept) - lost_answer
            ids, labels = [ids[i] for i in kept], [labels[i] for i in kept]
        out.append((ids, labels))
    return out, (cut, answer_lost, prompt_lost)


def head_of(length: int, seq_len: int) -> list[int]:
    return list(range(min(length, seq_len)))


def balanced_cut(labels: list[int], seq_len: int, last_first: bool = False) -> list[int]:
    """The token indices an over-long example keeps under LLaMA-Factory's cutoff_len
    (data/processor/supervised.py, _encode_data_example): turn by turn, in order, each (prompt,
    answer) pair is cut to what is left of seq_len by `cutoff_shares`, each keeping its head.
    `last_first`: the turns are taken from the last back, as LLaMA-Factory encodes them reversed
    under mask_history, so the answer learned is kept first and the oldest turns go."""
    turns = turns_of(labels)
    starts = list(itertools.accumulate((prompt + answer for prompt, answer in turns), initial=0))
    kept, room = [], seq_len
    for turn in (reversed(range(len(turns))) if last_first else range(len(turns))):
        if room <= 0:
            break
        (prompt, answer), start = turns[turn], starts[turn]
        keep_prompt, keep_answer = cutoff_shares(prompt, answer, room)
        kept += [*range(start, start + keep_prompt), *range(start + prompt, start + prompt + keep_answer)]
        room -= keep_prompt + keep_answer
    return sorted(kept)


def relabelled(examples: list[tuple[list[int], list[int]]], train_on_prompt: bool,
               mask_history: bool) -> list[tuple[list[int], list[int]]]:
    """The tokens each example learns, after the cut (which told prompt from answer by the
    labels): `train_on_prompt` learns the prompts too, `mask_history` only the last answer
    (LLaMA-Factory's options of those names, supervised.py: source_label, target_label). A
    text row learns every token either way."""
    if not (train_on_prompt or mask_history):
        return examples
    out = []
    for ids, labels in examples:
        turns = turns_of(labels)
        last_answer = max((turn for turn, (_, answer) in enumerate(turns) if answer), default=-1)
        learned, start = [], 0
        for turn, (prompt, answer) in enumerate(turns):
            learned += ids[start:start + prompt] if train_on_prompt else [IGNORE] * prompt
            start += prompt
            learned += ids[start:start + answer] if turn == last_answer or not mask_history else [IGNORE] * answer
            start += answer
        out.append((ids, learned))
    return out


def turns_of(labels: list[int]) -> list[tuple[int, int]]:
    """(prompt tokens, answer tokens) per turn: a run of unlearned labels, then the learned run
    after it (a text row is one turn with no prompt; a template's tail after the last answer one
    with no answer)."""
    turns, prompt = [], 0
    for learned, run in itertools.groupby(labels, key=lambda label: label != IGNORE):
        length = sum(1 for _ in run)
        if learned:
            turns.append((prompt, length))
            prompt = 0
        else:
            prompt = length
    return turns + [(prompt, 0)] if prompt else turns


def cutoff_shares(prompt: int, answer: int, room: int) -> tuple[int, int]:
    """(prompt, answer) tokens kept of a turn within `room` (LLaMA-Factory's infer_seqlen,
    data/processor/processor_utils.py): an answer under half the room is kept whole and the
    prompt cut; else a prompt under half is kept whole and the answer cut; else both shrink in
    proportion to their lengths."""
    if answer * 2 < room:
        most_answer = room
    elif prompt * 2 < room:
        most_answer = room - prompt
    else:
        most_answer = int(room * (answer / (prompt + answer)))  # LLaMA-Factory's float rounding, to the token
    kept_answer = min(most_answer, answer)
    return min(max(room - kept_answer, 0), prompt), kept_answer


def pad(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """One example per row, truncated to seq_len, padded with pad_id / IGNORE."""
    ids = np.full((len(examples), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(examples), seq_len), IGNORE, dtype=np.int64)
    for row, (e_ids, e_labels) in enumerate(examples):
        n = min(len(e_ids), seq_len)
        ids[row, :n], labels[row, :n] = e_ids[:n], e_labels[:n]
    return ids, labels


def packing_layout(cfg: DataConfig, formats: tuple[str, ...]) -> str:
    """How examples become seq_len rows: `padded` (data.packing off: one per row); `whole` (packed
    whole, best fit: neat packing, and any data with prompts, as LLaMA-Factory's sft stage packs,
    so that no answer is learned in a row without its prompt); `concatenated` (plain text, as a
    pretraining stage packs: one document runs on into the next row, none cut)."""
    if not cfg.packing:
        return "padded"
    return "whole" if cfg.neat_packing or set(formats) - {"text"} else "concatenated"
