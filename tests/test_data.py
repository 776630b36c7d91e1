import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from zerofit import chatlayout, data, datafiles, rowlayout, tokenizing, tokenworkers
from zerofit.config import ConfigError
from zerofit.conversations import RowError
from zerofit.dataconfig import DataConfig
from zerofit.configfile import validate
from zerofit.data import Batches
from zerofit.datafiles import DataError
from zerofit.models import BUNDLED_TEMPLATES as BUNDLED
from zerofit.tokenizing import IGNORE

from conftest import write_jsonl


def decode_learned(tokenizer, ids, labels):
    return tokenizer.decode([t for t, l in zip(ids, labels) if l != IGNORE])


def test_text_rows_learn_every_token(tokenizer):
    ids, labels = tokenizing.tokenize_row({"text": "hello"}, "text", tokenizer)
    assert ids == labels
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[1:-1]) == "hello"


def test_alpaca_masks_the_prompt(tokenizer):
    row = {"instruction": "Reverse the word.", "input": "abc", "output": "cba"}
    ids, labels = tokenizing.tokenize_row(row, "alpaca", tokenizer, "alpaca")
    assert len(ids) == len(labels)
    assert decode_learned(tokenizer, ids, labels) == "cba</s>"
    prompt = tokenizer.decode([t for t, l in zip(ids, labels) if l == IGNORE])
    assert prompt == "<s>### Instruction:\nReverse the word.\n\n### Input:\nabc\n\n### Response:\n"


def test_alpaca_without_input(tokenizer):
    ids, labels = tokenizing.tokenize_row({"instruction": "Say hi.", "output": "hi"}, "alpaca", tokenizer, "alpaca")
    assert "### Input" not in tokenizer.decode(ids)
    assert decode_learned(tokenizer, ids, labels) == "hi</s>"


def test_alpaca_rows_take_the_tokenizers_chat_template(tokenizer):
    """data.alpaca_template chat (the default): an alpaca row is the conversation LLaMA-Factory's
    converter makes of it (system, history pairs, instruction + input as the user's turn),
    rendered by the tokenizer's template, which then stays the exported one; a tokenizer
    without a template keeps the alpaca layout, and with it the alpaca chat template."""
    row = {"system": "be brief", "history": [["Say hi.", "hi"]], "instruction": "Reverse the word.",
           "input": "abc", "output": "cba"}
    conversation = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say hi."},
                                 {"role": "assistant", "content": "hi"},
                                 {"role": "user", "content": "Reverse the word.\nabc"},
                                 {"role": "assistant", "content": "cba"}]}
    assert tokenizing.tokenize_row(row, "alpaca", tokenizer) == tokenizing.tokenize_row(conversation, "messages", tokenizer)
    assert chatlayout.trained_chat_template(("alpaca",), tokenizer) is None  # the tokenizer's own
    assert chatlayout.trained_chat_template(("alpaca", "messages"), tokenizer) is None
    assert chatlayout.trained_chat_template(("alpaca",), tokenizer, "alpaca") == chatlayout.ALPACA_CHAT_TEMPLATE
    assert chatlayout.trained_chat_template(("alpaca", "messages"), tokenizer, "alpaca") is None  # layouts mixed
    assert chatlayout.layouts(("alpaca", "messages"), tokenizer) == "alpaca/messages rows by the tokenizer's chat template"
    assert chatlayout.layouts(("alpaca", "messages"), tokenizer, "alpaca") == \
        "messages rows by the tokenizer's chat template; alpaca rows in the alpaca layout"
    assert chatlayout.layouts(("text",), tokenizer) == ""
    tokenizer.chat_template = None
    ids, labels = tokenizing.tokenize_row(row, "alpaca", tokenizer)
    assert tokenizer.decode(ids).startswith("<s>be brief\n\n### Instruction:\nSay hi.")
    assert chatlayout.trained_chat_template(("alpaca",), tokenizer) == chatlayout.ALPACA_CHAT_TEMPLATE
    assert chatlayout.layouts(("alpaca",), tokenizer) == "alpaca rows in the alpaca layout"


def test_messages_learn_only_assistant_turns_with_chat_template(tokenizer):
    row = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
                        {"role": "assistant", "content": "6"}]}
    ids, labels = tokenizing.tokenize_row(row, "messages", tokenizer)
    assert ids == list(tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False))
    assert decode_learned(tokenizer, ids, labels) == "4</s>\n6</s>\n"


MISTRAL_LIKE = ("{{ bos_token }}{% for m in messages if m.role != 'system' %}{% if m.role == 'user' %}[INST] "
                "{% if loop.last or (loop.revindex == 2 and messages[-1].role == 'assistant') %}"
                "{% for s in messages if s.role == 'system' %}{{ s.content }}\n\n{% endfor %}{% endif %}"
                "{{ m.content }} [/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")


def test_a_chat_template_that_rewrites_earlier_turns_is_a_bad_row(tmp_path, tokenizer):
    """Mistral's template puts the system prompt into the last user turn: a conversation's
    prefixes do not render as prefixes of it, so answer spans cannot be found. The row is
    refused by line (labels once slid off their tokens for every later packed example), and
    under skip_bad_rows skipped while single-turn rows still train."""
    tokenizer.chat_template = MISTRAL_LIKE
    single = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4"}]}
    multi = {"messages": single["messages"] + [{"role": "user", "content": "3+3?"},
                                               {"role": "assistant", "content": "6"}]}
    ids, labels = tokenizing.tokenize_row(single, "messages", tokenizer)
    assert len(ids) == len(labels) and decode_learned(tokenizer, ids, labels) == "4</s>"
    path = write_jsonl(tmp_path / "d.jsonl", [single] * 30 + [multi])
    with pytest.raises(DataError, match=r"line 31: field `messages`: the tokenizer's chat template renders the first "
                                        r"4 turn\(s\) differently"):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 32)
    seqs = data.build_sequences([path], DataConfig(path=str(path), skip_bad_rows=True), tokenizer, 32)
    assert seqs.skipped_rows == 1
    learned = seqs.input_ids[seqs.labels != IGNORE]
    assert (learned == seqs.labels[seqs.labels != IGNORE]).all()  # every label sits on its own token


# A row with a system turn in each chat format, and the field a problem with its conversation is named by
SYSTEM_ROWS = [
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                   {"role": "assistant", "content": "a"}]}, r"messages"),
    ({"system": "s", "conversations": [{"from": "human", "value": "u"}, {"from": "gpt", "value": "a"}]},
     r"conversations"),
    ({"system": "s", "instruction": "u", "output": "a"},
     r"instruction/output as a conversation \(data.alpaca_template: chat; `alpaca` renders the alpaca layout\)"),
]


def assert_bad_row(tmp_path, tokenizer, row: dict, problem: str) -> None:
    """`row`, alone in a file, is refused as a bad row on its line with `problem` (a pattern)."""
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(DataError, match=rf"line 1: {problem}"):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 32)


@pytest.mark.parametrize("row, field_name", SYSTEM_ROWS, ids=["messages", "sharegpt", "alpaca"])
def test_a_chat_template_that_raises_is_a_bad_row_named_by_its_own_field(tmp_path, tokenizer, row, field_name):
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role "
                               "not supported') }}{% endif %}{{ m.content }}{% endfor %}")
    assert_bad_row(tmp_path, tokenizer, row, rf"field `{field_name}`: the tokenizer's chat template refused it: "
                                             r"System role not supported")


@pytest.mark.parametrize("row, field_name", SYSTEM_ROWS, ids=["messages", "sharegpt", "alpaca"])
def test_a_chat_template_that_leaves_the_system_turn_out_is_a_bad_row(tmp_path, tokenizer, row, field_name):
    """A template that renders only user and assistant turns trained every row without its
    system prompt, without a word; rows without one still train."""
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role != 'system' %}{{ m.role }}: {{ m.content }}\n"
                               "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    assert_bad_row(tmp_path, tokenizer, row, rf"field `{field_name}`: the tokenizer's chat template leaves a system "
                                             r"turn out .* use a template that renders it \(model.chat_template\)")
    no_system = {key: value[1:] if key == "messages" else value for key, value in row.items() if key != "system"}
    ids, labels = tokenizing.tokenize_row(no_system, tokenizing.row_format(no_system), tokenizer)
    assert tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE]).startswith("a")
    # the same rows under a template that writes the system turn train with it
    tokenizer.chat_template = tokenizer.chat_template.replace("{% if m.role != 'system' %}", "{% if true %}")
    ids, _ = tokenizing.tokenize_row(row, tokenizing.row_format(row), tokenizer)
    assert tokenizer.decode(ids).startswith("system: s\nuser: u")


def test_messages_without_chat_template(tokenizer):
    tokenizer.chat_template = None
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ids, labels = tokenizing.tokenize_row(row, "messages", tokenizer)
    assert decode_learned(tokenizer, ids, labels) == "yo</s>"
    assert tokenizer.decode(ids) == "<s>user:\nhi</s>assistant:\nyo</s>"


def test_bad_row_names_file_line_and_field(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}, "",
                                              {"instruction": "a", "output": "b"}, {"instruction": "c"}])
    with pytest.raises(DataError, match=r"d\.jsonl, line 4: field `output`: missing \(alpaca format\)"):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 32)
    misspelt = write_jsonl(tmp_path / "m.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "c", "outptu": "d"}])
    with pytest.raises(DataError, match=r"m\.jsonl, line 2: field `output`: missing \(the row has `outptu`: misspelt\?\)"):
        data.build_sequences([misspelt], DataConfig(path=str(misspelt)), tokenizer, 32)


def test_wrong_type_is_named(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"text": 5}])
    with pytest.raises(DataError, match=r"line 2: field `text`: expected a string, got int"):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 32)


def test_invalid_json_names_the_line(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"text": "ok"}', '{"text": "ok"}', '{"text": oops}'])
    with pytest.raises(DataError, match=r"d\.jsonl, line 3: not valid JSON \(Expecting value, column 10\); fix or "
                                        r"delete the line, or set data.skip_bad_rows=true"):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 32)


def test_pretty_printed_rows_in_a_jsonl_file_are_named_by_row_and_syntax_by_line(tmp_path, tokenizer):
    """Objects written with json.dumps(indent=2) span lines: datasets reads them, but a bad row's
    line number counted one row per line (\"line 3\" for the object on line 11), and a syntax
    error was "line 1" whatever its place."""
    rows = [{"instruction": "a", "output": "b"}, {"instruction": "c", "output": "d"}, {"instruction": "e"}]
    spread = tmp_path / "spread.jsonl"
    spread.write_text("\n".join(json.dumps(row, indent=2) for row in rows) + "\n")
    with pytest.raises(DataError, match=r"spread\.jsonl, row 3: field `output`: missing"):
        data.build_sequences([spread], DataConfig(path=str(spread)), tokenizer, 32)
    lines = json.dumps(rows[:2], indent=2).splitlines()
    assert lines[3].strip() == '"output": "b"'
    lines[3] = lines[3].replace(":", "", 1)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(lines) + "\n")
    for skip in (False, True):
        with pytest.raises(DataError, match=r"broken\.jsonl, line 4, column 14: not valid JSON \(Expecting ':'"):
            data.build_sequences([broken], DataConfig(path=str(broken), skip_bad_rows=skip), tokenizer, 32)


def test_a_json_array_row_that_is_not_an_object_is_named(tmp_path, tokenizer):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"instruction": "a", "output": "b"}, "oops", {"instruction": "c", "output": "d"}]))
    with pytest.raises(DataError, match=r"d\.json, row 2: a row must be a JSON object, got str"):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 32)


def test_a_saved_dataset_dicts_other_splits_are_named_as_not_read(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = [{"instruction": "a", "output": "b"}] * 3
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows)}).save_to_disk(tmp_path / "dd")
    Dataset.from_list(rows).save_to_disk(tmp_path / "plain")
    assert datafiles.unread_splits(str(tmp_path / "dd")) == [f"{tmp_path / 'dd'} (test)"]
    assert datafiles.unread_splits(str(tmp_path)) == [f"{tmp_path / 'dd'} (test)"]  # found in a directory too
    assert datafiles.unread_splits(str(tmp_path / "plain"), None) == []


