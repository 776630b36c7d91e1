"""Rows -> training sequences and batches (data.py, rowlayout.py): packing, truncation, masking, the eval split."""
import numpy as np
import pytest
from conftest import write_jsonl

from zerofit.config.data import DataConfig
from zerofit.config.load import validate
from zerofit.core.errors import ConfigError
from zerofit.data import pipeline as data
from zerofit.data import rows as rowlayout
from zerofit.data import tokenize
from zerofit.data.files import DataError
from zerofit.data.pipeline import Batches
from zerofit.data.tokenize import IGNORE


def test_packing_fills_rows_and_padding_pads_them():
    examples = [([1, 5, 6, 2], [IGNORE, 5, 6, 2]), ([1, 7, 2], [IGNORE, 7, 2]), ([1, 8, 8, 8, 8, 2], [1, 8, 8, 8, 8, 2])]
    ids, labels = rowlayout.pack(examples, 4)
    assert ids.tolist() == [[1, 5, 6, 2], [1, 7, 2, 1], [8, 8, 8, 8]]
    assert labels.tolist()[1] == [IGNORE, 7, 2, 1]
    ids, labels = rowlayout.pad(examples, 5, pad_id=0)
    assert ids.tolist()[1] == [1, 7, 2, 0, 0] and labels.tolist()[1] == [IGNORE, 7, 2, IGNORE, IGNORE]
    assert ids.tolist()[2] == [1, 8, 8, 8, 8]  # truncated


def test_neat_packing_restarts_positions_at_every_example_and_row():
    """Position ids restart where an example starts and where a row does (a carried tail sees
    nothing of its head); an example's first label is not predicted from the one before it."""
    examples = [([1, 5, 6, 2], [1, 5, 6, 2]), ([1, 7, 2], [IGNORE, 7, 2]), ([1, 8, 8, 8, 8, 2], [1, 8, 8, 8, 8, 2])]
    ids, labels = rowlayout.pack(examples, 4)
    positions = rowlayout.isolate_examples(examples, labels)
    assert positions.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3]]
    assert labels.tolist() == [[IGNORE, 5, 6, 2], [IGNORE, 7, 2, IGNORE], [8, 8, 8, 8]]


def test_neat_packing_packs_whole_examples_best_fit():
    """LLaMA-Factory's knapsack: longest first, each into the fullest row it fits, rows closed by
    padding; an example is never split across rows (its tail would be learned without its
    prompt), one longer than seq_len is cut to it first."""
    lengths = [5, 3, 4, 2, 8]
    examples = [([10 + i] * n, [10 + i] * n) for i, n in enumerate(lengths)]
    laid, used = rowlayout.rows_of_whole_examples(rowlayout.truncated(examples, 6, "balanced")[0], 6, pad_id=0)
    ids, labels = rowlayout.pack(laid, 6)
    # filled longest first; laid out in data order (a row by its first example's place)
    assert ids.tolist() == [[10] * 5 + [0], [11] * 3 + [0] * 3, [12] * 4 + [13] * 2, [14] * 6]
    assert used.tolist() == [5, 3, 6, 6]
    assert labels.tolist()[1] == [11] * 3 + [IGNORE] * 3
    positions = rowlayout.isolate_examples(laid, labels)
    assert positions.tolist()[2] == [0, 1, 2, 3, 0, 1] and positions.tolist()[1] == [0, 1, 2, 0, 1, 2]


def test_neat_packing_reaches_every_batch(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i} " * (1 + i % 4)} for i in range(40)])
    for neat in (False, True):
        seqs = data.build_sequences([path], DataConfig(path=str(path), neat_packing=neat), tokenizer, 32)
        batch = data.Batches(seqs, 2, 0, 1, seed=0).next()
        evaluated = list(data.eval_batches(seqs, 2, 1, 2, limit=100))
        one_row = data.Sequences(seqs.input_ids[:1], seqs.labels[:1], positions=seqs.positions[:1] if neat else None)
        stand_in = list(data.eval_batches(one_row, 1, 1, 2, limit=1))  # rank 1 of 2 gets no row of one
        assert data.targets(stand_in[0].labels) == 0
        if not neat:
            assert batch.position_ids is None and seqs.positions is None and stand_in[0].position_ids is None
            continue
        assert batch.position_ids.shape == batch.input_ids.shape and (batch.position_ids == 0).sum() > 2
        assert all(b.position_ids.shape == b.input_ids.shape for b in evaluated + stand_in)


