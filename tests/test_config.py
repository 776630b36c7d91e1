from pathlib import Path

import pytest
import yaml
from conftest import run_zerofit, tiny_config, write_config

from zerofit import cli
from zerofit.config.load import dump_yaml, example_yaml, load, parse_override, validate
from zerofit.config.schema import Config, changed_settings
from zerofit.core.errors import ConfigError
from zerofit.train import runfiles


def test_demo_config_is_the_default():
    config = load()
    assert config.model.config == "demo" and config.data.path == "demo"
    assert config.zero.stage == 3 and config.zero.offload_optimizer == "cpu"
    assert config.run_dir == "runs/demo"


def test_unknown_key_names_the_nearest_valid_one(tmp_path):
    raw = tiny_config(tmp_path / "run")
    raw["train"]["micro_bach_size"] = 2
    with pytest.raises(ConfigError, match=r"unknown key train\.micro_bach_size; did you mean train\.micro_batch_size"):
        validate(raw)
    del raw["train"]["micro_bach_size"]
    raw["evaluation"] = {"every_steps": 5}  # difflib's nearest was elastic
    with pytest.raises(ConfigError, match=r"unknown key evaluation; did you mean eval\?"):
        validate(raw)


def test_unknown_section_lists_the_valid_ones(tmp_path):
    raw = tiny_config(tmp_path / "run")
    raw["zzz"] = {"a": 1}
    with pytest.raises(ConfigError, match=r"unknown key zzz; valid keys in top level: run_dir, model"):
        validate(raw)


def test_bad_value_names_field_value_and_allowed(tmp_path):
    raw = tiny_config(tmp_path / "run", zero={"offload_param": "disk"})
    with pytest.raises(ConfigError) as err:
        validate(raw)
    assert "zero.offload_param='disk'" in str(err.value)
    assert "'none', 'cpu' or 'nvme'" in str(err.value)


def test_a_yaml_boolean_and_a_missing_section_say_what_to_write(tmp_path):
    """`offload_optimizer: yes` reached the error as True with no word of why; `train:` left out
    read "required but missing" without saying what it holds."""
    path = write_config(tmp_path / "c.yaml", {"model": {"config": "tiny"}})
    path.write_text(path.read_text() + "zero: {offload_optimizer: yes}\n")
    with pytest.raises(ConfigError) as err:
        load(path)
    said = str(err.value)
    assert "train: required but missing (how long to train: train.max_steps or train.epochs)" in said
    assert "zero.offload_optimizer=True: Input should be 'none', 'cpu' or 'nvme' (YAML reads an unquoted yes" in said
    with pytest.raises(ConfigError, match=r"model: required but missing \(model.path"):
        validate({"train": {"max_steps": 1}})


def test_bad_type(tmp_path):
    raw = tiny_config(tmp_path / "run", train={"micro_batch_size": "four"})
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size='four': Input should be a valid integer"):
        validate(raw)


def test_data_paths_that_name_no_file_and_values_of_neither_type_are_said_once(tmp_path):
    """An empty data.path read nothing and failed later as "0 sequences, fewer than one micro
    batch"; a value that is neither of a field's types was said once per type pydantic tried."""
    with pytest.raises(ConfigError, match=r"data.path \[\] names no file: .* or drop the key for the bundled demo"):
        validate(tiny_config(tmp_path, data={"path": []}))
    with pytest.raises(ConfigError, match=r"data.eval_path \['a.jsonl', ''\] names no file: .*data.eval_fraction"):
        validate(tiny_config(tmp_path, data={"eval_path": ["a.jsonl", ""]}))
    with pytest.raises(ConfigError) as refused:
        validate(tiny_config(tmp_path, data={"path": None}))
    assert str(refused.value) == "invalid config: data.path=None: should be a valid string or a valid list"
    with pytest.raises(ConfigError, match=r"^invalid config: data.columns.prompt=3: Input should be a valid string$"):
        validate(tiny_config(tmp_path, data={"columns": {"prompt": 3}}))


def test_cross_field_rules(tmp_path):
    with pytest.raises(ConfigError, match="NVMe offload needs zero.nvme_path"):
        validate(tiny_config(tmp_path, zero={"offload_optimizer": "nvme"}))
    with pytest.raises(ConfigError, match="needs zero.stage=3"):
        validate(tiny_config(tmp_path, zero={"stage": 2, "offload_param": "cpu"}))
    with pytest.raises(ConfigError, match="not both"):
        validate(tiny_config(tmp_path, train={"epochs": 1}))
    with pytest.raises(ConfigError, match="model.path .* or model.config"):
        validate(tiny_config(tmp_path, model={"config": None}))


def test_bad_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  lr: [1, 2\nmodel: {}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml at line \d+, column \d+ is not valid YAML"):
        load(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"config file .* is a directory; pass --config FILE"):
        load(tmp_path)
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match=r"binary.yaml is not UTF-8 text \(byte 0 is b'\\xff'\); is it the config"):
        load(tmp_path / "binary.yaml")