def test_skip_bad_rows_skips_lines_that_are_not_json_objects_too(tmp_path, tokenizer):
    """A truncated line (a writer killed mid-row) or a bare value is a bad row like any other
    under data.skip_bad_rows; the rows after it keep their own line numbers in what is said."""
    good = '{"instruction": "i", "output": "oooooooooo"}'
    path = write_jsonl(tmp_path / "d.jsonl", [good] * 5 + ['{"instruction": "i", "output": ', "7"] + [good] * 5
                       + ['{"instruction": "x"}'])
    seqs = data.build_sequences([path], DataConfig(path=str(path), skip_bad_rows=True, packing=False), tokenizer, 64)
    assert seqs.skipped_rows == 3 and len(seqs) == 10
    assert seqs.skipped_reasons[0].endswith("d.jsonl, line 6: not valid JSON (Expecting value, column 32)")
    assert seqs.skipped_reasons[1].endswith("line 7: a row must be a JSON object, got int")
    assert "line 13: field `output`: missing" in seqs.skipped_reasons[2]


def test_json_lines_named_json_are_read_line_by_line(tmp_path, tokenizer):
    """LLaMA-Factory's datasets often hold JSON lines under .json: a bad line is named by its
    own number (datasets' error put it at line 2) and skip_bad_rows skips it, as in .jsonl;
    a good row's error names its line too."""
    good = '{"instruction": "i", "output": "oooooooooo"}'
    path = write_jsonl(tmp_path / "d.json", [good] * 3 + ['{"instruction": "i", "output": "o"'])
    with pytest.raises(DataError, match=r"d\.json, line 4: not valid JSON"):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 64)
    seqs = data.build_sequences([path], DataConfig(path=str(path), skip_bad_rows=True, packing=False), tokenizer, 64)
    assert seqs.skipped_rows == 1 and len(seqs) == 3
    missing = write_jsonl(tmp_path / "e.json", [good, "", '{"instruction": "i"}'])
    with pytest.raises(DataError, match=r"e\.json, line 3: field `output`: missing"):
        data.build_sequences([missing], DataConfig(path=str(path)), tokenizer, 64)


def test_skip_bad_rows_with_a_bad_line_and_a_value_of_another_type(tmp_path, tokenizer):
    """Both at once: pyarrow cannot read the file whole, nor build a table from the rows
    (an int where the column holds strings); each is skipped by its line."""
    good = '{"instruction": "i", "output": "oooooooooo"}'
    path = write_jsonl(tmp_path / "d.jsonl", [good] * 5 + ['{"instruction": "i", "output": '] + [good] * 4
                       + ['{"instruction": "i", "output": 3}'] + [good] * 3)
    seqs = data.build_sequences([path], DataConfig(path=str(path), skip_bad_rows=True, packing=False), tokenizer, 64)
    assert seqs.skipped_rows == 2 and len(seqs) == 12
    assert "line 6: not valid JSON" in seqs.skipped_reasons[0]
    assert "line 11: field `output`: expected a string, got int" in seqs.skipped_reasons[1]
    with pytest.raises(DataError, match=r"e\.jsonl, line 4: field `output`: expected a string, got int"):
        data.build_sequences([write_jsonl(tmp_path / "e.jsonl", [good] * 3 + ['{"instruction": "i", "output": 3}'])],
                             DataConfig(path=str(path)), tokenizer, 64)


def test_skip_bad_rows_counts_them(tmp_path, tokenizer):
    rows = [{"instruction": "i", "output": "o" * 10}] * 20 + [{"instruction": "x"}, {"instruction": 3, "output": "y"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    seqs = data.build_sequences([path], DataConfig(path=str(path), skip_bad_rows=True, packing=False), tokenizer, 64)
    assert seqs.skipped_rows == 2 and len(seqs) == 20
    assert "line 21" in seqs.skipped_reasons[0] and "line 22" in seqs.skipped_reasons[1]


def test_missing_file_and_bad_suffix(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        datafiles.data_entries(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match=r"nope.jsonl does not exist \(a relative path is read from the working dir"):
        datafiles.data_entries("nope.jsonl")
    (tmp_path / "d.csv").write_text("a\n")
    with pytest.raises(DataError, match="unsupported suffix '.csv'"):
        datafiles.data_entries(str(tmp_path / "d.csv"))


def test_unknown_columns(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q"}])
    with pytest.raises(DataError, match="cannot tell the format"):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 32)


def test_parquet_and_json_read_through_datasets(tmp_path, tokenizer):
    import datasets

    rows = [{"text": f"row {i}"} for i in range(10)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "d.json").write_text(__import__("json").dumps(rows))
    for name in ("d.parquet", "d.json"):
        seqs = data.build_sequences([tmp_path / name], DataConfig(path=str(tmp_path / name), packing=False),
                                    tokenizer, 16)
        assert len(seqs) == 10
        assert tokenizer.decode(seqs.input_ids[3][1:6]) == "row 3"


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


def test_columns_named_otherwise_are_read_as_llama_factory_maps_them(tmp_path, tokenizer):
    """data.columns takes dataset_info.json's `columns`: the file's names for prompt, query,
    response, system and the conversation; the examples are those of the usual names, and a
    bad row, a missing column or a field under two names is said in the file's own terms."""
    alpaca = [{"question": "add 2 and 2", "context": "as numbers", "answer": "4", "persona": "a calculator"}]
    usual = [{"instruction": "add 2 and 2", "input": "as numbers", "output": "4", "system": "a calculator"}]
    columns = {"prompt": "question", "query": "context", "response": "answer", "system": "persona"}
    mapped = DataConfig(path="x", columns=columns)
    for rows_as in (write_jsonl(tmp_path / "a.jsonl", alpaca), tmp_path / "a.parquet"):
        if rows_as.suffix == ".parquet":
            import pandas as pd

            pd.DataFrame(alpaca).to_parquet(rows_as)
        assert tokenizing.read_examples([rows_as], mapped, tokenizer)[0] == \
            [tokenizing.tokenize_row(usual[0], "alpaca", tokenizer)]
    talk = [{"dialog": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "sys": "be brief"}]
    read = tokenizing.read_examples([write_jsonl(tmp_path / "s.jsonl", talk)],
                                    DataConfig(path="x", columns={"messages": "dialog", "system": "sys"}), tokenizer)
    as_sharegpt = tokenizing.tokenize_row({"conversations": talk[0]["dialog"], "system": "be brief"}, "sharegpt",
                                          tokenizer)
    assert read[0] == [as_sharegpt] and read[3] == ("messages",)
    # only the optional query missing: fine; the response's column missing: named, with the file's columns
    assert tokenizing.read_examples([write_jsonl(tmp_path / "b.jsonl", [{"question": "q", "answer": "a"}])],
                                    mapped, tokenizer)[0]
    with pytest.raises(DataError, match=r"c\.jsonl has no column response: answer \(data\.columns\), though it has "
                                        r"question; its columns are question, reply"):
        tokenizing.read_examples([write_jsonl(tmp_path / "c.jsonl", [{"question": "q", "reply": "a"}])], mapped,
                                 tokenizer)
    # a field under both names: the column data.columns names is read, as LLaMA-Factory reads it, and the
    # other is said to be left out
    both = tokenizing.read_examples([write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a",
                                                                         "output": "o"}])], mapped, tokenizer)
    assert both.examples == [tokenizing.tokenize_row({"instruction": "q", "output": "a"}, "alpaca", tokenizer)]
    assert both.unread == [f"{tmp_path / 'd.jsonl'}: its output column (answer is read as output, data.columns)"]
    # a field's own column renamed away itself is no clash: instruction -> system, input -> instruction
    chain = [{"instruction": "You translate", "input": "bonjour", "output": "hello"}]
    assert tokenizing.read_examples([write_jsonl(tmp_path / "f.jsonl", chain)],
                                    DataConfig(path="x", columns={"system": "instruction", "prompt": "input"}),
                                    tokenizer)[0] == \
        [tokenizing.tokenize_row({"system": "You translate", "instruction": "bonjour", "output": "hello"}, "alpaca",
                                 tokenizer)]
    # a directory mixing formats: a file with none of the mapped columns keeps its own names; one
    # mapping names two formats' columns, each file holding one format's
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "a.jsonl", alpaca)
    write_jsonl(mixed / "b.jsonl", [{"conversations": talk[0]["dialog"]}])
    write_jsonl(mixed / "c.jsonl", [{"dialog": talk[0]["dialog"]}])
    both = DataConfig(path="x", columns={**columns, "messages": "dialog"})
    assert len(tokenizing.read_examples(datafiles.data_entries(str(mixed)), both, tokenizer)[0]) == 3
    # LLaMA-Factory's own sharegpt entry, {formatting: sharegpt, columns: {messages: conversations}}
    entry = DataConfig(path="x", format="sharegpt", columns={"messages": "conversations", "system": "sys"})
    assert tokenizing.read_examples([write_jsonl(tmp_path / "lf.jsonl", [{"conversations": talk[0]["dialog"],
                                                                           "sys": "be brief"}])],
                                    entry, tokenizer)[0] == [as_sharegpt]
    with pytest.raises(DataError, match=r"e\.jsonl, line 1: field `answer`: expected a string, got int"):
        tokenizing.read_examples([write_jsonl(tmp_path / "e.jsonl", [{"question": "q", "answer": 4}])], mapped,
                                 tokenizer)
    # a file that keeps its own names (none of the mapped columns) is told in its own names
    with pytest.raises(DataError, match=r"g\.jsonl, line 1: field `output`: expected a string, got int"):
        tokenizing.read_examples([write_jsonl(tmp_path / "g.jsonl", [{"instruction": "q", "output": 4}])], mapped,
                                 tokenizer)
    with pytest.raises(ConfigError, match=r"data\.columns names answer: the keys are the fields instruction"):
        validate({"model": {"config": "tiny"}, "train": {"max_steps": 1}, "data": {"columns": {"answer": "a"}}})


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
    whole = len(tokenizing.tokenize_row(rows[0], "alpaca", tokenizer)[0])
    for packing, neat, truncation in ((False, False, "balanced"), (True, False, "head"), (True, True, "balanced")):
        cfg = DataConfig(path=str(path), packing=packing, neat_packing=neat, truncation=truncation)
        seqs = data.build_sequences([path], cfg, tokenizer, 48)
        assert seqs.cut == (1, whole - 48, 0)
        assert f"losing {whole - 48} answer tokens and 0 prompt tokens" in seqs.cut_note(48)
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "o" * 80}, {"text": "o"}])
    assert data.build_sequences([text], DataConfig(path=str(text)), tokenizer, 48).cut == (0, 0, 0)


def test_prompted_examples_are_packed_whole_and_text_concatenated(tmp_path, tokenizer):
    """LLaMA-Factory's sft packing: no example split across rows (an answer's tail would be
    learned in the next row without its prompt), rows closed by padding, which tokens/s leaves
    out; plain text runs on from row to row (its pretraining stage's), no padding."""
    rows = [{"instruction": f"question {i}", "output": "answer " * (3 + i % 7)} for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    seqs = data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 256)
    examples = [tokenizing.tokenize_row(row, "alpaca", tokenizer) for row in rows]
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
    from zerofit import datareport

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
    answer = int((np.array(tokenizing.tokenize_row(rows[0], "alpaca", tokenizer)[1]) != IGNORE).sum())
    for packing in (False, True):
        seqs = data.build_sequences([path], DataConfig(path=str(path), packing=packing), tokenizer, 128)
        assert seqs.prompt_only_rows == 0 and seqs.cut[:2] == (6, 0) and seqs.cut[2] > 0
        assert int((seqs.labels != IGNORE).sum()) == 6 * answer + 2 * int(
            (np.array(tokenizing.tokenize_row(rows[-1], "alpaca", tokenizer)[1]) != IGNORE).sum())
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