def test_neat_packing_needs_packing_and_a_masking_architecture():
    from transformers import LlamaConfig, MambaConfig, PretrainedConfig

    from zerofit.models import check_neat_packing

    with pytest.raises(ConfigError, match="data.packing is false"):
        validate({"model": {"config": "tiny"}, "data": {"packing": False, "neat_packing": True}})
    neat = DataConfig(neat_packing=True)
    check_neat_packing(neat, LlamaConfig())
    check_neat_packing(DataConfig(), MambaConfig())  # not asked for: nothing to refuse
    with pytest.raises(ConfigError, match="MambaForCausalLM does not build its attention mask from position ids"):
        check_neat_packing(neat, MambaConfig())

    class RemoteConfig(PretrainedConfig):
        model_type = "remote-only"

    with pytest.raises(ConfigError, match="RemoteConfig's model \\(remote code\\)"):
        check_neat_packing(neat, RemoteConfig())


def test_rows_without_learnable_tokens_are_dropped(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "x" * 100, "output": "y"}, {"instruction": "a", "output": "b"}])
    seqs = data.build_sequences([path], DataConfig(path=str(path), packing=False, truncation="head"), tokenizer, 64)
    assert len(seqs) == 1  # the first one's response lies beyond seq_len
    assert len(data.build_sequences([path], DataConfig(path=str(path), packing=False), tokenizer, 64)) == 2


def test_examples_cut_to_seq_len_are_counted(tmp_path, tokenizer):
    """Padding and packing whole cut an example longer than seq_len (a short prompt kept, its
    answer's end lost, end of turn too): said with the tokens lost; concatenated text runs on
    into the next row, none cut."""
    rows = [{"instruction": "i", "output": "o" * 40}, {"instruction": "i", "output": "o"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    whole = len(tokenize.tokenize_row(rows[0], "alpaca", tokenizer)[0])
    for packing, neat, truncation in ((False, False, "balanced"), (True, False, "head"), (True, True, "balanced")):
        cfg = DataConfig(path=str(path), packing=packing, neat_packing=neat, truncation=truncation)
        seqs = data.build_sequences([path], cfg, tokenizer, 48)
        assert seqs.cut == (1, whole - 48, 0)
        assert f"losing {whole - 48} answer tokens and 0 prompt tokens" in seqs.cut_note(48)
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "o" * 80}, {"text": "o"}])
    assert data.build_sequences([text], DataConfig(path=str(text)), tokenizer, 48).cut == (0, 0, 0)


@pytest.mark.e2e
def test_prompted_examples_are_packed_whole_and_text_concatenated(tmp_path, tokenizer):
    """LLaMA-Factory's sft packing: no example split across rows (an answer's tail would be
    learned in the next row without its prompt), rows closed by padding, which tokens/s leaves
    out; plain text runs on from row to row (its pretraining stage's), no padding."""
    rows = [{"instruction": f"question {i}", "output": "answer " * (3 + i % 7)} for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    seqs = data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 256)
    examples = [tokenize.tokenize_row(row, "alpaca", tokenizer) for row in rows]
    assert seqs.layout == "whole" and seqs.lengths.sum() == sum(len(ids) for ids, _ in examples)
    learned = lambda labels: int((labels != IGNORE).sum())
    assert learned(seqs.labels) == sum(learned(np.array(labels)) for _, labels in examples)  # none dropped, none cut
    bos = tokenizer.bos_token_id
    for ids, used in zip(seqs.input_ids, seqs.lengths):  # every row starts an example; after its last, padding
        assert ids[0] == bos and (ids[used:] == tokenizer.pad_token_id).all()
    padding = 1 - seqs.lengths.sum() / seqs.input_ids.size
    assert seqs.layout_note() == f"examples packed whole ({padding:.1%} padding)" and 0 < padding < 0.25
    batches = data.Batches(seqs, 2, 0, 1, seed=0)
    assert batches.tokens_between(0, 1) == seqs.lengths[batches._rows(0)].sum() < 2 * 256  # padding not counted

    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "word " * (5 + i)} for i in range(40)])
    concatenated = data.build_sequences([text], DataConfig(path=str(text)), tokenizer, 256)
    assert concatenated.layout == "concatenated" and concatenated.lengths is None
    assert (concatenated.input_ids != tokenizer.pad_token_id).all()
    assert concatenated.layout_note() == "examples concatenated into rows"