def test_run_files_with_bytes_that_are_no_text_are_read_around_them(tmp_path):
    """A torn write (or a disk error) leaves bytes that are no UTF-8: the doctor read the run's
    timeline with a UnicodeDecodeError traceback."""
    from zerofit.core.files import read_json, read_jsonl

    (tmp_path / "memory.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe\n{"step": 2}\n')
    assert read_jsonl(tmp_path / "memory.jsonl") == [{"step": 1}, {"step": 2}]
    (tmp_path / "plan.json").write_bytes(b'{"a": "\xff"}')
    assert read_json(tmp_path / "plan.json") is None


def test_overrides_are_typed(tmp_path):
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run"))
    config = load(path, ["train.lr=3e-4", "train.micro_batch_size=8", "zero.offload_param=cpu",
                         "model.gradient_checkpointing=true", "data.path=[a.jsonl, b.jsonl]"])
    assert config.train.lr == 3e-4 and config.train.micro_batch_size == 8
    assert config.zero.offload_param == "cpu" and config.model.gradient_checkpointing is True
    assert config.data.path == ["a.jsonl", "b.jsonl"]
    assert "micro_batch_size" in config.train.model_fields_set


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_override("train.lr")


def test_example_yaml_documents_every_key_and_loads_back(tmp_path):
    text = example_yaml()
    for name, field in Config.model_fields.items():
        assert f"{name}:" in text
    assert "# Elements per optimizer-step sub group." in text
    # the docs wrapped as comments of at most 88 columns (they ran to 400)
    assert max(len(line) for line in text.splitlines() if line.lstrip().startswith("# ")) <= 88
    path = tmp_path / "example.yaml"
    path.write_text(text)
    config = load(path)
    assert config.train.max_steps == 300 and config.model.config == "demo"
    assert config == validate({"model": {"config": "demo"}, "train": {"max_steps": 300}})  # the rest: defaults
    # the planner's keys are left to it: a config started from the example is planned
    assert "  #! offload_optimizer: \"cpu\"" in text and "  #! gradient_checkpointing: true" in text
    assert '  config: "demo"  # the example\'s; delete this line when you set model.path' in text
    assert not config.zero.model_fields_set & {"offload_optimizer", "offload_param", "reduce_bucket_size"}
    assert "gradient_checkpointing" not in config.model.model_fields_set
    # doing what its header says (delete the `#! `) fixes a key: removing only the `#` left `! key:`, a YAML tag
    assert "delete the `#! ` to fix one" in text
    path.write_text(text.replace('  #! offload_optimizer: "cpu"', '  offload_optimizer: "cpu"'))
    assert "offload_optimizer" in load(path).zero.model_fields_set


@pytest.mark.e2e
def test_config_example_refuses_a_config_it_would_ignore(tmp_path):
    done = run_zerofit(["config", "--example", "--config", str(tmp_path / "c.yaml")], check=False)
    assert done.returncode == 1 and "config --example prints every key with its default" in done.stderr


def test_config_says_which_keys_the_planner_will_choose(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("model: {config: tiny}\nzero: {offload_param: none}\ntrain: {global_batch_size: 8, max_steps: 5}\n")
    assert cli.main(["config", "--config", str(path)]) == 0
    said = capsys.readouterr().out
    assert "Keys marked `planner` are not set, so the planner chooses them" in said.splitlines()[0]
    assert "  offload_optimizer: cpu  # planner\n" in said and "  offload_param: none\n" in said  # set: kept
    assert "  micro_batch_size: 1  # planner\n" in said and "  seq_len: 1024\n" in said
    assert yaml.safe_load(said)["zero"]["offload_optimizer"] == "cpu"  # still a config file
    path.write_text("model: {config: tiny}\ntrain: {max_steps: 5}\n")
    assert cli.main(["config", "--config", str(path)]) == 0
    said = capsys.readouterr().out
    assert "  micro_batch_size: 1\n" in said  # no global batch: no split to choose
    assert cli.main(["config", "--config", str(path), "--set", "plan.enabled=false"]) == 0
    assert "# planner" not in capsys.readouterr().out


def test_set_without_a_config_replaces_the_demos_model_and_data(tmp_path):
    """--set over the embedded demo: a model.path is the model (not a second one beside the
    demo's model.config) and a data.path's format is detected (not the demo's alpaca)."""
    config = load(None, [f"model.path={tmp_path}", f"data.path={tmp_path / 'd.jsonl'}"])
    assert config.model.path == str(tmp_path) and config.model.config is None
    assert config.data.format == "auto"
    assert load(None, []).data.format == "alpaca"  # the demo itself unchanged
    with pytest.raises(ConfigError, match="not both"):  # in a config file both are the user's
        write_config(tmp_path / "c.yaml", {"model": {"config": "tiny", "path": str(tmp_path)}})
        load(tmp_path / "c.yaml", [])


def test_yaml_files_read_as_a_user_means_them(tmp_path, monkeypatch, capsys):
    """PyYAML's YAML 1.1 reads 1e9 and 3e-4 as strings (a file failed where --set worked),
    keeps the last of two equal keys silently, and leaves ~ and $VARS in paths."""
    monkeypatch.setenv("ZEROFIT_TEST_ROOT", str(tmp_path))
    path = tmp_path / "c.yaml"
    path.write_text("model: {config: tiny}\nrun_dir: $ZEROFIT_TEST_ROOT/run\ndata: {path: ~/d.jsonl}\n"
                    "zero: {stage: 3, sub_group_size: 1e8}\ntrain: {lr: 3e-4, max_steps: 5}\n")
    config = load(path)
    assert config.zero.sub_group_size == 100_000_000 and config.train.lr == 3e-4
    assert config.run_dir == f"{tmp_path}/run" and config.data.path == str(Path.home() / "d.jsonl")
    path.write_text("model: {config: tiny}\ntrain: {max_steps: 5}\ntrain: {lr: 1.0}\n")
    with pytest.raises(ConfigError, match="line 3, column 1 .* the key 'train' appears twice"):
        load(path)
    assert cli.main(["config", "--run-dir", "0755"]) == 0  # a name, not an octal number
    assert "run_dir: '0755'" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"plan.gpu_mem='24' is 24 bytes; write the unit"):
        load(None, ["plan.gpu_mem=24"])


@pytest.mark.e2e
def test_fp16_without_a_gpu_is_refused_before_the_build(tmp_path):
    """DeepSpeed's CPU accelerator has no fp16: its sanity check raised after the model was built,
    a [rank0] traceback."""
    done = run_zerofit(["train", "--run-dir", str(tmp_path / "run"), "--set", "train.precision=fp16"], check=False,
                       timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "zerofit: error: train.precision fp16 needs a GPU: DeepSpeed's CPU accelerator trains in bf16 or fp32" \
        in done.stderr
    assert not (tmp_path / "run" / "model").exists()  # nothing built


@pytest.mark.e2e
def test_a_bad_config_is_said_first_and_before_deepspeed_loads():
    """The reason on the first line of stderr, nothing on stdout, and no DeepSpeed import first
    (it took seconds and printed its accelerator guess ahead of the error)."""
    done = run_zerofit(["train", "--set", "train.lrr=1"], check=False, timeout=60)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.startswith("zerofit: error: invalid config: unknown key train.lrr"), done.stderr


def test_cli_exit_codes(tmp_path, capsys):
    assert cli.main(["train", "--set", "train.lrr=1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zerofit: error: invalid config: unknown key train.lrr; did you mean train.lr?")
    for argv, said in ((["train", "--bogus"], "unrecognized arguments: --bogus"),
                       (["train", "--set", "train.lr"], "'train.lr' is not KEY=VALUE"),
                       (["plan"], "one of the arguments --model --config --presets is required")):
        with pytest.raises(SystemExit) as usage:
            cli.main(argv)
        assert usage.value.code == 2 and said in capsys.readouterr().err


def test_plan_presets_lists_what_model_config_accepts(capsys):
    assert cli.main(["plan", "--presets"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "llama-8b" in listed and "8,030,261,248 parameters" in listed["llama-8b"]
    assert "tiny" in listed and "2 layers, hidden 64" in listed["tiny"]


def test_max_samples_needs_data_files(tmp_path):
    """data.max_samples keeps the first rows of files: synthetic data has none (its count is
    synthetic_samples); a count below 1 is no count; LLaMA-Factory's flat key is moved under data."""
    with pytest.raises(ConfigError, match=r"data.max_samples 100 keeps the first rows of each data file, but "
                                          r"data.path synthetic reads none .*: set data.synthetic_samples: 100 instead"):
        validate(tiny_config(tmp_path, data_path="synthetic", data={"max_samples": 100}))
    with pytest.raises(ConfigError, match=r"data\.max_samples=0: Input should be greater than or equal to 1"):
        validate(tiny_config(tmp_path, data={"max_samples": 0}))
    assert validate(tiny_config(tmp_path, data={"max_samples": 100})).data.max_samples == 100
    raw = tiny_config(tmp_path)
    raw["max_samples"] = 100
    with pytest.raises(ConfigError, match="unknown key max_samples; it is a key of data: move it under `data:`"):
        validate(raw)


def test_eval_examples_is_one_way_to_the_eval_set(tmp_path):
    """data.eval_examples (a count held out) excludes data.eval_path and an eval_fraction the
    user chose; the default eval_fraction the run's own config.yaml writes beside it loads back."""
    with pytest.raises(ConfigError, match=r"data.eval_examples 200 holds training rows out for eval, but "
                                          r"data.eval_path names the eval set: drop one of the two"):
        validate(tiny_config(tmp_path, data={"eval_examples": 200, "eval_path": "e.jsonl"}))
    with pytest.raises(ConfigError, match=r"data.eval_examples 200 and data.eval_fraction 0.1 both say how many rows "
                                          r"to hold out: drop data.eval_fraction"):
        validate(tiny_config(tmp_path, data={"eval_examples": 200, "eval_fraction": 0.1}))
    with pytest.raises(ConfigError, match=r"data\.eval_examples=0: Input should be greater than or equal to 1"):
        validate(tiny_config(tmp_path, data={"eval_examples": 0}))
    config = validate(tiny_config(tmp_path, data={"eval_examples": 200}))  # tiny_config sets eval_fraction 0.05
    assert validate(yaml.safe_load(dump_yaml(config))).data.eval_examples == 200
    assert load(None, ["data.eval_examples=20"]).data.eval_examples == 20  # beside the demo's eval_fraction 0.05
    raw = tiny_config(tmp_path)
    raw["data"]["val_size"] = 200
    with pytest.raises(ConfigError, match="LLaMA-Factory's / HF Trainer's val_size is data.eval_fraction for a "
                                          "fraction, data.eval_examples for an integer"):
        validate(raw)


@pytest.mark.parametrize("data, message", [
    ({"mask_history": True, "train_on_prompt": True}, "LLaMA-Factory refuses the two together"),
    ({"mask_history": True, "truncation": "head"}, "which a head cut drops first: set data.truncation: balanced"),
])
def test_ways_to_learn_that_contradict_are_refused(tmp_path, data, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(tmp_path, data=data))


@pytest.mark.parametrize("columns", [60, 80, 100, 200])
def test_train_help_is_short_and_names_every_key(capsys, monkeypatch, columns):
    """train --help was a 22.7 KB dump of every key's whole doc on 400-character lines: its flags,
    then every key on one line within the terminal's width (at most 100 columns), the planner's
    marked, and where the whole docs are."""
    from zerofit.config.schema import DECIDED
    from zerofit.config.section import Section

    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= min(columns, 100) - 2
    assert "--on-oom" in out and "`zerofit config --example`, docs/config-reference.md" in " ".join(out.split())
    assert (Path(__file__).resolve().parents[1] / "docs" / "config-reference.md").is_file()
    listed, section = {}, None
    for line in out.split("\nconfig keys", 1)[1].splitlines():
        if line.endswith(":") and not line.startswith(" "):
            section = line[:-1]
        elif section and line.startswith("  ") and not line.startswith("   "):
            key = line.split()[0]
            listed.setdefault(section, {})[key.rstrip("*")] = key.endswith("*")
    for name, field in Config.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
            assert listed[name] == {key: key in DECIDED.get(name, ()) for key in field.annotation.model_fields}
        else:
            assert f"\n{name}  " in out
    keys = sum(len(keys) for keys in listed.values()) + 1
    assert len(out.encode()) < 2048 + 64 * keys  # the flags, then a short line a key (8.0 KB for 102 keys)


def test_changed_settings_names_each_difference():
    before = validate(tiny_config("runs/a")).fingerprinted()
    after = validate(tiny_config("runs/b", train={"micro_batch_size": 2, "grad_accum_steps": 4})).fingerprinted()
    assert before["train"]["micro_batch_size"] != 2  # the change below is one
    assert changed_settings(before, after) == [
        f"train.grad_accum_steps {before['train']['grad_accum_steps']} -> 4",
        f"train.micro_batch_size {before['train']['micro_batch_size']} -> 2"]
    assert changed_settings(before, before) == []
    assert changed_settings({"data": {"path": "x" * 50}}, {"data": {}}) == [f"data.path {'x' * 37}... -> (unset)"]
    # a key one dump lacks and the other leaves unset: no change (a resume warned of
    # "train.warmup_ratio (unset) -> null"); one it holds set, or one with a default, is
    assert changed_settings({"train": {"lr": 1}}, {"train": {"lr": 1, "warmup_ratio": None}}) == []
    assert changed_settings({"train": {"lr": 1}}, {"train": {"lr": 1, "warmup_ratio": 0.1}}) == [
        "train.warmup_ratio (unset) -> 0.1"]
    assert changed_settings({"data": {}}, {"data": {"alpaca_template": "chat"}}) == [
        "data.alpaca_template (unset) -> chat"]
    # an empty mapping one dump lacks is no change
    assert changed_settings({"data": {}}, {"data": {"columns": {}, "truncation": "balanced"}}) == [
        "data.truncation (unset) -> balanced"]


def test_a_relative_path_not_found_says_where_it_was_read_from(tmp_path, monkeypatch):
    """Config paths are read from the working directory (not the config file's): a config run
    from elsewhere said "download it once" for a model directory one level up."""
    from zerofit import models
    from zerofit.config.schema import ModelConfig

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    where = rf"\(a relative path is read from the working directory, {tmp_path / 'elsewhere'}\)"
    with pytest.raises(ConfigError, match=rf"model.path='../tiny' is not a directory {where}"):
        models.hf_config(ModelConfig(path="../tiny"))
    with pytest.raises(ConfigError, match=rf"model.path='../tiny' is not a directory {where}"):
        models.load_tokenizer(ModelConfig(path="../tiny"))
    with pytest.raises(ConfigError, match=rf"model.tokenizer='tok' is not a directory {where}"):
        models.load_tokenizer(ModelConfig(config="tiny", tokenizer="tok"))
    with pytest.raises(ConfigError, match=rf"nor an existing config.json or directory {where}"):
        models.hf_config(ModelConfig(config="../configs/tiny.json"))
    with pytest.raises(ConfigError, match="is not a directory; "):  # an absolute one needs no word
        models.hf_config(ModelConfig(path=str(tmp_path / "nowhere")))


def test_download_hints_name_the_cli_huggingface_hub_ships():
    """The hints said `hf download` in one message and `huggingface-cli download` in another;
    huggingface_hub ships `hf` (and no longer `huggingface-cli`): every hint names that one."""
    from importlib.metadata import distribution

    from zerofit import models
    from zerofit.config.schema import ModelConfig

    shipped = {e.name for e in distribution("huggingface_hub").entry_points if e.group == "console_scripts"}
    assert "hf" in shipped and "huggingface-cli" not in shipped
    with pytest.raises(ConfigError, match=r"`hf download REPO_ID --local-dir DIR`"):
        models.hf_config(ModelConfig(path="/nowhere/model"))
    root = Path(__file__).resolve().parents[1]
    sources = [*(root / "zerofit").rglob("*.py"), root / "README.md"]
    assert [str(p) for p in sources if "huggingface-cli" in p.read_text()] == []


@pytest.mark.e2e
def test_a_start_that_finds_a_config_error_leaves_nothing_it_made(tmp_path):
    """The run directory (and the directories above it the start made) held only a lock file
    after `model.path` was found missing; one that was there before stays, without the lock file
    the refused start made in it (runlock.give_back)."""
    from conftest import run_zerofit

    wrong = ["--set", "model.path=/nowhere", "--set", "model.config=null"]
    failed = run_zerofit(["train", "--run-dir", str(tmp_path / "runs" / "new"), *wrong], check=False)
    assert failed.returncode == 1 and "model.path='/nowhere' is not a directory" in failed.stderr
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()
    assert run_zerofit(["train", "--run-dir", str(tmp_path / "mine"), *wrong], check=False).returncode == 1
    assert (tmp_path / "mine").is_dir() and list((tmp_path / "mine").iterdir()) == []


@pytest.mark.e2e
def test_a_start_refused_for_a_run_in_use_leaves_that_runs_lock(tmp_path):
    """The start that found the run directory locked by a live run (made by it a moment before:
    the refused start saw none) removed the other's lock and directory, so a third start ran
    beside it. A refused start gives back only a lock it took (runlock.give_back): the live
    run's stays, its pid in it, through `zerofit train` too."""
    import os
    import subprocess
    import sys as system

    from zerofit.core import runlock

    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    holder = subprocess.Popen([system.executable, "-c", f"from zerofit.core import runlock; runlock.hold({str(run)!r}); "
                               f"print('held', flush=True); import time; time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, cwd=str(tmp_path),
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(system.path)})
    try:
        assert holder.stdout.readline().strip() == "held"
        held = (run / runlock.LOCK_FILE).read_bytes(), (run / runlock.LOCK_FILE).stat().st_mtime_ns
        with pytest.raises(ConfigError, match="is in use by another zerofit train"):
            runlock.hold(run)
        runlock.leave_as_found(run, made=tmp_path / "runs")
        assert (run / runlock.LOCK_FILE).is_file() and runlock.holder(run) == holder.pid
        refused = run_zerofit(["train", "--run-dir", str(run)], check=False)
        assert refused.returncode == 1 and f"is in use by another zerofit train (pid {holder.pid})" in refused.stderr
        assert runlock.holder(run) == holder.pid and [p.name for p in run.iterdir()] == [runlock.LOCK_FILE]
        assert ((run / runlock.LOCK_FILE).read_bytes(), (run / runlock.LOCK_FILE).stat().st_mtime_ns) == held
    finally:
        holder.kill()
        holder.wait()


def test_a_quoted_tilde_in_a_path_argument_is_the_home_directory(tmp_path, monkeypatch, capsys):
    """As in a config: `export RUN --out "~/models/my out"` wrote into a directory named `~`."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["doctor", "~/nope"]) == 1
    assert f"{tmp_path / 'nope'} does not exist" in capsys.readouterr().err.replace("\n", "")
    assert cli.main(["export", "$HOME/nope", "--out", "~/my out"]) == 1
    assert str(tmp_path / "nope") in capsys.readouterr().err.replace("\n", "")
    assert not (tmp_path / "~").exists()


@pytest.mark.e2e
def test_wrong_paths_and_sizes_are_named_for_what_they_are(tmp_path, capsys):
    """A size is checked as the config loads (not once DeepSpeed has started); a directory
    where a file is wanted, or a path that does not exist, is said to be that."""
    with pytest.raises(ConfigError, match=r"plan\.gpu_mem='24XB' is not a size"):
        load(None, ["plan.gpu_mem=24XB"])
    for argv, said in ((["lint", str(tmp_path)], f"{tmp_path} is a directory; pass the DeepSpeed JSON file"),
                       (["doctor", str(tmp_path / "nope")], f"{tmp_path / 'nope'} does not exist"),
                       (["generate", str(tmp_path / "nope"), "--prompt", "p"], f"{tmp_path / 'nope'} is not a directory")):
        assert cli.main(argv) == 1
        assert said in capsys.readouterr().err.replace("\n", "")
    (tmp_path / "afile").touch()
    assert cli.main(["train", "--run-dir", str(tmp_path / "afile")]) == 1
    assert f"run_dir {tmp_path / 'afile'} cannot be made (it is a file)" in capsys.readouterr().err.replace("\n", "")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").touch()  # was a FileExistsError traceback from the first save's mkdir
    assert cli.main(["train", "--run-dir", str(tmp_path / "run")]) == 1
    assert f"{tmp_path / 'run' / 'checkpoints'} is a file where the run keeps its checkpoints/ directory" \
        in capsys.readouterr().err.replace("\n", "")
    # a checkpoint given as the run: a new run was trained inside it, and deleted by the run's retention later
    (tmp_path / "run" / "checkpoints").unlink()
    step = tmp_path / "run" / "checkpoints" / "step-000006"
    step.mkdir(parents=True)
    for name in ("config.yaml", "plan.json", "ds_config.json"):
        (tmp_path / "run" / name).write_text("{}")
    assert cli.main(["train", "--run-dir", str(step)]) == 1
    assert f"run_dir {step} is inside the checkpoints of the run {tmp_path / 'run'}, not a run directory: resume that " \
           f"run with --run-dir {tmp_path / 'run'}" in capsys.readouterr().err.replace("\n", "")
    assert list(step.iterdir()) == []  # nothing written there
    (tmp_path / "mine").mkdir()  # a user's own config.yaml beside a run_dir named checkpoints is no run
    (tmp_path / "mine" / "config.yaml").write_text("{}")
    assert runfiles.checkpoints_owner(tmp_path / "mine" / "checkpoints") is None
    # a yes/no where a count goes is a slip (pydantic read `true` as 1 and trained one step)
    with pytest.raises(ConfigError, match=r"train.max_steps=True: expected a number, got true"):
        load(None, ["train.max_steps=true"])
    assert load(None, ["lora.enabled=true"]).lora.enabled is True


def test_an_attention_kernel_the_architecture_lacks_is_refused_before_the_build():
    """Gemma-2 has no SDPA path in transformers: the build failed after planning with a traceback."""
    from transformers import Gemma2Config, LlamaConfig

    from zerofit import models
    from zerofit.config.schema import ModelConfig

    gemma = Gemma2Config(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, vocab_size=128)
    with pytest.raises(ConfigError, match="Gemma2ForCausalLM has no SDPA attention .* model.attn_implementation: eager"):
        models.check_attention(ModelConfig(config="tiny"), gemma)
    models.check_attention(ModelConfig(config="tiny", attn_implementation="eager"), gemma)
    models.check_attention(ModelConfig(config="tiny"), LlamaConfig())


def test_rows_past_a_pretrained_models_positions_are_warned_of(tmp_path):
    """transformers trains a Llama on rows past max_position_embeddings without a word (RoPE is
    built for any length); a pretrained model then learns from positions it never saw."""
    from transformers import LlamaConfig

    from zerofit import models
    from zerofit.config.schema import ModelConfig

    pretrained, scratch = ModelConfig(path=str(tmp_path)), ModelConfig(config="tiny")
    limited = LlamaConfig(max_position_embeddings=1024)
    said = models.positions_beyond_trained(pretrained, 100_000, limited)
    assert said.startswith("train.seq_len 100000 is above the model's max_position_embeddings 1024")
    assert "lower train.seq_len to 1024" in said
    assert models.positions_beyond_trained(pretrained, 1024, limited) is None
    assert models.positions_beyond_trained(scratch, 100_000, limited) is None  # random init: no position seen yet
    scaled = LlamaConfig(max_position_embeddings=1024, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert models.positions_beyond_trained(pretrained, 4096, scaled) is None


def test_a_seq_len_past_a_learned_position_table_is_refused():
    """GPT-2's positions are a table of n_positions rows: a longer row fails in the first forward,
    minutes in. RoPE models compute any position (past the trained ones a warning, above)."""
    from transformers import GPT2Config, LlamaConfig

    from zerofit import models

    with pytest.raises(ConfigError, match="train.seq_len 2,048 is past the 1,024 positions of gpt2's learned "
                                          "position table .* Lower train.seq_len to 1024"):
        models.check_position_table(2048, GPT2Config(n_positions=1024))
    models.check_position_table(1024, GPT2Config(n_positions=1024))
    models.check_position_table(100_000, LlamaConfig(max_position_embeddings=1024))


@pytest.mark.e2e
def test_a_seq_len_the_host_cannot_build_rows_of_is_refused_before_any_row_is_read(tmp_path):
    """--set train.seq_len=1000000000 was OOM-killed by the kernel while tokenizing (exit 137,
    20 GB, no message): every layout pads a row out to seq_len. Refused before the data is read,
    with the numbers and the fix; here 50M tokens against plan.host_mem=2GiB (what this host's RAM
    does to 1e9), so that the run before the fix was a 2.4 GB one, not a machine's worth."""
    import resource

    from transformers import LlamaConfig

    from zerofit.train import setup as train

    config_file = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run"))
    done = run_zerofit(["train", "--config", str(config_file), "--set", "train.seq_len=50000000",
                        "--set", "plan.host_mem=2GiB"], check=False)
    said = " ".join(done.stderr.split())
    assert done.returncode == 1 and "Traceback" not in said, said[-2000:]
    assert "train.seq_len 50,000,000 needs ~2.2 GiB of host RAM before training starts" in said, said[-2000:]
    assert "plan.host_mem=2GiB holds 2.0 GiB. Lower train.seq_len: the model's context is" in said
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss < 2 * 2**20  # KiB: no row of 50M tokens built
    assert not (tmp_path / "run").exists()  # nothing read, nothing made
    absurd = load(str(config_file), ["train.seq_len=100000000000"])  # 4.4 TiB: past any host's RAM
    with pytest.raises(ConfigError, match=r"train.seq_len 100,000,000,000 needs ~[\d.]+ GiB of host RAM .* this host"):
        train.check_seq_len(absurd, LlamaConfig())


def test_a_model_directory_that_cannot_load_is_named_before_anything_is_touched(tmp_path, tokenizer):
    """model.path problems were tracebacks from inside the build (after a --no-resume had moved
    the checkpoints aside), or a tokenizer error about sentencepiece: each is named, with its fix."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from zerofit import models
    from zerofit.config.schema import ModelConfig
    from zerofit.models import config_from_name

    good = tmp_path / "good"
    AutoModelForCausalLM.from_config(config_from_name("tiny")).save_pretrained(good)
    tokenizer.save_pretrained(good)
    models.hf_config(ModelConfig(path=str(good), config=None))
    models.check_weights(ModelConfig(path=str(good), config=None))

    def broken(name: str, damage) -> ModelConfig:
        shutil.copytree(good, tmp_path / name)
        damage(tmp_path / name)
        return ModelConfig(path=str(tmp_path / name), config=None)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"holds no config.json: it is not a transformers model directory"):
        models.hf_config(ModelConfig(path=str(empty), config=None))
    no_weights = broken("no_weights", lambda d: (d / "model.safetensors").unlink())
    with pytest.raises(ConfigError, match=r"holds no weights \(\*.safetensors or pytorch_model.bin\); copy .* or set "
                                          r"model.config: .*no_weights to train from a random init"):
        models.check_weights(no_weights)
    size = (good / "model.safetensors").stat().st_size
    cut = broken("cut", lambda d: (d / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:-100]))
    with pytest.raises(ConfigError, match=rf"cut/model.safetensors is damaged or cut short: it holds {size - 100} bytes, "
                                          rf"its tensors end at {size}; copy the model's files again"):
        models.check_weights(cut)
    garbage = broken("garbage", lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64))
    with pytest.raises(ConfigError, match=r"garbage/model.safetensors is damaged or cut short: its header claims"):
        models.check_weights(garbage)
    overwritten = broken("overwritten", lambda d: (d / "model.safetensors").write_bytes(
        (16).to_bytes(8, "little") + b"{not json at all" + b"\0" * 64))
    with pytest.raises(ConfigError, match=r"overwritten/model.safetensors .* header cannot be read \(JSONDecodeError\)"):
        models.check_weights(overwritten)

    def odd_heads(d: Path) -> None:
        (d / "config.json").write_text(json.dumps({**json.loads((good / "config.json").read_text()), "hidden_size": 66}))
    with pytest.raises(ConfigError, match=r"transformers refuses .*odd_heads/config.json: .*; fix the file"):
        models.hf_config(broken("odd_heads", odd_heads))
    # a config file of another name (model.config) is named as it is, not as DIR/config.json
    shutil.copy(tmp_path / "odd_heads" / "config.json", tmp_path / "odd.json")
    with pytest.raises(ConfigError, match=r"transformers refuses .*/odd\.json: .*attention heads \(4\); fix the file"):
        models.hf_config(ModelConfig(config=str(tmp_path / "odd.json")))
    with pytest.raises(ConfigError, match=r"model.config='demoo' is neither a preset"):
        models.hf_config(ModelConfig(config="demoo"))


@pytest.mark.e2e
def test_a_damaged_model_ends_the_start_before_a_no_resume_moves_anything(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from zerofit.models import config_from_name

    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(config_from_name("tiny")).save_pretrained(base)
    tokenizer.save_pretrained(base)
    (base / "model.safetensors").write_bytes((base / "model.safetensors").read_bytes()[:-100])
    saved = tmp_path / "run" / "checkpoints" / "step-000002"
    saved.mkdir(parents=True)
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run", model={"path": str(base), "config": None}))
    done = run_zerofit(["train", "--config", str(config), "--no-resume"], check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "model.safetensors is damaged or cut short" in done.stderr.replace("\n", "")
    assert saved.is_dir()  # the run's checkpoints where they were


def test_lora_module_lists_from_the_command_line():
    config = load(None, ["lora.enabled=true", "lora.target_modules=q_proj, v_proj", "lora.modules_to_save=lm_head"])
    assert config.lora.target_modules == ["q_proj", "v_proj"] and config.lora.modules_to_save == ["lm_head"]


def test_a_size_flag_with_a_typo_is_a_usage_error_naming_the_flag(capsys):
    """It read "invalid config: plan: plan.gpu_mem='24GB2' ...", a key the user never wrote."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["plan", "--model", "tiny", "--gpu-mem", "24GB2"])
    assert exited.value.code == 2
    assert "argument --gpu-mem: '24GB2' is not a size" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("model: {config: tiny}\ntrain:\n  max_steps: 3\nlr: 1e-4\n",
     "unknown key lr; it is a key of train: move it under `train:`"),  # it read "did you mean lora?"
    ("model: {config: tiny}\ntrain:\n  max_steps: 3\n  offload_param: cpu\n",
     "unknown key train.offload_param; it is a key of zero: move it under `zero:`"),
    ("model: {config: tiny}\ndata:\n  cutoff_len: 2048\n",  # it read "did you mean data.format?"
     "unknown key data.cutoff_len; LLaMA-Factory's / HF Trainer's cutoff_len is train.seq_len"),
    ("model: {config: tiny}\ntemplate: qwen\n", "unknown key template; LLaMA-Factory's / HF Trainer's template is "
     "the tokenizer's own chat template (a model directory carries its own), or model.chat_template"),
    ("model: {config: tiny}\nlr_scheduler_type: cosine\n", "unknown key lr_scheduler_type; LLaMA-Factory's / HF "
     "Trainer's lr_scheduler_type is train.lr_schedule (cosine, linear or constant, HF's cosine_with_min_lr and "
     "constant_with_warmup too; zerofit's decay ends at train.min_lr_ratio x lr, 0.1 by default, HF's at 0: "
     "min_lr_ratio: 0 for theirs)"),  # a default that differs
    ("model: {config: tiny}\nadam_beta2: 0.999\n", "zerofit's default [0.9, 0.95], HF's [0.9, 0.999]"),
    ("model: {config: tiny}\ntrain:\n\tmax_steps: 3\n", "line 3, column 1 is not valid YAML: found character '\\t' "
     "that cannot start any token; YAML indents with spaces, not tabs"),
    ("model: {config: tiny}\ntrain:\n  max_steps: 3\n     lr: 1\n", "line 4, column 8 is not valid YAML: mapping "
     "values are not allowed here; a key is indented deeper than the keys beside it"),
])
def test_a_misplaced_key_or_a_yaml_slip_gets_the_fix(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load(path)
    assert message in str(refused.value)


def test_hf_schedule_names_read_as_zerofits():
    """transformers' cosine_with_min_lr and constant_with_warmup were refused ("Input should be
    'cosine', 'linear' or 'constant'"): they are zerofit's cosine (to min_lr_ratio) and constant
    (with warmup)."""
    assert load(None, ["train.lr_schedule=cosine_with_min_lr"]).train.lr_schedule == "cosine"
    assert load(None, ["train.lr_schedule=constant_with_warmup"]).train.lr_schedule == "constant"
    with pytest.raises(ConfigError, match="lr_schedule"):
        load(None, ["train.lr_schedule=polynomial"])


# ------------------------------------------------- refusals before anything heavy (issue 53)
REFUSE_AND_SAY_WHAT_WAS_IMPORTED = """
import json, sys
from zerofit.cli import main
from zerofit.core.files import read_json, read_jsonl
code = main(sys.argv[1:])
print(json.dumps({"code": code, "imported": [m for m in ("torch", "transformers", "deepspeed") if m in sys.modules]}))
"""


def refused_in_a_process(tmp_path: Path, args: list[str]) -> tuple[dict, str]:
    """`zerofit ARGS` in a process of its own: its exit code, the heavy modules it had imported
    when it returned, and its stderr."""
    import json
    import subprocess
    import sys

    from conftest import ROOT, child_env

    done = subprocess.run([sys.executable, "-c", REFUSE_AND_SAY_WHAT_WAS_IMPORTED, *args], cwd=tmp_path,
                          env={**child_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


@pytest.mark.e2e
def test_every_file_a_run_config_names_is_checked_before_anything_heavy(tmp_path):
    """A misspelt data.path was said 226 s after the start (after the process group, the op build
    and the model): each path the config names is looked at first, before torch is imported, and
    every one that is not there is said, one a line."""
    config = tiny_config(tmp_path / "run", data_path=tmp_path / "trian.jsonl")
    config["data"]["eval_path"] = str(tmp_path / "eval.jsonl")
    config["model"].update(tokenizer=str(tmp_path / "tok"), chat_template=str(tmp_path / "t.jinja"))
    config["zero"] = {"nvme_path": str(tmp_path / "no" / "nvme")}
    said, err = refused_in_a_process(tmp_path, ["train", "--config", str(write_config(tmp_path / "c.yaml", config))])
    assert said == {"code": 1, "imported": []}, err
    lines = err.splitlines()
    assert lines[0] == "zerofit: error: 5 files or directories the config names are not usable:"
    assert lines[1].startswith(f"  model.tokenizer={str(tmp_path / 'tok')!r} is not a directory")
    assert lines[2].startswith(f"  model.chat_template={str(tmp_path / 't.jinja')!r} is neither a file")
    assert lines[3].startswith(f"  data file {tmp_path / 'trian.jsonl'} does not exist")
    assert lines[4].startswith(f"  data file {tmp_path / 'eval.jsonl'} does not exist; set data.eval_path")
    assert lines[5].startswith(f"  zero.nvme_path={tmp_path / 'no' / 'nvme'} is not usable: {tmp_path / 'no'} does "
                               f"not exist (a typo?")
    assert not (tmp_path / "run").exists()
    # one problem alone is the error; a model.path, and a --resume with nothing to resume from
    config = tiny_config(tmp_path / "run")
    config["model"] = {"path": str(tmp_path / "model")}
    said, err = refused_in_a_process(tmp_path, ["train", "--config", str(write_config(tmp_path / "c.yaml", config))])
    assert said == {"code": 1, "imported": []}
    assert err.startswith(f"zerofit: error: model.path={str(tmp_path / 'model')!r} is not a directory")
    said, err = refused_in_a_process(tmp_path, ["train", "--set", f"run_dir={tmp_path / 'fresh'}", "--resume"])
    assert said == {"code": 1, "imported": []}
    assert err == f"zerofit: error: --resume: no checkpoint under {tmp_path / 'fresh' / 'checkpoints'}; run " \
                  f"without --resume to start fresh\n"


@pytest.mark.e2e
def test_plan_refuses_a_config_or_model_that_is_not_there_before_importing_torch(tmp_path):
    config = tiny_config(tmp_path / "run")
    config["model"] = {"path": str(tmp_path / "model")}
    said, err = refused_in_a_process(tmp_path, ["plan", "--config", str(write_config(tmp_path / "c.yaml", config))])
    assert said == {"code": 1, "imported": []}
    assert err.startswith(f"zerofit: error: model.path={str(tmp_path / 'model')!r} is not a directory")
    said, err = refused_in_a_process(tmp_path, ["plan", "--model", str(tmp_path / "llama.json")])
    assert said == {"code": 1, "imported": []}
    assert err.startswith(f"zerofit: error: model.config={str(tmp_path / 'llama.json')!r} is neither a preset")


def test_a_models_config_json_given_as_the_run_config_says_use_model(tmp_path, capsys):
    """`zerofit plan --config qwen2.5-7b/config.json` printed ~20 "unknown key" errors on one line."""
    seven_b = Path(__file__).parent / "data" / "qwen2.5-7b" / "config.json"
    for verb in ("plan", "train"):
        assert cli.main([verb, "--config", str(seven_b)]) == 1
        err = capsys.readouterr().err
        assert err == (f"zerofit: error: {seven_b} is a model's config.json (architectures, hidden_size, model_type, "
                       f"num_hidden_layers, vocab_size at the top level), not a zerofit run config: use --model "
                       f"{seven_b} (`zerofit plan --model FILE`), or model.config: {seven_b} in a run config "
                       f"(model.path: its directory, for its weights)\n")


def test_several_unknown_keys_are_said_one_a_line_with_the_valid_keys_once(tmp_path, capsys):
    config = tiny_config(tmp_path / "run")
    config["model"].update(foo=1, bar=2)
    config["train"]["lrr"] = 1
    assert cli.main(["plan", "--config", str(write_config(tmp_path / "c.yaml", config))]) == 1
    valid = "path, config, tokenizer, chat_template, gradient_checkpointing, attn_implementation, trust_remote_code"
    assert capsys.readouterr().err.splitlines() == [
        "zerofit: error: invalid config, 3 problems:", "  unknown key model.bar", "  unknown key model.foo",
        "  unknown key train.lrr; did you mean train.lr?", f"  valid keys in model: {valid}"]
    del config["model"]["bar"], config["train"]["lrr"]  # one: on its line, as before
    assert cli.main(["plan", "--config", str(write_config(tmp_path / "c.yaml", config))]) == 1
    assert capsys.readouterr().err == f"zerofit: error: invalid config: unknown key model.foo; valid keys in model: " \
                                      f"{valid}\n"