def test_token_ids_past_the_models_vocabulary_are_refused_before_training(tmp_path, tokenizer):
    """A tokenizer bigger than the model's embedding: it crashed in the first forward."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "i", "output": "o" * 10}] * 20)
    config = DataConfig(path=str(path), alpaca_template="alpaca")
    train, held = data.load_splits(config, tokenizer, 64, seed=0, vocab_size=len(tokenizer))
    assert len(train) and len(held) == 1  # one example held out, its packed row padded
    with pytest.raises(DataError, match=rf"the data has token id \d+ but the model's vocabulary holds 8 \(the "
                                        rf"tokenizer has {len(tokenizer)} tokens\)"):
        data.load_splits(config, tokenizer, 64, seed=0, vocab_size=8)


def test_the_chat_templates_written_for_exports_render_what_training_read(tokenizer):
    """chat / transformers / vLLM prompt an export with its tokenizer's template: for alpaca
    rows and for messages rows without a template it is the layout tokenize_row trained on,
    token for token (chat used the tokenizer's unrelated template and `role: text` lines)."""
    row = {"instruction": "Reverse the word. abc", "output": "cba"}
    ids, labels = tokenizing.tokenize_row(row, "alpaca", tokenizer, "alpaca")
    template = chatlayout.trained_chat_template(("alpaca",), tokenizer, "alpaca")
    conversation = [{"role": "user", "content": row["instruction"]}, {"role": "assistant", "content": "cba"}]
    render = lambda turns, prompt: list(tokenizer.apply_chat_template(  # noqa: E731
        turns, chat_template=template, tokenize=True, return_dict=False, add_generation_prompt=prompt))
    assert render(conversation, False) == ids
    assert render(conversation[:1], True) == [t for t, label in zip(ids, labels) if label == IGNORE]
    tokenizer.chat_template = None
    messages = {"messages": conversation}
    ids, labels = tokenizing.tokenize_row(messages, "messages", tokenizer)
    template = chatlayout.trained_chat_template(("messages",), tokenizer)
    assert render(conversation, False) == ids
    assert render(conversation[:1], True) == [t for t, label in zip(ids, labels) if label == IGNORE]
    assert chatlayout.trained_chat_template(("text",), tokenizer) is None
    assert chatlayout.trained_chat_template(("alpaca", "messages"), tokenizer) is None


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


def test_alpaca_system_and_history_are_trained_as_llama_factory_reads_them(tokenizer):
    row = {"instruction": "And times 3?", "input": "", "output": "0", "system": "You are a calculator.",
           "history": [["What is 0*2?", "0"]]}
    ids, labels = tokenizing.tokenize_row(row, "alpaca", tokenizer, "alpaca")
    assert tokenizer.decode(ids) == ("<s>You are a calculator.\n\n### Instruction:\nWhat is 0*2?\n\n### Response:\n0</s>"
                                     "### Instruction:\nAnd times 3?\n\n### Response:\n0</s>")
    assert decode_learned(tokenizer, ids, labels) == "0</s>0</s>"  # both answers, prompts and system masked
    conversation = [{"role": "system", "content": row["system"]}, {"role": "user", "content": "What is 0*2?"},
                    {"role": "assistant", "content": "0"}, {"role": "user", "content": row["instruction"]},
                    {"role": "assistant", "content": "0"}]
    rendered = tokenizer.apply_chat_template(conversation, chat_template=chatlayout.ALPACA_CHAT_TEMPLATE, tokenize=True,
                                             return_dict=False)
    assert list(rendered) == ids  # the exported template prompts as training read it
    with pytest.raises(RowError, match="history.*pairs"):
        tokenizing.tokenize_row(row | {"history": ["What is 0*2?"]}, "alpaca", tokenizer)


def test_sharegpt_rows_are_conversations(tmp_path, tokenizer):
    """LLaMA-Factory's sharegpt: {conversations: [{from, value}], system?}, human/gpt/observation/
    function_call; the same speaker names inside `messages` are read the same way."""
    share = {"system": "be brief", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                                                      {"from": "human", "value": "3+3?"}, {"from": "gpt", "value": "6"}]}
    plain = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
                          {"role": "assistant", "content": "6"}]}
    assert tokenizing.tokenize_row(share, "sharegpt", tokenizer) == tokenizing.tokenize_row(plain, "messages", tokenizer)
    named = {"messages": [{"role": "human", "content": "2+2?"}, {"role": "gpt", "content": "4"}]}
    assert decode_learned(tokenizer, *tokenizing.tokenize_row(named, "messages", tokenizer)) == "4</s>\n"
    path = write_jsonl(tmp_path / "d.jsonl", [share] * 3)
    seqs = data.build_sequences([path], DataConfig(path=str(path), packing=False), tokenizer, 64)
    assert len(seqs) == 3 and seqs.formats == ("sharegpt",)
    tools = {"messages": [{"role": "user", "content": "weather?"},
                          {"role": "function_call", "content": '{"name": "get", "arguments": {}}'},
                          {"role": "observation", "content": "sun"}, {"role": "assistant", "content": "sunny"}]}
    tokenizer.chat_template = None
    assert decode_learned(tokenizer, *tokenizing.tokenize_row(tools, "messages", tokenizer)) == \
        '{"name": "get", "arguments": {}}</s>sunny</s>'


def test_one_row_of_another_type_blames_only_itself(tmp_path, tokenizer):
    """datasets holds a field whose type differs between rows as JSON text and decodes every
    value: the answer "8" came back as 8, so one row with a number for `output` had a good
    row blamed (and skip_bad_rows dropped every digit answer). Rows are read as written."""
    rows = [{"instruction": "add", "output": str(i)} for i in range(60)]
    rows[50] = {"instruction": "add", "output": 7}
    (tmp_path / "d.json").write_text(json.dumps(rows))  # an array: its rows are counted, not its lines
    for path, where in ((write_jsonl(tmp_path / "d.jsonl", rows), "line 51"), (tmp_path / "d.json", "row 51")):
        with pytest.raises(DataError, match=rf"d\.jsonl?, {where}: field `output`: expected a string, got int"):
            data.build_sequences([path], DataConfig(path=str(path), packing=False), tokenizer, 64)
        kept = data.build_sequences([path], DataConfig(path=str(path), packing=False, skip_bad_rows=True),
                                    tokenizer, 64)
        assert kept.skipped_rows == 1 and len(kept) == 59
    texts = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]}
             for answer in ("null", "[1, 2]", "true")]
    path = write_jsonl(tmp_path / "m.jsonl", texts + [{"messages": [{"role": "user", "content": 3}]}])
    kept = data.build_sequences([path], DataConfig(path=str(path), packing=False, skip_bad_rows=True), tokenizer, 64)
    assert kept.skipped_rows == 1 and len(kept) == 3  # answers that read as JSON are text still


def test_data_with_nothing_left_or_a_missing_eval_file_is_named_so(tmp_path, tokenizer):
    """Every line bad under skip_bad_rows read as "cannot tell the format from its fields []"
    (auto) or as too few sequences for the micro batch; a missing eval_path's fix named data.path."""
    path = tmp_path / "bad.jsonl"
    path.write_text("{bad\n{worse\n")
    for fmt in ("auto", "alpaca"):
        with pytest.raises(DataError, match=r"every row was bad \(2 skipped under data.skip_bad_rows\), e.g. .*bad.jsonl, "
                                            r"line 1: not valid JSON"):
            data.build_sequences([path], DataConfig(path=str(path), skip_bad_rows=True, format=fmt), tokenizer, 64)
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "hello"}] * 20)
    with pytest.raises(DataError, match=r"nope.jsonl does not exist.*; set data.eval_path to local"):
        data.load_splits(DataConfig(path=str(good), eval_path=str(tmp_path / "nope.jsonl")), tokenizer, 64, 0, 128)


def test_turns_are_read_under_either_naming(tokenizer):
    """Published datasets mix the namings: `conversations` of {role, content}, `messages` of
    {from, value} (LLaMA-Factory maps them with dataset_info.json's role_tag / content_tag);
    each turn is read under the keys it holds. A turn with neither is a bad row naming the
    format's own."""
    tokenizer.chat_template = CHATML
    plain = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    expected = tokenizing.tokenize_row(plain, "messages", tokenizer)
    conversations = {"conversations": plain["messages"]}
    assert tokenizing.row_format(conversations) == "sharegpt"
    assert tokenizing.tokenize_row(conversations, "sharegpt", tokenizer) == expected
    shared = {"messages": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}
    assert tokenizing.tokenize_row(shared, "messages", tokenizer) == expected
    mixed = {"messages": [{"from": "human", "value": "2+2?"}, {"role": "assistant", "content": "4"}]}
    assert tokenizing.tokenize_row(mixed, "messages", tokenizer) == expected
    with pytest.raises(RowError, match=r"messages\[1\]`: expected \{role: str, content: str\}"):
        tokenizing.tokenize_row({"messages": [plain["messages"][0], {"speaker": "gpt", "text": "4"}]}, "messages",
                          tokenizer)
    with pytest.raises(RowError, match=r"conversations\[0\].role`: unknown speaker 'model'"):
        tokenizing.tokenize_row({"conversations": [{"role": "model", "content": "4"}]}, "sharegpt", tokenizer)


def test_unknown_speakers_are_bad_rows_and_text_parts_are_joined(tokenizer):
    """A chat template renders the roles it knows and skips any other without a word (a typo's
    turn vanished from training): a bad row naming the roles. OpenAI's content parts are text."""
    tokenizer.chat_template = CHATML
    typo = {"conversations": [{"from": "human", "value": "q1"}, {"from": "model", "value": "a1"},
                              {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]}
    with pytest.raises(RowError, match=r"conversations\[1\].from`: unknown speaker 'model'.*use system, user"):
        tokenizing.tokenize_row(typo, "sharegpt", tokenizer)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]},
                          {"role": "assistant", "content": "4"}]}
    plain = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    assert tokenizing.tokenize_row(parts, "messages", tokenizer) == tokenizing.tokenize_row(plain, "messages", tokenizer)
    parts["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": "x.png"}})
    with pytest.raises(RowError, match=r"messages\[0\].content`: only text parts .* not image_url"):
        tokenizing.tokenize_row(parts, "messages", tokenizer)


# A tool-calling template in the way Qwen2.5's and Llama 3.1's are: tools offered in a system
# turn, calls as tagged JSON after the assistant's text, a tool's answer in its own turn.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
    "<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                                   "parameters": {"type": "object",
                                                                  "properties": {"city": {"type": "string"}}}}}]


def tool_row(arguments, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                           "arguments": arguments}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                         {"role": "assistant", "content": "It is sunny."}], **extra}


def test_a_mapped_conversation_column_keeps_tool_calls_system_and_tools(tmp_path, tokenizer):
    """OpenAI-style messages under another column name (data.columns {messages: chat}) read as
    the messages format: tool calls learned as they are under `messages` (they were dropped:
    the column was read as ShareGPT turns); a `system` column opens the conversation unless it
    opens with its own system turn; an alpaca row's tools column is offered by the template."""
    tokenizer.chat_template = TOOL_TEMPLATE
    row = tool_row('{"city": "Paris"}', tools=WEATHER_TOOLS)
    path = write_jsonl(tmp_path / "o.jsonl", [{"chat": row["messages"], "tools": WEATHER_TOOLS}])
    read = tokenizing.read_examples([path], DataConfig(path="x", columns={"messages": "chat"}), tokenizer)[0]
    assert read == [tokenizing.tokenize_row(row, "messages", tokenizer)]
    assert "<tool_call>get_weather" in decode_learned(tokenizer, *read[0])
    with_system = tokenizing.tokenize_row({**row, "system": "be brief"}, "messages", tokenizer)
    assert tokenizer.decode(with_system[0]).count("<|im_start|>system\nbe brief<|im_end|>") == 1
    own_turn = {"role": "system", "content": "mine"}
    ids, _ = tokenizing.tokenize_row({"messages": [own_turn, *row["messages"]], "system": "theirs"}, "messages",
                                     tokenizer)
    assert "mine" in tokenizer.decode(ids) and "theirs" not in tokenizer.decode(ids)
    alpaca = {"instruction": "weather in Paris?", "output": "sunny", "tools": WEATHER_TOOLS}
    assert "Tools: get_weather" in tokenizer.decode(tokenizing.tokenize_row(alpaca, "alpaca", tokenizer)[0])
    with pytest.raises(RowError, match="the alpaca layout has no place for tools"):
        tokenizing.tokenize_row(alpaca, "alpaca", tokenizer, alpaca_template="alpaca")
    # data.format sharegpt (LLaMA-Factory's formatting) over OpenAI-style rows: the file's columns said
    with pytest.raises(DataError, match=r"o\.jsonl has no conversations column for data\.format sharegpt; its "
                                        r"columns are chat, tools: set data\.format: auto"):
        tokenizing.read_examples([path], DataConfig(path="x", format="sharegpt"), tokenizer)
    # ... as the file names them, where data.columns renamed some (they were said by the fields' names)
    renamed = write_jsonl(tmp_path / "q.jsonl", [{"q": "hi", "a": "ho"}])
    with pytest.raises(DataError, match=r"q\.jsonl has no conversations column for data\.format sharegpt; its "
                                        r"columns are a, q: set data\.format: auto"):
        tokenizing.read_examples([renamed], DataConfig(path="x", format="sharegpt",
                                                       columns={"prompt": "q", "response": "a"}), tokenizer)