@pytest.mark.e2e
def test_eval_split_holds_out_whole_rows_seeded(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(100)])
    cfg = DataConfig(path=str(path), eval_fraction=0.1, packing=False)
    train, held = data.load_splits(cfg, tokenizer, 16, seed=1, vocab_size=128)
    again, _ = data.load_splits(cfg, tokenizer, 16, seed=1, vocab_size=128)
    assert (len(train), len(held)) == (90, 10)
    assert np.array_equal(train.input_ids, again.input_ids)
    texts = lambda seqs: {tokenizer.decode(r, skip_special_tokens=True) for r in seqs.input_ids}
    assert texts(train).isdisjoint(texts(held)) and len(texts(train) | texts(held)) == 100
    packed_train, packed_held = data.load_splits(cfg.model_copy(update={"packing": True}), tokenizer, 16, 1, 128)
    labelled = lambda seqs: int((seqs.labels != IGNORE).sum())
    assert labelled(packed_held) == labelled(held)  # the same rows, packed; the last row's tail padded, not dropped
    assert labelled(packed_train) == labelled(train) // 16 * 16  # training drops the tail that fills no row
    rows = -(-labelled(held) // 16)
    assert len(packed_held) == rows and (packed_held.input_ids[-1, labelled(held) % 16:] == tokenizer.pad_token_id).all()
    # what the data line reports: the labels the loss counts, a row's first never (token t predicts t + 1)
    assert (held.trained_tokens, packed_held.trained_tokens) == (labelled(held) - 10, labelled(packed_held) - rows)


def test_eval_examples_holds_out_that_many_rows_seeded(tmp_path, tokenizer, capsys):
    """data.eval_examples is LLaMA-Factory's integer val_size: exactly that many rows held out,
    chosen as eval_fraction chooses them; a count that leaves nothing to train is refused with
    the figures; synthetic data is held out so too; the data line names the key."""
    from zerofit.train import datareport

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(100)])
    cfg = DataConfig(path=str(path), eval_examples=7, packing=False)
    kept, held = data.load_splits(cfg, tokenizer, 16, seed=1, vocab_size=128)
    assert (len(kept), len(held), held.examples) == (93, 7, 7)
    as_fraction = data.load_splits(DataConfig(path=str(path), eval_fraction=0.07, packing=False), tokenizer, 16, 1, 128)
    assert np.array_equal(held.input_ids, as_fraction[1].input_ids)  # the same seeded rows
    other_seed = data.load_splits(cfg, tokenizer, 16, seed=2, vocab_size=128)[1]
    assert not np.array_equal(held.input_ids, other_seed.input_ids)
    with pytest.raises(DataError, match=r"data.eval_examples 100 would hold out all 100 examples read, leaving none "
                                        r"to train on: set it below 100"):
        data.load_splits(cfg.model_copy(update={"eval_examples": 100}), tokenizer, 16, 1, 128)
    with pytest.raises(DataError, match=r"all 10 examples read \(data.max_samples 10 kept the first rows of each "
                                        r"entry\), leaving none to train on: set it below 10"):
        data.load_splits(cfg.model_copy(update={"eval_examples": 12, "max_samples": 10}), tokenizer, 16, 1, 128)
    synthetic = DataConfig(path="synthetic", synthetic_samples=64, eval_examples=10)
    assert [len(s) for s in data.load_splits(synthetic, tokenizer, 16, 1, 128)] == [54, 10]
    with pytest.raises(DataError, match=r"would hold out all 64 random sequences of data.synthetic_samples"):
        data.load_splits(synthetic.model_copy(update={"eval_examples": 64}), tokenizer, 16, 1, 128)
    config = validate({"model": {"config": "tiny"}, "train": {"max_steps": 1, "seq_len": 16},
                       "data": {"path": str(path), "packing": False, "eval_examples": 7}})
    datareport.report_data(kept, held, config, tokenizer)
    assert "data: 93 examples, eval 7 held out (data.eval_examples 7) -> 93 train / 7 eval sequences" in \
        capsys.readouterr().err.replace("\n", " ")


