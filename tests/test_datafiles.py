"""Data files -> rows (datafiles.py): files, directories, saved datasets, bad lines, columns, max_samples."""
import json

import pytest
from conftest import decode_learned, write_jsonl

from zerofit.config.data import DataConfig
from zerofit.config.load import validate
from zerofit.core.errors import ConfigError
from zerofit.data import files as datafiles
from zerofit.data import pipeline as data
from zerofit.data import tokenize
from zerofit.data.files import DataError


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
        assert tokenize.read_examples([rows_as], mapped, tokenizer)[0] == \
            [tokenize.tokenize_row(usual[0], "alpaca", tokenizer)]
    talk = [{"dialog": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "sys": "be brief"}]
    read = tokenize.read_examples([write_jsonl(tmp_path / "s.jsonl", talk)],
                                    DataConfig(path="x", columns={"messages": "dialog", "system": "sys"}), tokenizer)
    as_sharegpt = tokenize.tokenize_row({"conversations": talk[0]["dialog"], "system": "be brief"}, "sharegpt",
                                          tokenizer)
    assert read[0] == [as_sharegpt] and read[3] == ("messages",)
    # only the optional query missing: fine; the response's column missing: named, with the file's columns
    assert tokenize.read_examples([write_jsonl(tmp_path / "b.jsonl", [{"question": "q", "answer": "a"}])],
                                    mapped, tokenizer)[0]
    with pytest.raises(DataError, match=r"c\.jsonl has no column response: answer \(data\.columns\), though it has "
                                        r"question; its columns are question, reply"):
        tokenize.read_examples([write_jsonl(tmp_path / "c.jsonl", [{"question": "q", "reply": "a"}])], mapped,
                                 tokenizer)
    # a field under both names: the column data.columns names is read, as LLaMA-Factory reads it, and the
    # other is said to be left out
    both = tokenize.read_examples([write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a",
                                                                         "output": "o"}])], mapped, tokenizer)
    assert both.examples == [tokenize.tokenize_row({"instruction": "q", "output": "a"}, "alpaca", tokenizer)]
    assert both.unread == [f"{tmp_path / 'd.jsonl'}: its output column (answer is read as output, data.columns)"]
    # a field's own column renamed away itself is no clash: instruction -> system, input -> instruction
    chain = [{"instruction": "You translate", "input": "bonjour", "output": "hello"}]
    assert tokenize.read_examples([write_jsonl(tmp_path / "f.jsonl", chain)],
                                    DataConfig(path="x", columns={"system": "instruction", "prompt": "input"}),
                                    tokenizer)[0] == \
        [tokenize.tokenize_row({"system": "You translate", "instruction": "bonjour", "output": "hello"}, "alpaca",
                                 tokenizer)]
    # a directory mixing formats: a file with none of the mapped columns keeps its own names; one
    # mapping names two formats' columns, each file holding one format's
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "a.jsonl", alpaca)
    write_jsonl(mixed / "b.jsonl", [{"conversations": talk[0]["dialog"]}])
    write_jsonl(mixed / "c.jsonl", [{"dialog": talk[0]["dialog"]}])
    both = DataConfig(path="x", columns={**columns, "messages": "dialog"})
    assert len(tokenize.read_examples(datafiles.data_entries(str(mixed)), both, tokenizer)[0]) == 3
    # LLaMA-Factory's own sharegpt entry, {formatting: sharegpt, columns: {messages: conversations}}
    entry = DataConfig(path="x", format="sharegpt", columns={"messages": "conversations", "system": "sys"})
    assert tokenize.read_examples([write_jsonl(tmp_path / "lf.jsonl", [{"conversations": talk[0]["dialog"],
                                                                           "sys": "be brief"}])],
                                    entry, tokenizer)[0] == [as_sharegpt]
    with pytest.raises(DataError, match=r"e\.jsonl, line 1: field `answer`: expected a string, got int"):
        tokenize.read_examples([write_jsonl(tmp_path / "e.jsonl", [{"question": "q", "answer": 4}])], mapped,
                                 tokenizer)
    # a file that keeps its own names (none of the mapped columns) is told in its own names
    with pytest.raises(DataError, match=r"g\.jsonl, line 1: field `output`: expected a string, got int"):
        tokenize.read_examples([write_jsonl(tmp_path / "g.jsonl", [{"instruction": "q", "output": 4}])], mapped,
                                 tokenizer)
    with pytest.raises(ConfigError, match=r"data\.columns names answer: the keys are the fields instruction"):
        validate({"model": {"config": "tiny"}, "train": {"max_steps": 1}, "data": {"columns": {"answer": "a"}}})


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
    from zerofit.core.runlock import LOCK_FILE

    run = tmp_path / "dir" / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / LOCK_FILE).touch()
    (run / "checkpoints" / "step-000002" / "MANIFEST.json").write_text('{"step": 2, "world_size": 1}')
    write_jsonl(run / "metrics.jsonl", [{"step": 1, "loss": 2.0}])
    assert datafiles.data_entries(str(tmp_path / "dir")) == [files]
    left_out = datafiles.left_out_files(str(tmp_path / "dir"), None)
    assert left_out == [tmp_path / "dir" / "notes.txt", run]
    assert datafiles.shown_left_out(run) == f"{run}/ (a zerofit run directory)"


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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
    from zerofit.train import datareport

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
        assert tokenize.read_examples([file], unread, tokenizer).examples == \
            [tokenize.tokenize_row({"instruction": "add 2 and 2", "output": "4"}, "alpaca", tokenizer)]
    assert tokenize.read_examples([tmp_path / "a.jsonl"], DataConfig(path="x"), tokenizer).examples != \
        tokenize.read_examples([tmp_path / "a.jsonl"], unread, tokenizer).examples  # read when not null
    with pytest.raises(ConfigError, match=r"data.columns prompt: null: only an optional field \(input, system, "
                                          r"history, tools\) can be left unread"):
        validate({"model": {"config": "tiny"}, "train": {"max_steps": 1}, "data": {"columns": {"prompt": None}}})


def test_the_data_line_names_a_column_left_out_for_the_one_data_columns_names(tmp_path, tokenizer, capsys):
    from zerofit.train import datareport

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
        read = tokenize.read_examples([file], config.model_copy(update={"skip_bad_rows": True}), tokenizer)
        assert read.examples[:2] == [tokenize.tokenize_row({"instruction": r["input"], "output": r["output"]},
                                                             "alpaca", tokenizer) for r in rows]