def test_tool_calls_are_learned_through_the_chat_template(tmp_path, tokenizer):
    """OpenAI function calling in messages rows: the assistant's call is learned as the model's
    template writes it (arguments given as OpenAI's JSON string become the object templates
    expect), the tool's answer and the offered tools are prompt; a file mixing argument shapes
    (datasets unifies them into one struct, filling in null keys) trains each row's own."""
    tokenizer.chat_template = TOOL_TEMPLATE
    ids, labels = tokenizing.tokenize_row(tool_row('{"city": "Paris"}', tools=WEATHER_TOOLS), "messages", tokenizer)
    assert decode_learned(tokenizer, ids, labels) == (
        '<tool_call>get_weather {"city": "Paris"}</tool_call><|im_end|>\nIt is sunny.<|im_end|>\n')
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nTools: get_weather<|im_end|>")
    assert "sunny<|im_end|>" in tokenizer.decode(ids)
    as_object = tokenizing.tokenize_row(tool_row({"city": "Paris"}, tools=json.dumps(WEATHER_TOOLS)), "messages", tokenizer)
    assert as_object == (ids, labels)  # LLaMA-Factory's tools: a JSON string
    other = tool_row({"days": 3})
    other["messages"][1]["tool_calls"][0]["function"]["name"] = "get_forecast"
    path = write_jsonl(tmp_path / "d.jsonl", [tool_row({"city": "Paris"}, tools=WEATHER_TOOLS), other])
    seqs = data.build_sequences([path], DataConfig(path=str(path), packing=False), tokenizer, 256)
    learned = [decode_learned(tokenizer, i, l) for i, l in zip(seqs.input_ids, seqs.labels)]
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in learned[0]
    assert '<tool_call>get_forecast {"days": 3}</tool_call>' in learned[1] and "null" not in learned[1]


# Qwen2.5's way with tool answers: consecutive ones share one user turn, which the last closes.
GROUPED_TOOL_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
    "<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_parallel_tool_answers_a_template_groups_are_prompt(tokenizer):
    """Two calls in one turn answered by two tool turns, which the template joins into one user
    turn (the first answer alone would be closed, so a prefix ending there is not the whole's
    start): both answers are prompt, both calls and the final answer learned."""
    tokenizer.chat_template = GROUPED_TOOL_TEMPLATE
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": {}}} for name in ("get_weather", "get_time")]}
    row = {"messages": [{"role": "user", "content": "weather and time?"}, call,
                        {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "noon"},
                        {"role": "assistant", "content": "Sunny, at noon."}, {"role": "user", "content": "thanks"}]}
    ids, labels = tokenizing.tokenize_row(row, "messages", tokenizer)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(row["messages"], tokenize=False)
    assert decode_learned(tokenizer, ids, labels) == (
        "<tool_call>get_weather</tool_call><tool_call>get_time</tool_call><|im_end|>\nSunny, at noon.<|im_end|>\n")
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon" in \
        tokenizer.decode(ids)


def test_sharegpt_function_calls_are_tool_calls(tokenizer):
    """LLaMA-Factory's ShareGPT tool rows (a function_call turn holding the call's JSON, one call
    or a list, an observation answering it, a `tools` column) train as the same OpenAI messages
    do: the model's template writes the call. A function_call turn that is not a call is a bad row."""
    tokenizer.chat_template = TOOL_TEMPLATE
    call = {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})}
    share = {"conversations": [{"from": "human", "value": "weather in Paris?"}, call,
                               {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "It is sunny."}],
             "tools": json.dumps(WEATHER_TOOLS)}
    assert tokenizing.tokenize_row(share, "sharegpt", tokenizer) == \
        tokenizing.tokenize_row(tool_row({"city": "Paris"}, tools=WEATHER_TOOLS), "messages", tokenizer)
    call["value"] = json.dumps([{"name": "get_weather", "arguments": {"city": c}} for c in ("Paris", "Rome")])
    learned = decode_learned(tokenizer, *tokenizing.tokenize_row(share, "sharegpt", tokenizer))
    assert learned.startswith('<tool_call>get_weather {"city": "Paris"}</tool_call><tool_call>get_weather '
                              '{"city": "Rome"}</tool_call>')
    for value, problem in (("get_weather(Paris)", "not JSON"), ('{"city": "Paris"}', "holds the call as JSON")):
        call["value"] = value
        with pytest.raises(RowError, match=f"conversations\\[1\\].value`: .*{problem}"):
            tokenizing.tokenize_row(share, "sharegpt", tokenizer)


def test_tool_calls_without_a_template_that_renders_them(tmp_path, tokenizer):
    """A template without function calling would drop the call (an empty turn learned): a bad row
    naming the fix. Without any template the `role:` layout writes calls as JSON lines."""
    tokenizer.chat_template = CHATML
    with pytest.raises(RowError, match="does not render function calling \\(call get_weather"):
        tokenizing.tokenize_row(tool_row('{"city": "Paris"}'), "messages", tokenizer)
    with pytest.raises(RowError, match="tool get_weather"):
        tokenizing.tokenize_row({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                           "tools": WEATHER_TOOLS}, "messages", tokenizer)
    tokenizer.chat_template = None
    ids, labels = tokenizing.tokenize_row(tool_row('{"city": "Paris"}'), "messages", tokenizer)
    assert decode_learned(tokenizer, ids, labels) == '{"name": "get_weather", "arguments": {"city": "Paris"}}</s>' \
                                                     'It is sunny.</s>'
    for calls, where in (("get_weather()", "messages[1].tool_calls"), ([{"function": {}}], "tool_calls[0]")):
        row = tool_row("{}")
        row["messages"][1]["tool_calls"] = calls
        with pytest.raises(RowError, match=where.replace("[", "\\[")):
            tokenizing.tokenize_row(row, "messages", tokenizer)
    with pytest.raises(RowError, match="arguments`: not JSON"):
        tokenizing.tokenize_row(tool_row("{city: Paris}"), "messages", tokenizer)


def test_a_conversation_opening_with_the_assistant_is_a_bad_row(tmp_path, tokenizer):
    """With a chat template, nothing prompts an opening assistant turn (and templates add their
    default system prompt before it): a row error by line, not apply_chat_template's traceback."""
    good = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    odd = {"messages": [{"role": "assistant", "content": "Hi!"}] + good["messages"]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, odd])
    with pytest.raises(DataError, match=r"d.jsonl, line 3: field `messages`: the conversation opens with an assistant "
                                        r"turn.*\(messages format\); fix the row"):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 32)
    seqs = data.build_sequences([path], DataConfig(path=str(path), skip_bad_rows=True, packing=False), tokenizer, 32)
    assert (len(seqs), seqs.skipped_rows) == (2, 1)


def test_rows_of_several_formats_in_one_file(tmp_path, tokenizer):
    """Each row is read by its own fields; a row that fits none is read as the file's usual
    format, so the error names what it lacks (it named line 1, the first of the usual rows)."""
    alpaca = {"instruction": "i", "output": "o"}
    rows = [alpaca] * 5 + [{"text": "plain"}, {"messages": [{"role": "user", "content": "q"},
                                                             {"role": "assistant", "content": "a"}]}] + [alpaca] * 3
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    seqs = data.build_sequences([path], DataConfig(path=str(path), packing=False), tokenizer, 64)
    assert len(seqs) == 10 and seqs.formats == ("alpaca", "text", "messages")
    write_jsonl(path, rows + [{"instruction": "no answer"}])
    with pytest.raises(DataError, match=r"line 11: field `output`: missing \(alpaca format\)"):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 64)


@pytest.mark.parametrize("name, content, message", [
    ("empty.jsonl", b"", r"empty.jsonl is empty"),
    ("blank.jsonl", b"\n  \n", r"blank.jsonl is empty"),
    ("empty.json", b"", r"empty.json is empty"),
    ("none.json", b"[]", r"none.json holds no rows \(an empty list\)"),
    ("cut.json", b'[{"text": "a"},\n {"text": "b"', r"cut.json, line 2, column \d+: not valid JSON"),
    ("latin1.jsonl", '{"text": "ok"}\n{"text": "café"}\n'.encode("latin-1"), r"latin1.jsonl, line 2: not UTF-8 text"),
    ("wide.jsonl", '{"text": "ok"}\n'.encode("utf-16"), r"wide.jsonl is UTF-16 text .* `iconv -f utf-16 -t utf-8`"),
    # pyarrow reads a `null` line as a row of empty fields, which was said as "field `text`: missing"
    ("null.jsonl", b'{"text": "ok"}\nnull\n{"text": "ok"}\n', r"null.jsonl, line 2: a row must be a JSON object, "
                                                                r"got null; fix or delete the line"),
])
def test_files_that_hold_no_rows_or_no_text_are_named(tmp_path, tokenizer, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        data.build_sequences([path], DataConfig(path=str(path)), tokenizer, 32)


def test_directories_and_saved_datasets(tmp_path, tokenizer):
    import datasets

    rows = [{"text": f"row {i}"} for i in range(6)]
    (tmp_path / "dir" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "dir" / "a.jsonl", rows[:3])
    write_jsonl(tmp_path / "dir" / "sub" / "b.jsonl", rows[3:])
    (tmp_path / "dir" / "notes.txt").write_text("not data")
    files, = datafiles.data_entries(str(tmp_path / "dir"))
    assert files == [tmp_path / "dir" / "a.jsonl", tmp_path / "dir" / "sub" / "b.jsonl"]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                          "test": datasets.Dataset.from_list(rows[4:])}).save_to_disk(str(tmp_path / "splits"))
    for path, count in (("dir", 6), ("saved", 6), ("splits", 4)):
        cfg = DataConfig(path=str(tmp_path / path), packing=False)
        seqs = data.build_sequences(datafiles.data_entries(cfg.path), cfg, tokenizer, 16)
        assert len(seqs) == count and tokenizer.decode(seqs.input_ids[1][1:6]) == "row 1"
    (tmp_path / "nothing").mkdir()
    with pytest.raises(DataError, match="holds no .jsonl, .json or .parquet files"):
        datafiles.data_entries(str(tmp_path / "nothing"))
    assert datafiles.left_out_files(str(tmp_path / "dir"), None) == [tmp_path / "dir" / "notes.txt"]
    # LLaMA-Factory's data/ (its dataset_info.json registry beside the files), a saved dataset inside: its rows
    # are read, the metadata .json files of both are not
    (tmp_path / "dir" / "dataset_info.json").write_text('{"mine": {"file_name": "a.jsonl"}}')
    datasets.Dataset.from_list(rows[:2]).save_to_disk(str(tmp_path / "dir" / "sub" / "saved"))
    files, = datafiles.data_entries(str(tmp_path / "dir"))
    assert files == [tmp_path / "dir" / "a.jsonl", tmp_path / "dir" / "sub" / "b.jsonl", tmp_path / "dir" / "sub" / "saved"]
    seqs = data.build_sequences(files, DataConfig(path=str(tmp_path / "dir"), packing=False), tokenizer, 16)
    assert len(seqs) == 8
    # a run_dir inside data.path: its checkpoint manifests and logs are not rows (they failed a resume as
    # "cannot tell the format"), the directory is said instead
    from zerofit.runlock import LOCK_FILE

    run = tmp_path / "dir" / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / LOCK_FILE).touch()
    (run / "checkpoints" / "step-000002" / "MANIFEST.json").write_text('{"step": 2, "world_size": 1}')
    write_jsonl(run / "metrics.jsonl", [{"step": 1, "loss": 2.0}])
    assert datafiles.data_entries(str(tmp_path / "dir")) == [files]
    left_out = datafiles.left_out_files(str(tmp_path / "dir"), None)
    assert left_out == [tmp_path / "dir" / "notes.txt", run]
    assert datafiles.shown_left_out(run) == f"{run}/ (a zerofit run directory)"