def test_batches_resume_mid_stream_and_shard_by_rank():
    seqs = data.synthetic_sequences(40, 8, 100, seed=0)
    whole = Batches(seqs, micro_batch=2, rank=0, world=1, seed=3)
    stream = [whole.next()[0] for _ in range(30)]  # crosses an epoch boundary (20 per epoch)
    resumed = Batches(seqs, micro_batch=2, rank=0, world=1, seed=3, position=17)
    assert all(np.array_equal(resumed.next()[0], stream[i]) for i in range(17, 30))
    ranks = [Batches(seqs, micro_batch=2, rank=r, world=2, seed=3) for r in (0, 1)]
    first = [b.next()[0] for b in ranks]
    assert np.array_equal(np.concatenate(first), np.concatenate(stream[0:2]))
    assert stream[20].tolist() != stream[0].tolist()  # a new epoch reshuffles


def test_too_little_data_for_one_batch():
    with pytest.raises(DataError, match="fewer than one micro batch"):
        Batches(data.synthetic_sequences(3, 8, 100, seed=0), micro_batch=2, rank=0, world=2, seed=0)


def test_an_eval_set_is_evaluated_whole_however_the_run_is_split(tmp_path, tokenizer):
    """One held-out sequence at micro batch 4 gave no eval batch at all; a set that did not fill
    the last global batch lost its tail (1 and 2 ranks evaluated 4 and 8 sequences of one set).
    Every split evaluates the same sequences; every rank runs as many forwards, a rank without
    a sequence on a row whose labels are all ignored."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i} " * 20} for i in range(11)])
    seqs = data.build_sequences([path], DataConfig(path=str(path), packing=False), tokenizer, 16)
    assert len(seqs) == 11

    def evaluated(micro, world, limit=None):
        per_rank = [list(data.eval_batches(seqs, micro, rank, world, limit)) for rank in range(world)]
        assert len({len(batches) for batches in per_rank}) == 1  # the same number of forwards on every rank
        rows = [row.tobytes() for batches in per_rank for ids, labels, _ in batches
                for row, row_labels in zip(ids, labels) if data.targets(row_labels[None]) > 0]
        return sorted(rows)

    whole = sorted(row.tobytes() for row in seqs.input_ids)
    for micro, world in ((4, 1), (2, 2), (1, 4), (4, 4), (16, 1)):
        assert evaluated(micro, world) == whole, (micro, world)
    for micro, world in ((2, 2), (1, 1), (4, 1)):  # the cap counts sequences, whatever the split
        assert evaluated(micro, world, limit=7) == sorted(row.tobytes() for row in seqs.input_ids[:7]), (micro, world)
    assert list(data.eval_batches(seqs, 4, 0, 1))[-1][0].shape[0] == 3  # the tail, not dropped


def test_rows_whose_answer_lies_beyond_seq_len_are_counted_and_the_advice_is_to_raise_it(tmp_path, tokenizer):
    """Under data.truncation: head, an example whose prompt fills seq_len leaves nothing to learn
    and is dropped (a NaN loss otherwise): counted, and when that leaves too few sequences the
    error says to raise seq_len (not to lower it) or to cut balanced."""
    rows = [{"instruction": "word " * 100, "output": "yes"}] * 6 + [{"instruction": "hi", "output": "there"}] * 2
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    seqs = data.build_sequences([path], DataConfig(path=str(path), packing=False, truncation="head"), tokenizer, 128)
    assert len(seqs) == 2 and seqs.prompt_only_rows == 6 and seqs.longest_example > 128
    with pytest.raises(DataError, match=r"dropped 6 rows whose answer starts beyond train\.seq_len 128 "
                                        r"\(the longest example has \d+ tokens\): raise train\.seq_len, or set "
                                        r"data\.truncation: balanced"):
        data.Batches(seqs, 4, 0, 1, seed=0)
    packed = data.build_sequences([path], DataConfig(path=str(path), truncation="head"), tokenizer, 128)
    assert "packed rows of 128 tokens holding no answer token" in packed.dropped_note(128)
    # every example dropped: the data line still says how they would have been laid out
    long_only = write_jsonl(tmp_path / "long.jsonl", rows[:6])
    none_left = data.build_sequences([long_only], DataConfig(path=str(long_only), truncation="head"), tokenizer, 128)
    assert len(none_left) == 0 and none_left.layout_note() == "examples packed whole"


def test_a_long_prompt_is_cut_and_its_answer_kept_as_llama_factory_cuts(tmp_path, tokenizer):
    """data.truncation: balanced (the default) is LLaMA-Factory's cutoff_len: the same long-prompt
    rows that head truncation drops keep their answers, their prompts cut to the room left."""
    rows = [{"instruction": "word " * 100, "output": "yes"}] * 6 + [{"instruction": "hi", "output": "there"}] * 2
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    answer = int((np.array(tokenize.tokenize_row(rows[0], "alpaca", tokenizer)[1]) != IGNORE).sum())
    for packing in (False, True):
        seqs = data.build_sequences([path], DataConfig(path=str(path), packing=packing), tokenizer, 128)
        assert seqs.prompt_only_rows == 0 and seqs.cut[:2] == (6, 0) and seqs.cut[2] > 0
        assert int((seqs.labels != IGNORE).sum()) == 6 * answer + 2 * int(
            (np.array(tokenize.tokenize_row(rows[-1], "alpaca", tokenizer)[1]) != IGNORE).sum())
        assert f"losing 0 answer tokens and {seqs.cut[2]} prompt tokens" in seqs.cut_note(128)


def test_balanced_truncation_shares_each_turn_as_infer_seqlen_does():
    """LLaMA-Factory's infer_seqlen, one case per branch: an answer under half the room is kept
    whole; a prompt under half is kept whole; else both in proportion; and turn by turn, a
    later turn gets what the earlier left."""
    assert rowlayout.cutoff_shares(prompt=100, answer=3, room=64) == (61, 3)
    assert rowlayout.cutoff_shares(prompt=10, answer=100, room=64) == (10, 54)
    assert rowlayout.cutoff_shares(prompt=60, answer=40, room=64) == (39, 25)  # int(64 * 40 / 100)
    assert rowlayout.cutoff_shares(prompt=5, answer=3, room=64) == (5, 3)
    assert rowlayout.cutoff_shares(prompt=14, answer=30, room=22) == (8, 14)  # int(22 * (30 / 44)): 14.999...
    labels = [IGNORE] * 10 + [5, 5] + [IGNORE] * 2 + [6, 6]
    assert rowlayout.turns_of(labels) == [(10, 2), (2, 2)] and rowlayout.turns_of([7, 7, IGNORE]) == [(0, 2), (1, 0)]
    ids = list(range(16))
    (kept_ids, kept_labels), = rowlayout.truncated([(ids, labels)], 8, "balanced")[0]
    assert kept_ids == [0, 1, 2, 3, 4, 5, 10, 11] and kept_labels == [IGNORE] * 6 + [5, 5]  # turn 2: no room
    assert rowlayout.truncated([(ids, labels)], 8, "balanced")[1] == (1, 2, 6)
    assert rowlayout.truncated([(ids, labels)], 8, "head")[0][0][0] == list(range(8))
    assert rowlayout.truncated([(ids, labels)], 8, "head")[1] == (1, 4, 4)
    (kept_ids, _), = rowlayout.truncated([(ids, labels)], 14, "balanced")[0]
    assert kept_ids == [*range(12), 12, 14]  # turn 1 whole, then (1, 1) of turn 2 in the 2 tokens left


@pytest.mark.e2e
def test_token_ids_past_the_models_vocabulary_are_refused_before_training(tmp_path, tokenizer):
    """A tokenizer bigger than the model's embedding: it crashed in the first forward."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "i", "output": "o" * 10}] * 20)
    config = DataConfig(path=str(path), alpaca_template="alpaca")
    train, held = data.load_splits(config, tokenizer, 64, seed=0, vocab_size=len(tokenizer))
    assert len(train) and len(held) == 1  # one example held out, its packed row padded
    with pytest.raises(DataError, match=rf"the data has token id \d+ but the model's vocabulary holds 8 \(the "
                                        rf"tokenizer has {len(tokenizer)} tokens\)"):
        data.load_splits(config, tokenizer, 64, seed=0, vocab_size=8)