def test_eval_path_takes_several_files(tmp_path, tokenizer):
    train = write_jsonl(tmp_path / "t.jsonl", [{"text": f"row {i}"} for i in range(8)])
    held = [write_jsonl(tmp_path / f"e{n}.jsonl", [{"text": "held"}] * 2) for n in (1, 2)]
    cfg = DataConfig(path=str(train), eval_path=[str(p) for p in held], packing=False)
    _, eval_set = data.load_splits(cfg, tokenizer, 16, seed=0, vocab_size=128)
    assert len(eval_set) == 4
    small = write_jsonl(tmp_path / "small.jsonl", [{"text": "held out"}])  # fills no packed row: padded, kept
    neat = DataConfig(path=str(train), eval_path=str(small), packing=True, neat_packing=True)
    _, eval_set = data.load_splits(neat, tokenizer, 64, seed=0, vocab_size=128)
    assert len(eval_set) == 1 and decode_learned(tokenizer, eval_set.input_ids[0], eval_set.labels[0]) == "held out</s>"
    assert list(eval_set.positions[0][:12]) == list(range(10)) + [0, 1]  # the padding is an example of its own


def test_max_samples_keeps_the_first_rows_of_each_entry(tmp_path, tokenizer):
    """data.max_samples is LLaMA-Factory's: the first rows of each dataset, here each data.path
    and data.eval_path entry (a directory's files in name order, one dataset), before the eval
    split. Lines past them are never read: a broken one there stops nothing."""
    import datasets

    texts = lambda seqs: [tokenizer.decode(r, skip_special_tokens=True) for r in seqs.input_ids]
    one = write_jsonl(tmp_path / "one.jsonl", [{"text": f"one {i}"} for i in range(10)])
    (tmp_path / "dir").mkdir()
    write_jsonl(tmp_path / "dir" / "a.jsonl", [{"text": f"a {i}"} for i in range(3)])
    broken = write_jsonl(tmp_path / "dir" / "b.jsonl", [{"text": f"b {i}"} for i in range(2)])
    broken.write_text(broken.read_text() + "{not json\n")
    held = write_jsonl(tmp_path / "held.jsonl", [{"text": f"held {i}"} for i in range(6)])
    cfg = DataConfig(path=[str(one), str(tmp_path / "dir")], eval_path=str(held), packing=False, max_samples=4)
    train, eval_set = data.load_splits(cfg, tokenizer, 16, seed=0, vocab_size=128)
    assert texts(train) == ["one 0", "one 1", "one 2", "one 3", "a 0", "a 1", "a 2", "b 0"]
    assert texts(eval_set) == ["held 0", "held 1", "held 2", "held 3"]
    assert train.capped and eval_set.capped and train.examples == 8
    whole = cfg.model_copy(update={"max_samples": 10, "path": str(one), "eval_path": None, "eval_fraction": 0.0})
    all_rows, _ = data.load_splits(whole, tokenizer, 16, seed=0, vocab_size=128)
    assert len(all_rows) == 10 and all_rows.capped  # as many rows as max_samples: said, nothing lost
    more = whole.model_copy(update={"max_samples": 11})
    assert not data.load_splits(more, tokenizer, 16, seed=0, vocab_size=128)[0].capped
    # a resume on other max_samples is told its data changed: the fingerprint is of the rows trained
    fewer, _ = data.load_splits(whole.model_copy(update={"max_samples": 9}), tokenizer, 16, seed=0, vocab_size=128)
    assert data.fingerprint(fewer) != data.fingerprint(all_rows)
    saved = tmp_path / "saved"  # a saved dataset and a parquet file, read through datasets, are cut so too
    datasets.Dataset.from_list([{"text": f"s {i}"} for i in range(5)]).save_to_disk(str(saved))
    datasets.Dataset.from_list([{"text": f"p {i}"} for i in range(5)]).to_parquet(str(tmp_path / "p.parquet"))
    both = whole.model_copy(update={"path": [str(saved), str(tmp_path / "p.parquet")], "max_samples": 2})
    assert texts(data.load_splits(both, tokenizer, 16, seed=0, vocab_size=128)[0]) == ["s 0", "s 1", "p 0", "p 1"]


def test_max_samples_cuts_before_the_eval_split_and_counts_bad_rows(tmp_path, tokenizer):
    """The held-out rows come from the first max_samples rows, as LLaMA-Factory splits after
    cutting; a bad row or line among them counts as one of them and is skipped, not replaced
    (LLaMA-Factory cuts before it converts rows)."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(100)])
    cfg = DataConfig(path=str(path), eval_fraction=0.1, packing=False, max_samples=20)
    train, held = data.load_splits(cfg, tokenizer, 16, seed=1, vocab_size=128)
    read = {tokenizer.decode(r, skip_special_tokens=True) for seqs in (train, held) for r in seqs.input_ids}
    assert (len(train), len(held)) == (18, 2) and read == {f"row {i}" for i in range(20)}
    rows = [{"instruction": "i", "output": "o"}, {"instruction": "no output"}, {"instruction": "j", "output": "p"}]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows * 4)
    bad.write_text("{not json\n" + bad.read_text())  # line 1
    skipping = DataConfig(path=str(bad), eval_fraction=0.0, packing=False, skip_bad_rows=True, max_samples=4)
    train, _ = data.load_splits(skipping, tokenizer, 64, seed=1, vocab_size=4096)
    assert (train.examples, train.skipped_rows) == (2, 2)  # lines 1-4: a bad line, a row, a bad row, a row
    assert "line 1: not valid JSON" in train.skipped_reasons[0] and "line 3: field `output`" in train.skipped_reasons[1]


def test_the_data_line_says_what_max_samples_cut(tmp_path, tokenizer, capsys):
    from zerofit import datareport

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(40)])
    held = write_jsonl(tmp_path / "e.jsonl", [{"text": f"held {i}"} for i in range(8)])
    for extra, said in (({"max_samples": 20}, "data: 19 examples from the first 20 rows of each data.path entry "
                                              "(data.max_samples), eval 1 held out (data.eval_fraction 0.05) -> "),
                        ({"max_samples": 5, "eval_path": str(held)},
                         "data: 5 examples from the first 5 rows of each data.path entry (data.max_samples), eval 5 "
                         "from the first 5 rows of each data.eval_path entry (data.max_samples) -> "),
                        ({"max_samples": 10, "eval_path": str(held)},
                         "data: 10 examples from the first 10 rows of each data.path entry (data.max_samples), eval 8 "
                         "from data.eval_path -> "),
                        ({"max_samples": 50}, "data: 38 examples, eval 2 held out (data.eval_fraction 0.05) -> ")):
        config = validate({"model": {"config": "tiny"}, "train": {"max_steps": 1, "seq_len": 16},
                           "data": {"path": str(path), "packing": False, **extra}})
        train_set, eval_set = data.load_splits(config.data, tokenizer, 16, 7, 4096)
        datareport.report_data(train_set, eval_set, config, tokenizer)
        assert said in capsys.readouterr().err.replace("\n", " ")


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_model_that_would_not_learn_to_stop_is_named(tokenizer):
    """A ChatML template ends a turn with <|im_end|>: with EOS </s> and no generation config
    that lists <|im_end|>, the trained model talks past its turn; a tokenizer without EOS trains
    answers without an end. The demo's own layouts end every answer with EOS."""
    assert chatlayout.stop_problem(tokenizer, ("messages",)) is None and chatlayout.stop_problem(tokenizer, ("alpaca",)) is None
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    problem = chatlayout.stop_problem(tokenizer, ("messages",))
    assert problem.startswith("the tokenizer's chat template ends an assistant turn with") and "'</s>'" in problem
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert chatlayout.stop_problem(tokenizer, ("messages",), generation_eos={end_of_turn}) is None
    tokenizer.eos_token = "<|im_end|>"
    assert chatlayout.stop_problem(tokenizer, ("sharegpt",)) is None
    tokenizer.eos_token = None
    assert chatlayout.stop_problem(tokenizer, ("text",)).startswith("the tokenizer has no EOS token")


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
    first_turn = len(tokenizing.tokenize_row({"messages": turns[:2]}, "messages", tokenizer)[0])
    assert "gamma delta" not in learned(seq_len=first_turn)  # in order, the first turn takes the room
    assert "gamma delta" in learned(seq_len=first_turn, mask_history=True)  # the last turn's first

    from zerofit.datareport import learned_note
    from zerofit.config import Config

    config = Config.model_validate({"model": {"config": "tiny"}, "train": {"max_steps": 1},
                                    "data": {"mask_history": True}})
    assert learned_note(config) == " (each conversation's last answer only: data.mask_history)"


def test_a_column_mapped_to_null_is_not_read(tmp_path, tokenizer):
    """LLaMA-Factory reads a row's system, history and tools only where its dataset_info.json
    entry names their columns (and its query only where `columns` is absent or names it):
    data.columns {system: null} leaves that field out of every file, as theirs does."""
    rows = [{"instruction": "add 2 and 2", "input": "as numbers", "output": "4", "system": "a calculator",
             "history": [["hi", "hello"]]}]
    unread = DataConfig(path="x", columns={"system": None, "history": None, "query": None})
    for file in (write_jsonl(tmp_path / "a.jsonl", rows), tmp_path / "a.parquet"):
        if file.suffix == ".parquet":
            import pandas as pd

            pd.DataFrame(rows).to_parquet(file)
        assert tokenizing.read_examples([file], unread, tokenizer).examples == \
            [tokenizing.tokenize_row({"instruction": "add 2 and 2", "output": "4"}, "alpaca", tokenizer)]
    assert tokenizing.read_examples([tmp_path / "a.jsonl"], DataConfig(path="x"), tokenizer).examples != \
        tokenizing.read_examples([tmp_path / "a.jsonl"], unread, tokenizer).examples  # read when not null
    with pytest.raises(ConfigError, match=r"data.columns prompt: null: only an optional field \(input, system, "
                                          r"history, tools\) can be left unread"):
        validate({"model": {"config": "tiny"}, "train": {"max_steps": 1}, "data": {"columns": {"prompt": None}}})


def test_the_data_line_names_a_column_left_out_for_the_one_data_columns_names(tmp_path, tokenizer, capsys):
    from zerofit import datareport

    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": f"q {i}", "output": f"a {i}", "system": "unused",
                                               "persona": "terse"} for i in range(20)])
    config = validate({"model": {"config": "tiny"}, "train": {"max_steps": 1, "seq_len": 32},
                       "data": {"path": str(path), "columns": {"system": "persona"}}})
    train_set, eval_set = data.load_splits(config.data, tokenizer, 32, 7, 4096)
    datareport.report_data(train_set, eval_set, config, tokenizer)
    assert f"not read: {path}: its system column (persona is read as system, data.columns)" in \
        capsys.readouterr().err.replace("\n", " ")