def test_tokens_per_step_leave_the_padding_out(tmp_path, tokenizer):
    """Padded rows: what a step processed is the examples' tokens on every rank, not
    seq_len per row (tokens/s counted the padding); rows packed whole leave their closing
    padding out too; concatenated rows are all tokens."""
    rows = [{"instruction": "i" * (n % 7), "output": "o" * 5} for n in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    padded = data.build_sequences([path], DataConfig(path=str(path), packing=False), tokenizer, 64)
    real = padded.input_ids != tokenizer.pad_token_id
    assert (padded.lengths == real.sum(axis=1)).all() and padded.lengths.max() < 64
    two_ranks = [Batches(padded, 2, rank, 2, seed=1) for rank in (0, 1)]
    served = 0
    for _ in range(3):
        for batches in two_ranks:
            ids = batches.next().input_ids
            served += int((ids != tokenizer.pad_token_id).sum())
    assert two_ranks[0].tokens_between(0, 3) == served < 3 * 4 * 64
    whole = data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 64)
    two_ranks = [Batches(whole, 2, rank, 2, seed=1) for rank in (0, 1)]
    assert two_ranks[0].tokens_between(0, 3) == sum(int(whole.lengths[b._mine(b._rows(position))].sum())
                                                    for b in two_ranks for position in range(3)) < 3 * 4 * 64
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "o" * (5 + n % 7)} for n in range(40)])
    concatenated = data.build_sequences([text], DataConfig(path=str(text)), tokenizer, 16)
    assert concatenated.lengths is None and Batches(concatenated, 2, 0, 2, seed=1).tokens_between(0, 3) == 3 * 4 * 16