def test_a_null_field_does_not_drop_the_column_another_key_reads(tmp_path, tokenizer):
    """{prompt: input, query: null} (LLaMA-Factory's entry naming its prompt column `input`):
    the null dropped the `input` column the prompt was to be read from."""
    rows = [{"input": "add 2 and 2", "output": "4"}, {"input": "add 3 and 3", "output": "6"}]
    config = DataConfig(path="x", columns={"prompt": "input", "query": None})
    for file in (write_jsonl(tmp_path / "a.jsonl", rows),
                 write_jsonl(tmp_path / "b.jsonl", [*rows, '{"input": "x", "output": 7}'])):  # line by line: JsonRows
        read = tokenizing.read_examples([file], config.model_copy(update={"skip_bad_rows": True}), tokenizer)
        assert read.examples[:2] == [tokenizing.tokenize_row({"instruction": r["input"], "output": r["output"]},
                                                             "alpaca", tokenizer) for r in rows]


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


def test_model_chat_template_renders_the_rows_and_a_broken_one_is_named(tmp_path):
    """model.chat_template: a base model's tokenizer (or one whose template is not the one wanted)
    renders the conversations with the file's template; a template that does not parse is said
    with its line before any row is rendered."""
    from zerofit import models
    from zerofit.config import ModelConfig

    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    tokenizer = models.load_tokenizer(ModelConfig(config="tiny", chat_template=str(template)))
    assert tokenizer.chat_template == CHATML
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ids, labels = tokenizing.tokenize_row({"messages": turns}, "messages", tokenizer)
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfor")
    with pytest.raises(ConfigError, match=r"chatml.jinja, line 2: .*fix the template"):
        models.load_tokenizer(ModelConfig(config="tiny", chat_template=str(template)))
    with pytest.raises(ConfigError, match=r"model.chat_template='nowhere.jinja' is neither a file \(a relative "
                                          r"path is read from the working directory, .*\) nor a bundled template's "
                                          r"name; .* or one of alpaca, chatml, "):
        models.load_tokenizer(ModelConfig(config="tiny", chat_template="nowhere.jinja"))


# A system, two exchanges, as LLaMA-Factory's Template._encode lays them out: its register_template
# slots (src/llamafactory/data/template.py) written out by hand, the demo tokenizer's <s> and </s>
# for LLaMA-Factory's bos_token and eos_token slots.
LLAMAFACTORY_LAYOUTS = {
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
              "\n\nhello<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nbye<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nsee you<|eot_id|>",
    # Llama2Template: the system opens the first user turn
    "mistral": "<s>[INST] Be brief.\n\nhi[/INST] hello</s>[INST] bye[/INST] see you</s>",
    "llama2": "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nhi [/INST]hello</s><s>[INST] bye [/INST]see you</s>",
    "qwen": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
            "hello<|im_end|>\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\nsee you<|im_end|>\n",
    "alpaca": "Be brief.### Instruction:\nhi\n\n### Response:\nhello</s>\n\n### Instruction:\nbye\n\n"
              "### Response:\nsee you</s>\n\n",
}


@pytest.mark.parametrize("name", sorted(LLAMAFACTORY_LAYOUTS))
def test_a_bundled_template_lays_rows_out_as_llamafactory_does(name):
    """model.chat_template: llama3 (a base model's tokenizer has none): the rows train in
    LLaMA-Factory's layout of that name, its answers and their turn ends learned."""
    from zerofit import models
    from zerofit.config import ModelConfig

    tokenizer = models.load_tokenizer(ModelConfig(config="tiny", chat_template=name))
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
             {"role": "assistant", "content": "see you"}]
    ids, labels = tokenizing.tokenize_row({"messages": turns}, "messages", tokenizer)
    assert tokenizer.decode(ids) == LLAMAFACTORY_LAYOUTS[name]
    learned = tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE])
    ends = {"llama3": "<|eot_id|>", "mistral": "</s>", "llama2": "</s>", "qwen": "<|im_end|>\n", "alpaca": "</s>\n\n"}
    start = " " if name == "mistral" else ""
    assert learned == f"{start}hello{ends[name]}{start}see you{ends[name]}"


def test_a_row_whose_turns_the_tokenizer_joins_is_tokenized_turn_by_turn():
    """LLaMA-Factory's `empty` template puts the answer right after the question: a tokenizer
    that merges across that edge (vicuna's `ASSISTANT:` before a Llama-3 tokenizer's `:Hello`)
    leaves no token where the answer starts, and every such row was refused. Tokenized turn by
    turn instead, as LLaMA-Factory tokenizes every row; a row that needs no such cut keeps the
    whole text's tokens, which chat prompts get."""
    from tokenizers import Tokenizer, models as token_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(token_models.WordLevel(vocab={"<unk>": 0, "</s>": 1, "hi": 2, "ho": 3, "hiho": 4, "hohi": 5},
                                            unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = (BUNDLED / "empty.jinja").read_text()
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]
    assert tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False) == [4]  # 'hiho', one token
    assert tokenizing.tokenize_row({"messages": turns}, "messages", tokenizer) == ([2, 3], [IGNORE, 3])
    # two exchanges and a question after them: every edge cut, only the answers learned
    turns += [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}, {"role": "user", "content": "hi"}]
    assert tokenizing.tokenize_row({"messages": turns}, "messages", tokenizer) == \
        ([2, 3, 2, 3, 2], [IGNORE, 3, IGNORE, 3, IGNORE])


@pytest.mark.parametrize("name", ["alpaca", "chatml", "default", "empty", "gemma", "llama2", "llama3", "mistral", "phi",
                                  "qwen", "qwen3_nothink", "vicuna"])
def test_every_bundled_template_trains_plain_and_tool_rows(name):
    """Each name the config's doc lists is bundled (the package ships it) and renders a plain
    exchange, a call with the tool's answer and a tools list (the eight without a tool format of
    their own in LLaMA-Factory's `default` one: they refused tool rows); a role no template
    renders fails naming the template (tokenize_row refuses such a role before: ROLES)."""
    from jinja2.exceptions import TemplateError

    from zerofit import models
    from zerofit.config import ModelConfig

    assert name in models.bundled_chat_templates() and name in ModelConfig.model_fields["chat_template"].description
    tokenizer = models.load_tokenizer(ModelConfig(config="tiny", chat_template=name))
    ids, labels = tokenizing.tokenize_row({"instruction": "hi", "output": "hello"}, "alpaca", tokenizer)
    assert "hello" in tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE])
    ids, labels = tokenizing.tokenize_row(WEATHER_CALL_ROW, "messages", tokenizer)
    assert "get_weather" in decode_learned(tokenizer, ids, labels) and "sunny" in tokenizer.decode(ids)
    with pytest.raises(TemplateError, match=f"the {name} template renders system, user, assistant and tool turns, "
                                            f"not narrator"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "narrator", "content": "x"}],
                                      tokenize=False)


WEATHER_SCHEMA = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                   "parameters": {"type": "object", "properties": {
                                                       "city": {"type": "string"}}}}}
WEATHER_CALL_ROW = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                                 {"role": "assistant", "content": None, "tool_calls": [
                                     {"type": "function", "function": {"name": "get_weather",
                                                                       "arguments": '{"city": "Paris"}'}}]},
                                 {"role": "tool", "content": "sunny"},
                                 {"role": "assistant", "content": "It is sunny."}],
                    "tools": [WEATHER_SCHEMA]}
# LLaMA-Factory 0.9.5's layouts of that row, written out from its source (data/template.py's
# llama3 and qwen slots; tool_utils.py's LLAMA3_TOOL_PROMPT / QWEN_TOOL_PROMPT and the
# function_formatters): the tools' JSON joins the system text, a call is the function slot, the
# tool's answer the observation slot (ipython header; <tool_response> in a user turn).
SCHEMA_INDENTED = """{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {
                    "type": "string"
                }
            }
        }
    }
}"""
LLAMA3_TOOL_LAYOUT = (
    "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
    "You have access to the following functions. To call a function, please respond with JSON for a function call. "
    'Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. '
    "Do not use variables.\n\n" + SCHEMA_INDENTED.replace("{", "{{").replace("}", "}}") + "\n\n<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
    '<|start_header_id|>assistant<|end_header_id|>\n\n{{"name": "get_weather", "parameters": {{"city": "Paris"}}}}<|eot_id|>'
    "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    "It is sunny.<|eot_id|>")
QWEN_TOOL_LAYOUT = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    "It is sunny.<|im_end|>\n")

# mistral (LF's Llama2Template): the tools after the system text, both inside the first [INST];
# calls always a JSON list; the tool's answer put in unquoted, as LF's observation slot does.
MISTRAL_TOOL_LAYOUT = (
    '[INST] [AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", "description": '
    '"Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]'
    '[/AVAILABLE_TOOLS]\n\nWeather in Paris?[/INST][TOOL_CALLS] [{"name": "get_weather", "arguments": '
    '{"city": "Paris"}}]</s>[TOOL_RESULTS] {"content": sunny}[/TOOL_RESULTS] It is sunny.</s>')


@pytest.mark.parametrize("name", ["llama3", "qwen", "mistral"])
def test_bundled_templates_render_tool_calls_as_llamafactory_does(name):
    """A call, the tool's answer and the tools offered, under the llama3, qwen and mistral templates, in
    LLaMA-Factory's layout (they were refused as bad rows). Learned: the call (LLaMA-Factory's
    function turn is a response) and the answer after it, not the tool's answer (its observation
    turn is prompt)."""
    from datetime import datetime

    from zerofit import models
    from zerofit.config import ModelConfig

    tokenizer = models.load_tokenizer(ModelConfig(config="tiny", chat_template=name))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>",
                                                                "<|eot_id|>", "<|im_start|>", "<|im_end|>"]})
    ids, labels = tokenizing.tokenize_row(WEATHER_CALL_ROW, "messages", tokenizer)
    today = datetime.now().strftime("%d %b %Y")  # LLaMA-Factory's Llama3ToolUtils dates the prompt so
    expected = {"llama3": tokenizer.bos_token + LLAMA3_TOOL_LAYOUT.format(date=today), "qwen": QWEN_TOOL_LAYOUT,
                "mistral": tokenizer.bos_token + MISTRAL_TOOL_LAYOUT}[name]
    assert tokenizer.decode(ids) == expected
    call = {"llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
            "qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
            "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>'}
    answer = {"llama3": "It is sunny.<|eot_id|>", "qwen": "It is sunny.<|im_end|>\n", "mistral": " It is sunny.</s>"}
    assert decode_learned(tokenizer, ids, labels) == call[name] + answer[name]  # "sunny" alone: the tool's, not learned
    parallel = json.loads(json.dumps(WEATHER_CALL_ROW))
    parallel["messages"][1]["tool_calls"].append({"type": "function", "function": {"name": "get_weather",
                                                                                    "arguments": {"city": "Rome"}}})
    learned = decode_learned(tokenizer, *tokenizing.tokenize_row(parallel, "messages", tokenizer))
    parallel_call = {"llama3": '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                               '{"name": "get_weather", "parameters": {"city": "Rome"}}]<|eot_id|>',
                     "qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
                             '<|im_end|>\n',
                     "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                '{"name": "get_weather", "arguments": {"city": "Rome"}}]</s>'}
    assert learned == parallel_call[name] + answer[name]


# LLaMA-Factory 0.9.5's `default` tool format (tool_utils.py DefaultToolUtils), which its templates
# naming no tool format take (alpaca, chatml, default, empty, gemma, llama2, phi, vicuna): the texts
# below are its Template.encode_multiturn output for these rows, copied as they came (decoded), with
# the demo tokenizer. The tools' prompt ends the system text (alpaca's default one; gemma's system
# opens the first user turn, LF's Llama2Template), joined to it without a separator.
FORECAST_SCHEMA = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
DEFAULT_TOOL_PROMPT = (
    "You have access to the following tools:\n> Tool Name: get_weather\nTool Description: Weather of a city\n"
    "Tool Args:\n  - city (string, required): The city\n  - unit (string): , should be one of [C, F]\n\n"
    "Use the following format if using a tool:\n```\nAction: tool name (one of [get_weather])\n"
    'Action Input: the input to the tool, in a JSON format representing the kwargs (e.g. ```{"input": "hello world", '
    '"num_beams": 5}```)\n```\n')
DEFAULT_TOOL_LAYOUTS = {
    "alpaca": "Below is an instruction that describes a task. Write a response that appropriately completes the "
              "request.\n\n" + DEFAULT_TOOL_PROMPT + "### Instruction:\nWeather in Paris?\n\n### Response:\n"
              'Action: get_weather\nAction Input: {"city": "Paris"}</s>\n\n### Instruction:\nsunny\n\n'
              "### Response:\nIt is sunny.</s>\n\n",
    "gemma": "<s><start_of_turn>user\nBe brief." + DEFAULT_TOOL_PROMPT + "\n\nWeather in Paris?<end_of_turn>\n"
             '<start_of_turn>model\nAction: get_weather\nAction Input: {"city": "Paris"}<end_of_turn>\n'
             "<start_of_turn>tool\nsunny<end_of_turn>\n<start_of_turn>model\nIt is sunny.<end_of_turn>\n",
}


def learned_runs(tokenizer, ids, labels) -> list[str]:
    """Each run of learned tokens, decoded."""
    runs, run = [], []
    for token, label in zip(ids + [None], labels + [IGNORE]):
        if label != IGNORE:
            run.append(token)
        elif run:
            runs, run = runs + [tokenizer.decode(run)], []
    return runs


@pytest.mark.parametrize("name", sorted(DEFAULT_TOOL_LAYOUTS))
def test_templates_without_a_tool_format_render_llamafactorys_default_one(name):
    """alpaca and gemma (as the other six without a tool format of their own) render a call, the
    tool's answer and the tools offered as LLaMA-Factory does (they refused such rows): the call's
    `Action:` lines learned with the assistant turn's end, the tool's answer (its observation turn:
    the user's slot under alpaca, gemma's own `tool` turn) not; parallel calls one pair a line; a
    ShareGPT function_call / observation row trains the same."""
    from zerofit import models
    from zerofit.config import ModelConfig

    tokenizer = models.load_tokenizer(ModelConfig(config="tiny", chat_template=name))
    row = json.loads(json.dumps(WEATHER_CALL_ROW))
    row["tools"] = [FORECAST_SCHEMA]
    if name == "gemma":
        row["messages"].insert(0, {"role": "system", "content": "Be brief."})
    ids, labels = tokenizing.tokenize_row(row, "messages", tokenizer)
    assert tokenizer.decode(ids) == DEFAULT_TOOL_LAYOUTS[name]
    end = {"alpaca": "</s>\n\n", "gemma": "<end_of_turn>\n"}[name]
    call = 'Action: get_weather\nAction Input: {"city": "Paris"}'
    assert learned_runs(tokenizer, ids, labels) == [call + end, "It is sunny." + end]  # the observation between: prompt
    share = {"conversations": [{"from": m["role"], "value": m["content"]} for m in row["messages"]], "tools": row["tools"]}
    share["conversations"][-3] = {"from": "function_call", "value": json.dumps({"name": "get_weather",
                                                                                "arguments": {"city": "Paris"}})}
    share["conversations"][-2]["from"] = "observation"
    assert tokenizing.tokenize_row(share, "sharegpt", tokenizer) == (ids, labels)
    row["messages"][-3]["tool_calls"].append({"type": "function", "function": {"name": "get_weather",
                                                                               "arguments": {"city": "Rome"}}})
    parallel = learned_runs(tokenizer, *tokenizing.tokenize_row(row, "messages", tokenizer))
    assert parallel[0] == f'{call}\nAction: get_weather\nAction Input: {{"city": "Rome"}}{end}'


def test_the_default_tool_format_is_one_block_in_the_eight_templates():
    """The eight templates taking LLaMA-Factory's default tool format carry the same Jinja for it
    (a template is one self-contained file: the run's tokenizer and exports carry it)."""
    blocks = {}
    for file in BUNDLED.glob("*.jinja"):
        text = file.read_text()
        if "default_tool_prompt" in text:
            blocks[file.stem] = text[text.index("{#- Tool rows:"):text.rindex("{%- endmacro -%}")]
    assert sorted(blocks) == ["alpaca", "chatml", "default", "empty", "gemma", "llama2", "phi", "vicuna"]
    assert len(set(blocks.values())) == 1


@pytest.mark.parametrize("text, message", [
    ("", "is empty"),
    ("  \n", "is empty"),
    ("{{ 1/0 }}", r"fails on a user and an assistant turn \(ZeroDivisionError"),
    ("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}<|end|>{% endfor %}",
     "without the assistant's content, so nothing of it would be learned"),
    ("{\"chat_template\": 3}", None),  # written as .json below: not a template
])
def test_a_chat_template_that_cannot_train_is_named_before_any_row(tmp_path, text, message):
    """An empty file dropped the tokenizer's template for none; a template failing at render
    time, or leaving the answers out, failed (or learned only markup) row by row."""
    from zerofit import models
    from zerofit.config import ModelConfig

    file = tmp_path / ("t.json" if message is None else "t.jinja")
    file.write_text(text)
    with pytest.raises(ConfigError, match=message or r'a \.json template holds \{"chat_template": "\.\.\."\}'):
        models.load_tokenizer(ModelConfig(config="tiny", chat_template=str(file)))


def test_chat_templates_as_transformers_compiles_them_and_json_files_are_read(tmp_path):
    """{% generation %} (transformers' assistant-mask tag) and {% continue %} (loop controls) are
    transformers' syntax: a plain jinja2 parse refused them. A chat_template.json is read."""
    from zerofit import models
    from zerofit.config import ModelConfig

    generation = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                  "{% endgeneration %}{% else %}{% if m.role == 'tool' %}{% continue %}{% endif %}{{ m.content }}"
                  "{% endif %}\n{% endfor %}")
    (tmp_path / "g.jinja").write_text(generation)
    assert models.load_tokenizer(ModelConfig(config="tiny", chat_template=str(tmp_path / "g.jinja"))).chat_template \
        == generation
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": CHATML}))
    assert models.load_tokenizer(ModelConfig(config="tiny", chat_template=str(tmp_path / "chat_template.json"))
                                 ).chat_template == CHATML
    (tmp_path / "latin1.jinja").write_bytes(b'{{ "\xe9" }}')
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        models.load_tokenizer(ModelConfig(config="tiny", chat_template=str(tmp_path / "latin1.jinja")))


def test_a_template_failing_on_one_row_names_that_row(tokenizer):
    tokenizer.chat_template = CHATML.replace("{% endfor %}", "{% if m.content == 'boom' %}{{ 1/0 }}{% endif %}"
                                                             "{% endfor %}")
    turns = [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]
    with pytest.raises(RowError, match=r"failed on it \(ZeroDivisionError"):
        tokenizing.tokenize_row({"messages": turns}, "messages", tokenizer)


def test_a_chat_template_counts_by_its_text_on_resume(tmp_path):
    """The run's numbers depend on the template's text: one edited in place is a change (it said
    nothing for text rows), one moved is none."""
    from zerofit.config import changed_settings

    (tmp_path / "a.jinja").write_text(CHATML)
    (tmp_path / "b.jinja").write_text(CHATML)
    config = {"model": {"config": "tiny", "chat_template": str(tmp_path / "a.jinja")}, "train": {"max_steps": 1}}
    before = validate(config).fingerprinted()
    moved = validate({**config, "model": {"config": "tiny", "chat_template": str(tmp_path / "b.jinja")}})
    assert changed_settings(before, moved.fingerprinted()) == []
    (tmp_path / "a.jinja").write_text(CHATML.replace("im_", "IM_"))
    changes = changed_settings(before, validate(config).fingerprinted())
    assert len(changes) == 1 and changes[0].startswith("model.chat_template sha256 ")


def test_an_earlier_runs_template_does_not_stay_in_the_run_directory(tmp_path, tokenizer, capsys):
    from zerofit import runfiles
    from zerofit.models import hf_config

    config = validate({"run_dir": str(tmp_path), "model": {"config": "tiny"}, "train": {"max_steps": 1}})
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "chat_template.jinja").write_text(CHATML)  # an earlier run's
    tokenizer.chat_template = None
    runfiles.write_run_files(tmp_path, config, {}, tokenizer, hf_config(config.model), {})
    assert not (tmp_path / "model" / "chat_template.jinja").exists()


def test_a_chat_template_the_rows_do_not_use_is_said(tmp_path, tokenizer, capsys):
    from zerofit import datareport

    (tmp_path / "t.jinja").write_text(CHATML)
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": f"q {i}", "output": f"a {i}"} for i in range(20)])
    config = validate({"model": {"config": "tiny", "chat_template": str(tmp_path / "t.jinja")},
                       "train": {"max_steps": 1, "seq_len": 32},
                       "data": {"path": str(path), "alpaca_template": "alpaca"}})
    train_set, eval_set = data.load_splits(config.data, tokenizer, 32, 7, 4096)
    datareport.report_data(train_set, eval_set, config, tokenizer)
    assert "model.chat_template is not what the rows are laid out by (alpaca rows in the alpaca layout)" in \
        capsys.readouterr().err.replace("\n", " ")


def test_tokenizing_says_its_progress_on_rank_0_only(tmp_path, tokenizer, monkeypatch, capsys):
    """100k rows tokenized for half a minute with nothing on the screen: a plain line every 5 s
    where stderr is no terminal (rows done, rate, ETA); nothing from the other ranks."""
    from zerofit import progress

    clock = iter(range(0, 10_000, 6))  # every look at the clock 6 s after the one before
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(3)])
    tokenizing.read_examples([path], DataConfig(path=str(path)), tokenizer, progress.Shown(True, bar=True))
    said = capsys.readouterr().err.splitlines()
    assert said[:3] == [f"tokenizing d.jsonl {n}/3 rows (0.17/s, ETA {progress.clock(6 * (3 - n))})" for n in (1, 2, 3)]
    tokenizing.read_examples([path], DataConfig(path=str(path)), tokenizer, progress.Shown(False, bar=True))
    tokenizing.read_examples([path], DataConfig(path=str(path)), tokenizer)
    assert capsys.readouterr().err == ""