# ------------------------------------------------- what LLaMA-Factory users bring
def test_a_packed_row_whose_only_label_is_its_first_token_is_dropped():
    """The loss predicts token t+1 from t: a row whose one learned token is at position 0 (an
    answer's EOS spilled into the next packed row) counts nothing, and its mean loss was 0/0 =
    NaN, stopping the run as "diverged"."""
    import torch

    examples = [([1, 7, 7, 7, 9], [IGNORE] * 4 + [9]), ([1, 8, 8, 8], [IGNORE] * 4), ([1, 5, 6, 2], [IGNORE, 5, 6, 2])]
    seqs = data.to_sequences(examples, DataConfig(), tokenizer=type("T", (), {"pad_token_id": 0})(), seq_len=4)
    assert seqs.input_ids.tolist() == [[8, 1, 5, 6]] and seqs.prompt_only_rows == 2
    labels = torch.as_tensor(seqs.labels)
    loss = torch.nn.functional.cross_entropy(torch.zeros(3, 16), labels[0, 1:], ignore_index=IGNORE)
    assert torch.isfinite(loss)


def test_mask_history_keeps_the_last_turns_first_and_learns_the_last_answer():
    """LLaMA-Factory's mask_history encodes the turns reversed: the room goes to the last turn
    first, the oldest is dropped when none is left, and only the last answer is learned;
    train_on_prompt learns the prompts' tokens as well."""
    labels = [IGNORE] * 4 + [4, 5] + [IGNORE] * 3 + [9, 10, 11]  # turns (4, 2), (3, 3)
    ids = list(range(12))
    assert rowlayout.balanced_cut(labels, 8) == [0, 1, 2, 3, 4, 5, 6, 9]  # in order: turn 2 gets (1, 1)
    # the last turn whole (6 tokens), then of the first what infer_seqlen gives 2 tokens of room: (2, 0)
    assert rowlayout.balanced_cut(labels, 8, last_first=True) == [0, 1, 6, 7, 8, 9, 10, 11]
    (cut_ids, cut_labels), = rowlayout.truncated([(ids, labels)], 8, "balanced", last_first=True)[0]
    assert cut_ids == [0, 1, 6, 7, 8, 9, 10, 11] and cut_labels == [IGNORE] * 5 + [9, 10, 11]
    assert rowlayout.balanced_cut(labels, 6, last_first=True) == [6, 7, 8, 9, 10, 11]  # the first turn gone
    whole = [(ids, labels)]
    assert rowlayout.relabelled(whole, False, False) is whole
    assert rowlayout.relabelled(whole, False, True)[0][1] == [IGNORE] * 9 + [9, 10, 11]
    assert rowlayout.relabelled(whole, True, False)[0][1] == ids
    text = [([7, 8, 9], [7, 8, 9])]
    assert rowlayout.relabelled(text, True, True) == text  # a text row learns every token either way


@pytest.mark.e2e
def test_train_on_prompt_and_mask_history_choose_the_tokens_learned(tmp_path, tokenizer, capsys):
    """Through load_splits and the data line, with a real tokenizer's chat template: a two-turn
    conversation learns both answers by default, the prompts too with train_on_prompt, only the
    second answer with mask_history; a cut under mask_history keeps that answer."""
    turns = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "alpha beta"},
             {"role": "user", "content": "second question"}, {"role": "assistant", "content": "gamma delta"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": turns}] * 4)

    def learned(seq_len: int = 256, **options) -> str:
        config = DataConfig(path=str(path), eval_fraction=0.0, packing=False, **options)
        train, _ = data.load_splits(config, tokenizer, seq_len, seed=0, vocab_size=len(tokenizer))
        return tokenizer.decode(train.input_ids[0][train.labels[0] != IGNORE])

    assert "alpha beta" in learned() and "gamma delta" in learned() and "question" not in learned()
    assert "first question" in learned(train_on_prompt=True) and "second question" in learned(train_on_prompt=True)
    only_last = learned(mask_history=True)
    assert "gamma delta" in only_last and "alpha" not in only_last and "question" not in only_last
    first_turn = len(tokenize.tokenize_row({"messages": turns[:2]}, "messages", tokenizer)[0])
    assert "gamma delta" not in learned(seq_len=first_turn)  # in order, the first turn takes the room
    assert "gamma delta" in learned(seq_len=first_turn, mask_history=True)  # the last turn's first

    from zerofit.config.schema import Config
    from zerofit.train.datareport import learned_note

    config = Config.model_validate({"model": {"config": "tiny"}, "train": {"max_steps": 1},
                                    "data": {"mask_history": True}})
    assert learned_note(config) == " (each conversation's last answer only: data.mask_history)"


@pytest.mark.e2e
def test_the_eval_split_learns_what_the_training_split_learns(tmp_path, tokenizer):
    """data.mask_history on the held-out rows too: an eval loss over the answers training learns."""
    turns = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "alpha beta"},
             {"role": "user", "content": "second question"}, {"role": "assistant", "content": "gamma delta"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": turns}] * 20)
    config = DataConfig(path=str(path), eval_examples=4, packing=False, mask_history=True)
    train, held = data.load_splits(config, tokenizer, 256, seed=0, vocab_size=len(tokenizer))
    assert len(held) == 4
    for split in (train, held):
        learned = tokenizer.decode(split.input_ids[0][split.labels[0] != IGNORE])
        assert "gamma delta" in learned and "alpha" not in learned