def test_the_next_start_reads_the_rows_it_tokenized_before(tmp_path, tokenizer, capsys):
    """A resume tokenized every row again (35 s for 100k rows on 2 cores, per start and per
    rank): the run directory keeps them, named by the files' size and time, the data keys
    tokenizing reads, the tokenizer and the code; anything of those changed tokenizes again."""
    import os
    from zerofit import datacache
    from zerofit.demo import build_tokenizer
    from zerofit.progress import Shown

    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": f"say {i}", "output": f"ok {i}"} for i in range(30)])
    cfg = DataConfig(path=str(path))
    first = datacache.read([[path]], cfg, tokenizer, tmp_path / "run", "train", Shown(True, False))
    kept = list((tmp_path / "run" / "data-cache").glob("train-*.pkl"))
    assert len(kept) == 1 and capsys.readouterr().err == ""
    # the same size and time, other rows: what the cache holds comes back (it is read, not tokenized)
    stat = path.stat()
    path.write_text(path.read_text().replace("say", "sag"))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again = datacache.read([[path]], cfg, tokenizer, tmp_path / "run", "train", Shown(True, False))
    assert again == first and "train rows: tokenized by an earlier start of this run" in capsys.readouterr().err
    # the file's time, a data key tokenizing reads, the tokenizer's template: tokenized again, the old file gone
    os.utime(path)
    assert datacache.read([[path]], cfg, tokenizer, tmp_path / "run", "train") != first
    changed = DataConfig(path=str(path), alpaca_template="alpaca")
    layouts = datacache.read([[path]], changed, tokenizer, tmp_path / "run", "train")
    assert "### Instruction:\nsag 0" in tokenizer.decode(layouts.examples[0][0])
    assert len(list((tmp_path / "run" / "data-cache").glob("train-*.pkl"))) == 1
    assert datacache.cache_key([[path]], cfg, tokenizer) != datacache.cache_key([[path]], changed, tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert datacache.cache_key([[path]], cfg, tokenizer) != datacache.cache_key([[path]], cfg, build_tokenizer())
    # a cache file cut short is tokenized again and replaced; the eval files' cache stays beside the train's
    kept = next((tmp_path / "run" / "data-cache").glob("train-*.pkl"))
    kept.write_bytes(kept.read_bytes()[:100])
    assert datacache.read([[path]], changed, tokenizer, tmp_path / "run", "train") == layouts
    datacache.read([[path]], changed, tokenizer, tmp_path / "run", "eval")
    assert len(list((tmp_path / "run" / "data-cache").glob("*.pkl"))) == 2


# --------------------------------------------------------------------- data.num_workers
def test_worker_processes_tokenize_the_same_rows_and_name_the_same_bad_row(tmp_path, tokenizer):
    """Two forked workers (data.num_workers: 2, chunks of 25 rows) give the examples, formats,
    rows skipped and their reasons of the training process alone, in the file's order; without
    skip_bad_rows the first bad row is the one named, though a later chunk holds another."""
    rows = []
    for i in range(200):
        rows.append([{"text": f"plain row {i}"}, {"instruction": f"say {i}", "output": f"{i}!"},
                     {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]},
                     {"conversations": [{"from": "human", "value": f"h{i}"}, {"from": "gpt", "value": f"g{i}"}]}][i % 4])
    rows[57], rows[140] = {"instruction": "says", "output": 5}, {"text": 5}
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    alone, forked = (tokenizing.read_examples([path], DataConfig(path=str(path), skip_bad_rows=True, num_workers=n),
                                              tokenizer) for n in (1, 2))
    assert len(alone.examples) == 198 and alone.skipped == 2
    assert forked.examples == alone.examples and forked.reasons == alone.reasons
    assert forked.formats == alone.formats and forked.skipped == alone.skipped
    assert "line 58: field `output`: expected a string" in forked.reasons[0]
    assert "line 141: field `text`" in forked.reasons[1]
    with pytest.raises(DataError, match=r"mixed\.jsonl, line 58: field `output`: expected a string, got int "
                                        r"\(alpaca format\)"):
        tokenizing.read_examples([path], DataConfig(path=str(path), num_workers=2), tokenizer)


def test_tokenizing_workers_are_forked_processes_and_keep_the_order():
    parent = os.getpid()

    def which(i):
        time.sleep(0.002)  # long enough that both workers take chunks
        return i, os.getpid()

    results = list(tokenworkers.tokenized(100, which, workers=2))
    assert [i for i, _ in results] == list(range(100))
    pids = {pid for _, pid in results}
    assert parent not in pids and len(pids) == 2


def test_closing_the_rows_early_leaves_the_later_chunks_undone():
    """A bad row ends the reading: the workers are stopped, the chunks not begun dropped, not
    tokenized for nothing (chunks of 64 rows)."""
    done = multiprocessing.get_context("fork").Value("i", 0)

    def slow(i):
        time.sleep(0.0005)
        with done.get_lock():
            done.value += 1
        return i

    results = tokenworkers.tokenized(4000, slow, workers=2)
    assert next(results) == 0
    results.close()
    assert 64 <= done.value < 4000


def test_a_killed_tokenizing_worker_is_said_with_the_fix_not_waited_on():
    parent = os.getpid()

    def dies_at_7(i):
        if i == 7 and os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return i

    with pytest.raises(tokenworkers.WorkerDied, match=r"a tokenizing worker process died .* set data.num_workers "
                                                      r"lower, 1 to tokenize in the training process alone"):
        list(tokenworkers.tokenized(100, dies_at_7, workers=2))


@pytest.mark.parametrize("setting, rows, cores, local_ranks, expected", [
    (None, 999, 16, 1, 1),  # a small file: the training process alone
    (None, 1_000, 16, 1, 16),
    (None, 1_000, 64, 1, 16),  # at most 16 by default
    (None, 100_000, 16, 4, 4),  # the node's cores shared by its ranks
    (None, 100_000, 2, 4, 1),  # fewer cores than ranks: one each
    (16, 100_000, 64, 1, 16),  # asked for: as many, up to this rank's share
    (16, 100_000, 64, 8, 8),
    (4, 3, 64, 1, 3),  # never more than the rows
], ids=["small", "auto", "auto-most", "shared", "starved", "asked", "asked-shared", "few-rows"])
def test_worker_count(setting, rows, cores, local_ranks, expected):
    assert tokenworkers.worker_count(setting, rows, cores, local_ranks) == expected


def test_a_shared_cache_dir_serves_another_run_and_keeps_every_tokenization(tmp_path, tokenizer, capsys):
    """data.cache_dir (LLaMA-Factory's tokenized_path): a second run directory reads the rows the
    first tokenized; another tokenization of the data is kept beside it, nothing removed (the
    run's own data-cache replaces its older one); an unwritable directory is said, the run goes on."""
    from zerofit import datacache
    from zerofit.progress import Shown

    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": f"say {i}", "output": f"ok {i}"} for i in range(30)])
    shared = tmp_path / "shared"
    cfg = DataConfig(path=str(path), cache_dir=str(shared))
    first = datacache.read([[path]], cfg, tokenizer, tmp_path / "run-a", "train", Shown(True, False))
    assert [p.name for p in shared.iterdir()] == [f"train-{datacache.cache_key([[path]], cfg, tokenizer)}.pkl"]
    assert not (tmp_path / "run-a" / "data-cache").exists()
    capsys.readouterr()
    assert datacache.read([[path]], cfg, tokenizer, tmp_path / "run-b", "train", Shown(True, False)) == first
    assert "train rows: data.cache_dir, tokenized before from the same files" in capsys.readouterr().err
    other = DataConfig(path=str(path), cache_dir=str(shared), alpaca_template="alpaca")
    datacache.read([[path]], other, tokenizer, tmp_path / "run-b", "train")
    assert len(list(shared.glob("train-*.pkl"))) == 2
    # a directory that cannot be made (a file stands where it would go: unwritable even to root)
    (tmp_path / "a-file").write_text("")
    blocked = DataConfig(path=str(path), cache_dir=str(tmp_path / "a-file" / "cache"), max_samples=5)
    assert len(datacache.read([[path]], blocked, tokenizer, tmp_path / "run-c", "train", Shown(True, False)).examples) == 5
    assert "the tokenized rows could not be kept (Not a directory)" in capsys.readouterr().err
    # the run's own data-cache/ a file: said too (each start tokenized again without a word)
    (tmp_path / "run-d").mkdir()
    (tmp_path / "run-d" / "data-cache").write_text("")
    datacache.read([[path]], DataConfig(path=str(path)), tokenizer, tmp_path / "run-d", "train", Shown(True, False))
    said = capsys.readouterr().err.replace("\n", "")
    assert f"{tmp_path / 'run-d' / 'data-cache'}: the tokenized rows could not be kept (" in said


def machine_of_two(tmp_path, tokenizer, cfg: DataConfig, path: Path, monkeypatch) -> dict[str, tuple]:
    """datacache.read on the two ranks of one machine (threads meeting at a real barrier): what
    each returned, and the ranks_tokenizing of each tokenization each made."""
    import threading

    from zerofit import datacache

    calls, real = [], datacache.read_examples
    monkeypatch.setattr(datacache, "read_examples", lambda *args, **kwargs: (
        calls.append((threading.current_thread().name, kwargs.get("ranks_tokenizing"))), real(*args, **kwargs))[1])
    barrier, found = threading.Barrier(2, timeout=60), {}

    def rank(first: bool) -> None:
        node = datacache.Node(first=first, ranks=2, wait=barrier.wait)
        found[threading.current_thread().name] = datacache.read([[path]], cfg, tokenizer, tmp_path / "run", "train",
                                                                node=node)

    ranks = [threading.Thread(target=rank, args=(name == "first",), name=name) for name in ("second", "first")]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(timeout=120)
    return {name: (found[name], [made for who, made in calls if who == name]) for name in ("first", "second")}


def test_one_rank_of_a_machine_tokenizes_with_all_its_cores_and_the_others_read_its_rows(tmp_path, tokenizer,
                                                                                        monkeypatch):
    """LLaMA-Factory's main_process_first: the second rank waits (it starts first here) and reads
    what the first kept; where the first could not keep them, it tokenizes them itself."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": f"say {i}", "output": f"ok {i}"} for i in range(40)])
    cfg = DataConfig(path=str(path))
    ranks = machine_of_two(tmp_path, tokenizer, cfg, path, monkeypatch)
    assert ranks["first"][1] == [1]  # tokenized once, as the machine's only tokenizing rank: all its cores
    assert ranks["second"][1] == []
    assert ranks["second"][0] == ranks["first"][0] and len(ranks["first"][0].examples) == 40
    # the rows kept: both read them
    assert [made for _, (_, made) in machine_of_two(tmp_path, tokenizer, cfg, path, monkeypatch).items()] == [[], []]
    # a data.cache_dir that cannot take them (a file stands where it would go): each rank tokenizes
    (tmp_path / "a-file").write_text("")
    blocked = DataConfig(path=str(path), cache_dir=str(tmp_path / "a-file" / "cache"))
    ranks = machine_of_two(tmp_path, tokenizer, blocked, path, monkeypatch)
    assert ranks["first"][1] == [1] and ranks["second"][1] == [1]
    assert ranks["second"][0] == ranks["first"][0]


def test_cache_dir_is_a_path_and_llamafactorys_tokenized_path_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert DataConfig(cache_dir="~/tok").cache_dir == f"{tmp_path}/tok"
    with pytest.raises(ConfigError, match=r"data.tokenized_path; LLaMA-Factory's / HF Trainer's tokenized_path is "
                                          r"data.cache_dir"):
        validate({"model": {"config": "demo"}, "train": {"max_steps": 1}, "data": {"tokenized_path": "x"}})


def test_tokenizing_workers_die_with_a_parent_killed_outright(tmp_path):
    """They hold the parent's files (the run's lock, a pipe into tee): a parent SIGKILLed (the
    OOM killer) left them tokenizing on, the run refused as 'in use'."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys, time\n"
        "from zerofit import tokenworkers\n"
        "def slow(i):\n"
        "    os.write(1, f'{os.getpid()}\\n'.encode())  # one write: two workers' lines never interleave\n"
        "    time.sleep(0.05)\n"
        "    return i\n"
        "for _ in tokenworkers.tokenized(100000, slow, workers=2):\n"
        "    pass\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(tokenworkers.__file__).parent.parent)})
    workers = {int(parent.stdout.readline()) for _ in range(40)} - {parent.pid}
    assert len(workers) == 2
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while any(map(running, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(running, workers))


def running(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_rows_longer_than_the_tokenizers_maximum_warn_no_one_in_no_worker(tmp_path):
    """transformers warns "Token indices sequence length is longer than ..." once per process
    against model_max_length, which zerofit never uses (it cuts to train.seq_len and says how
    many it cut): each forked worker said it again. In a process of its own, as the run's."""
    path = write_jsonl(tmp_path / "long.jsonl", [{"text": f"a row of more than eight tokens, number {i}"}
                                                  for i in range(200)])
    script = ("from pathlib import Path\nfrom zerofit import tokenizing\n"
              "from zerofit.dataconfig import DataConfig\n"
              "from zerofit.demo import build_tokenizer\n"
              "for workers in (2, 1):\n"
              "    tokenizer = build_tokenizer()\n"
              "    tokenizer.model_max_length = 8\n"
              f"    read = tokenizing.read_examples([Path({str(path)!r})], DataConfig(path={str(path)!r}, num_workers=workers),"
              " tokenizer)\n"
              "    print(workers, len(read.examples), len(read.examples[0][0]),"
              " tokenizer.deprecation_warnings.get('sequence-length-is-longer-than-the-specified-maximum', False))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    said = [line.split() for line in done.stdout.splitlines()]
    assert [(w, rows, flag) for w, rows, _, flag in said] == [("2", "200", "False"), ("1", "200", "False")]  # as found
    assert all(int(tokens) > 8 for *_, tokens, _ in said)  # every row read whole
    assert "Token indices sequence length" not in done.stderr
