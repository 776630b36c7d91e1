"""`zerofit export` on real ZeRO-3 checkpoints written by `zerofit train` (1 rank bf16,
2 ranks fp32), checked against DeepSpeed's own reconstruction. Refusals run in-process
(they touch no DeepSpeed state); exports that verify run as the CLI."""
import json
import os
import shutil
import sys

import pytest
import torch
from conftest import deepspeed_lines, exported_tensors, peak_rss_of, run_zerofit, tiny_config, write_config

from zerofit.cli import main
from zerofit.export.checkpoint import export
from zerofit.models import PRESETS


def deepspeed_state_dict(checkpoint_dir):
    """The independent reference: DeepSpeed's get_fp32_state_dict_from_zero_checkpoint."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir.parent), tag=checkpoint_dir.name)


def assert_logits_match(out_dir, checkpoint_dir, rel_tol=5e-2):
    """from_pretrained(export) vs a model built from the config with DeepSpeed's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    exported, info = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out_dir), dtype=torch.float32)
    reference.load_state_dict(deepspeed_state_dict(checkpoint_dir), strict=False)
    reference.tie_weights()
    ids = torch.tensor([[1, 40, 73, 80, 80, 83, 4, 91, 83, 86, 80, 72, 2]])
    with torch.no_grad():
        got, want = exported(ids).logits, reference(ids).logits
    scale = float(want.abs().max())
    assert scale > 0.1
    assert float((got - want).abs().max()) <= rel_tol * scale
    return got, want


def odd_model_config(path):
    """Tied embeddings and a 129-element bias: partitions padded when split over 2 ranks."""
    fields = dict(PRESETS["tiny"], tie_word_embeddings=True, mlp_bias=True, intermediate_size=129)
    path.write_text(json.dumps(fields))
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from zerofit.demo import build_tokenizer

    directory = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """bf16, 1 rank, checkpoints at steps 1 and 2."""
    base = tmp_path_factory.mktemp("one")
    config = tiny_config(base / "run", train={"max_steps": 2}, eval={"at_end": False, "every_steps": 0},
                         checkpoint={"every_steps": 1, "keep_last": 2})
    run_zerofit(["train", "--config", str(write_config(base / "c.yaml", config))])
    return base / "run"


@pytest.fixture(scope="module")
def one_rank_export(one_rank, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "model"
    done = run_zerofit(["export", str(one_rank), "--out", str(out), "--verify"])
    return out, done


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tokenizer_dir):
    """fp32 training (optimizer files without the bf16_ prefix) on 2 ranks."""
    base = tmp_path_factory.mktemp("two")
    config = tiny_config(base / "run", model={"config": str(odd_model_config(base / "odd.json")),
                                              "tokenizer": str(tokenizer_dir)},
                         train={"max_steps": 2, "precision": "fp32"}, eval={"at_end": False, "every_steps": 0},
                         checkpoint={"every_steps": 0})
    run_zerofit(["train", "--config", str(write_config(base / "c.yaml", config))], nproc=2)
    return base / "run"


# ----------------------------------------------------------------------- correctness
@pytest.mark.e2e
def test_one_rank_export_equals_deepspeed_reconstruction(one_rank, one_rank_export):
    out, done = one_rank_export
    assert "verify: logits" in done.stderr and ": ok" in done.stderr
    assert "exported step-000002" in done.stderr and deepspeed_lines(done) == []
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "model.safetensors"):
        assert (out / name).is_file(), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    reference = deepspeed_state_dict(one_rank / "checkpoints" / "step-000002")
    tensors = exported_tensors(out)
    assert set(tensors) == set(reference)
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    assert_logits_match(out, one_rank / "checkpoints" / "step-000002")
    assert not list(out.parent.glob(".tmp-*"))


@pytest.mark.multirank
def test_two_ranks_padded_partitions_and_tied_embeddings(two_ranks, tmp_path):
    out = tmp_path / "model"
    done = run_zerofit(["export", str(two_ranks), "--out", str(out), "--verify"])
    assert "2 rank(s), fp32 training" in done.stderr and ": ok" in done.stderr
    checkpoint_dir = two_ranks / "checkpoints" / "step-000002"
    assert (checkpoint_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    reference = deepspeed_state_dict(checkpoint_dir)
    tensors = exported_tensors(out)
    assert "lm_head.weight" not in tensors  # tied: from_pretrained ties it to the embedding again
    assert tensors["model.layers.0.mlp.up_proj.bias"].shape == (129,)  # 65 + 65 - 1 pad element
    for name, tensor in tensors.items():
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    assert_logits_match(out, checkpoint_dir)


@pytest.mark.multirank
def test_fp32_and_fp16_exports(two_ranks, tmp_path):
    checkpoint_dir = two_ranks / "checkpoints" / "step-000002"
    reference = deepspeed_state_dict(checkpoint_dir)
    for dtype, torch_dtype, tol in (("fp32", torch.float32, 1e-5), ("fp16", torch.float16, 1e-2)):
        result = export(checkpoint_dir, tmp_path / dtype, dtype=dtype, progress=False)
        assert result.dtype == dtype and result.world_size == 2
        tensors = exported_tensors(tmp_path / dtype)
        assert json.loads((tmp_path / dtype / "config.json").read_text())["dtype"] == str(torch_dtype)[6:]
        assert result.output_bytes == sum(t.numel() * torch_dtype.itemsize for t in tensors.values())
        for name, tensor in tensors.items():
            assert tensor.dtype == torch_dtype
            assert torch.equal(tensor, reference[name].to(torch_dtype)), name
        assert_logits_match(tmp_path / dtype, checkpoint_dir, rel_tol=tol)


@pytest.mark.e2e
def test_shard_size_is_respected(one_rank, one_rank_export, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "sharded"
    export(one_rank, out, shard_size="40KB", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 4 and set(index["weight_map"].values()) == {p.name for p in shards}
    single = exported_tensors(one_rank_export[0])
    assert set(index["weight_map"]) == set(single)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in single.values())
    for path in shards:
        data_bytes = path.stat().st_size - 8 - int.from_bytes(path.read_bytes()[:8], "little")
        assert data_bytes <= 40_000 or len(load_file(path)) == 1, (path.name, data_bytes)
    sharded = exported_tensors(out)
    assert all(torch.equal(sharded[name], single[name]) for name in single)
    assert_logits_match(out, one_rank / "checkpoints" / "step-000002")


@pytest.mark.e2e
def test_the_export_generates(one_rank_export):
    done = run_zerofit(["generate", str(one_rank_export[0]), "--prompt", "Add the two numbers.",
                        "--max-new-tokens", "6", "--min-new-tokens", "6"])
    assert "6 new tokens" in done.stderr and "tokens/s" in done.stderr


@pytest.fixture(scope="module")
def converted(two_ranks, tmp_path_factory):
    """A copy of the 2-rank run with step-000002 converted by DeepSpeed's ds_to_universal, as
    a resume on 1 rank converts it: (run dir, step-000002, universal-step-000002)."""
    from zerofit.checkpoint import universal

    run = tmp_path_factory.mktemp("universal") / "run"
    shutil.copytree(two_ranks, run)
    step_dir = run / "checkpoints" / "step-000002"
    return run, step_dir, universal.convert(step_dir)


@pytest.mark.multirank
def test_universal_checkpoint_exports_the_same_model(converted, tmp_path):
    """universal-step-N (per-parameter fp32.pt files, tied embeddings, a padded bias) gives
    the very model step-N gives: same tensors, same logits, bit for bit."""
    from transformers import AutoModelForCausalLM

    run, step_dir, universal_dir = converted
    assert universal_dir.name == "universal-step-000002" and (universal_dir / "zero").is_dir()
    assert not list(universal_dir.glob("*optim_states.pt"))
    from_universal = export(universal_dir, tmp_path / "u", verify=True, progress=False)
    from_step = export(step_dir, tmp_path / "s", progress=False)
    assert (from_universal.world_size, from_universal.training_precision) == (2, "fp32") == \
        (from_step.world_size, from_step.training_precision)
    assert from_universal.verify["ok"] and from_universal.verify["max_abs_diff"] == 0.0
    universal_tensors, step_tensors = exported_tensors(tmp_path / "u"), exported_tensors(tmp_path / "s")
    assert list(universal_tensors) == list(step_tensors) and "lm_head.weight" not in step_tensors
    for name, tensor in step_tensors.items():
        assert universal_tensors[name].dtype == tensor.dtype == torch.bfloat16
        assert torch.equal(universal_tensors[name], tensor), name
    ids = torch.tensor([[1, 40, 73, 80, 80, 83, 4, 91, 83, 86, 80, 72, 2]])
    logits = []
    for out in (tmp_path / "u", tmp_path / "s"):
        model = AutoModelForCausalLM.from_pretrained(out)
        assert model.dtype == torch.bfloat16
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert logits[0].dtype == torch.bfloat16 and torch.equal(logits[0], logits[1])
    assert float(logits[0].abs().max()) > 0.1
    assert export(run, tmp_path / "r", progress=False).checkpoint == step_dir  # a run still exports step-N


@pytest.mark.multirank
def test_a_damaged_universal_checkpoint_is_refused(converted, tmp_path, capsys):
    from zerofit.checkpoint.zerofiles import ZeroCheckpointError, open_checkpoint

    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(converted[0] / "model", tmp_path / "run" / "model")
    shutil.copytree(converted[1], checkpoints / "step-000002")
    universal_dir = shutil.copytree(converted[2], checkpoints / "universal-step-000002")
    fp32 = universal_dir / "zero" / "model.norm.weight" / "fp32.pt"
    os.truncate(fp32, fp32.stat().st_size // 2)
    assert main(["export", str(universal_dir), "--out", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert "not a complete checkpoint" in err and "zero/model.norm.weight/fp32.pt has" in err
    assert not (tmp_path / "a").exists()
    readable = r"fp32.pt is not a readable torch.save archive.*export .*step-000002"
    with pytest.raises(ZeroCheckpointError, match=readable):
        open_checkpoint(universal_dir)  # the reader's own check, without the manifest's help
    fp32.unlink()
    with pytest.raises(ZeroCheckpointError, match=r"zero/model.norm.weight/fp32.pt is missing.*step-000002"):
        open_checkpoint(universal_dir)


# ---------------------------------------------------------------------- refusals
@pytest.mark.e2e
def test_newest_complete_checkpoint_is_taken_and_a_truncated_one_refused(one_rank, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(one_rank, run)
    optim = run / "checkpoints" / "step-000002" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with open(optim, "r+b") as f:
        f.truncate(optim.stat().st_size // 2)
    assert main(["export", str(run / "checkpoints" / "step-000002"), "--out", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert "not a complete checkpoint" in err and "truncated" in err
    assert not (tmp_path / "a").exists()
    assert main(["export", str(run), "--out", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "skipping step-000002" in err and "exported step-000001" in err
    (run / "checkpoints" / "step-000001" / "MANIFEST.json").unlink()
    assert main(["export", str(run), "--out", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert "holds no complete checkpoint" in err and "no MANIFEST.json" in err


@pytest.mark.e2e
def test_bit_rot_is_caught_by_the_hashes_and_nan_weights_are_never_published(one_rank, tmp_path, capsys):
    """Bytes of the newest checkpoint's fp32 masters overwritten in place (the size unchanged,
    as a failing disk does): the default hash check skips it for the older one; with
    --no-hashes the NaN it reads is refused, and nothing is written."""
    from zerofit.checkpoint import zerofiles

    run = tmp_path / "run"
    shutil.copytree(one_rank, run)
    newest = run / "checkpoints" / "step-000002"
    piece = next(t for t in zerofiles.open_checkpoint(newest).tensors if t.kind == "trainable").pieces[0]
    with open(piece.path, "r+b") as f:
        f.seek(piece.offset)
        f.write(b"\xff" * 64)  # 16 fp32 NaNs
    assert main(["export", str(run), "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err.replace("\n", " ")
    assert "skipping step-000002" in err and "exported step-000001" in err
    assert main(["export", str(run), "--out", str(tmp_path / "b"), "--no-hashes"]) == 1
    err = capsys.readouterr().err.replace("\n", " ")
    assert "holds NaN or Inf in step-000002" in err and "--no-hashes" in err
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.e2e
def test_out_never_replaces_what_the_export_reads(one_rank, tmp_path, capsys, monkeypatch):
    """--overwrite replaced --out whatever it was: the run itself, a folder holding it, its
    checkpoints or one of them (a resume then took the model files for a checkpoint)."""
    runs = tmp_path / "runs"
    run = runs / "x"
    shutil.copytree(one_rank, run)
    before = sorted(str(p.relative_to(runs)) for p in runs.rglob("*"))
    for out in (run, runs, run / "checkpoints", run / "checkpoints" / "step-000002", run / "model",
                run / "checkpoints" / "fresh"):
        assert main(["export", str(run), "--out", str(out), "--overwrite"]) == 1
        err = capsys.readouterr().err.replace("\n", " ")
        assert "which this export reads" in err or "inside the run's checkpoints" in err, err
    assert sorted(str(p.relative_to(runs)) for p in runs.rglob("*")) == before
    assert main(["export", str(run), "--out", str(run / "exported")]) == 0  # beside them: fine
    # the current directory cannot be renamed into place: said before the work, not as its publish's traceback
    empty = tmp_path / "here"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert main(["export", str(run), "--out", ".", "--overwrite"]) == 1
    assert "is the current directory" in capsys.readouterr().err and not any(empty.iterdir())


@pytest.mark.e2e
def test_overwrite_replaces_an_earlier_export_only(one_rank, tmp_path, capsys):
    """--overwrite deleted whatever --out held (a user's notes, a folder of other models);
    it replaces an earlier export, and refuses anything else with every file kept."""
    out = tmp_path / "model"
    assert main(["export", str(one_rank), "--out", str(out)]) == 0
    (out / "notes.txt").write_text("mine")  # beside an earlier export: replaced with it, as the README says
    assert main(["export", str(one_rank), "--out", str(out), "--overwrite", "--dtype", "fp32"]) == 0
    assert not (out / "notes.txt").exists() and json.loads((out / "config.json").read_text())["dtype"] == "float32"
    mine = tmp_path / "mine"
    (mine / "other-model").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    for held, said in ((mine, "it holds folders (other-model)"), (mine / "other-model", "no config.json")):
        (held / "keep.txt").write_text("kept")
        assert main(["export", str(one_rank), "--out", str(held), "--overwrite"]) == 1
        assert said in capsys.readouterr().err.replace("\n", " ") and (held / "keep.txt").read_text() == "kept"


@pytest.mark.e2e
def test_checkpoints_set_aside_by_no_resume_export_with_the_runs_model(one_rank, tmp_path, capsys):
    """checkpoints/earlier-TIME/ (--no-resume moves an earlier run's checkpoints there, with a copy
    of its model/): exported with that model/, not checkpoints/model (the error named a path that
    never exists)."""
    run = tmp_path / "run"
    shutil.copytree(one_rank, run)
    aside = run / "checkpoints" / "earlier-20261201-000000"
    aside.mkdir()
    shutil.move(run / "checkpoints" / "step-000002", aside / "step-000002")
    shutil.copytree(run / "model", aside / "model")  # as resume.set_aside_earlier_run keeps it
    for source, out in ((aside / "step-000002", "a"), (aside, "b")):
        assert main(["export", str(source), "--out", str(tmp_path / out)]) == 0, capsys.readouterr().err
        assert (tmp_path / out / "model.safetensors").is_file()


@pytest.mark.e2e
def test_a_model_dir_of_another_model_is_refused(one_rank, tmp_path, capsys):
    """--model-dir naming a model with one layer fewer exported the checkpoint's tensors
    under it (and generate ran the truncated model): refused, naming a difference."""
    other = tmp_path / "other"
    shutil.copytree(one_rank / "model", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] - 1}))
    assert main(["export", str(one_rank), "--out", str(tmp_path / "out"), "--model-dir", str(other)]) == 1
    err = capsys.readouterr().err.replace("\n", " ")
    assert "is not the model" in err and "2 layers in the checkpoint, num_hidden_layers 1" in err
    assert "RUN_DIR/model" in err and not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_bad_arguments_are_refused(one_rank, one_rank_export, tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 1
    assert "is not a directory" in capsys.readouterr().err
    assert main(["export", str(one_rank), "--out", str(one_rank_export[0])]) == 1
    err = capsys.readouterr().err
    assert "not empty" in err and "--overwrite" in err
    assert (one_rank_export[0] / "model.safetensors").is_file()  # nothing lost
    (tmp_path / "afile").touch()  # where no staging directory can be made (a read-only mount alike)
    assert main(["export", str(one_rank), "--out", str(tmp_path / "afile" / "o")]) == 1
    assert f"{tmp_path / 'afile'} is not a directory you can write" in capsys.readouterr().err.replace("\n", "")
    with pytest.raises(SystemExit) as usage:
        main(["export", str(one_rank), "--out", str(tmp_path / "o"), "--dtype", "int4"])
    assert usage.value.code == 2
    assert main(["export", str(one_rank), "--out", str(tmp_path / "o"), "--max-ram", "10MiB"]) == 1
    assert "--max-ram 10.0MiB is too small" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # a size that does not parse is a usage error naming the flag
        main(["export", str(one_rank), "--out", str(tmp_path / "o"), "--shard-size", "lots"])
    assert usage.value.code == 2 and "argument --shard-size: 'lots' is not a size" in capsys.readouterr().err
    assert main(["export", str(one_rank), "--out", str(tmp_path / "o"), "--shard-size", "0"]) == 1
    assert "--shard-size 0: give a positive size" in capsys.readouterr().err
    assert main(["export", str(one_rank), "--out", str(tmp_path / "o"), "--adapter-only"]) == 1
    assert "--adapter-only and --base are for LoRA runs" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.e2e
def test_deepspeed_checkpoint_without_manifest(one_rank, tmp_path, capsys):
    """HF Trainer's layout: checkpoint-2/{latest, global_step2/, config.json, tokenizer}."""
    trainer = tmp_path / "checkpoint-2"
    shutil.copytree(one_rank / "model", trainer)
    (trainer / "global_step2").mkdir()
    for f in (one_rank / "checkpoints" / "step-000002").glob("*_states.pt"):
        shutil.copy(f, trainer / "global_step2" / f.name)
    (trainer / "latest").write_text("global_step2")
    for name in ("trainer_state.json", "training_args.bin", "zero_to_fp32.py", "rng_state_0.pth", "scheduler.pt"):
        (trainer / name).write_text("training state")  # what the Trainer leaves there
    assert main(["export", str(trainer), "--out", str(tmp_path / "out")]) == 0
    assert "no zerofit MANIFEST.json" in capsys.readouterr().err
    exported = {p.name for p in (tmp_path / "out").iterdir()}
    assert "tokenizer_config.json" in exported and not exported & {
        "latest", "trainer_state.json", "training_args.bin", "zero_to_fp32.py", "rng_state_0.pth", "scheduler.pt"}
    assert_logits_match(tmp_path / "out", trainer / "global_step2")


# --------------------------------------------------------------------- the RAM cap
@pytest.fixture(scope="module")
def wide_run(tmp_path_factory, tokenizer_dir):
    """A 41M-parameter model (164 MB of fp32 master weights), one step."""
    base = tmp_path_factory.mktemp("wide")
    fields = dict(PRESETS["tiny"], vocab_size=32000, hidden_size=512, intermediate_size=1024,
                  num_attention_heads=8, num_key_value_heads=8)
    (base / "wide.json").write_text(json.dumps(fields))
    config = tiny_config(base / "run", model={"config": str(base / "wide.json"), "tokenizer": str(tokenizer_dir)},
                         train={"max_steps": 1, "seq_len": 96, "micro_batch_size": 1},
                         eval={"at_end": False, "every_steps": 0}, checkpoint={"every_steps": 0, "verify": "sizes"})
    run_zerofit(["train", "--config", str(write_config(base / "c.yaml", config))])
    return base / "run"


@pytest.mark.e2e
def test_peak_rss_stays_under_max_ram(wide_run, tmp_path):
    code, baseline, err = peak_rss_of([sys.executable, "-c", "import zerofit.cli, zerofit.export.checkpoint, zerofit.checkpoint.zerofiles"],
                                      tmp_path)
    assert code == 0, err
    room = 96 << 20
    cap = baseline + room
    code, peak, err = peak_rss_of([sys.executable, "-m", "zerofit", "export", str(wide_run), "--out",
                                   str(tmp_path / "out"), "--max-ram", str(cap)], tmp_path)
    assert code == 0, err
    out_bytes = sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors"))
    fp32_bytes = out_bytes * 2
    assert fp32_bytes > 1.5 * room  # the whole model could not have been held
    assert peak <= cap, f"peak RSS {peak / 2**20:.0f} MiB > cap {cap / 2**20:.0f} MiB (baseline {baseline / 2**20:.0f})"
    reference = deepspeed_state_dict(wide_run / "checkpoints" / "step-000001")
    tensors = exported_tensors(tmp_path / "out")
    embed = "model.embed_tokens.weight"
    assert tensors[embed].shape == (32000, 512)
    assert torch.equal(tensors[embed], reference[embed].to(torch.bfloat16))
    assert torch.equal(tensors["lm_head.weight"], reference["lm_head.weight"].to(torch.bfloat16))


def test_sizes_read_as_people_write_them():
    from zerofit.core.errors import ConfigError
    from zerofit.core.timeline import parse_bytes

    assert parse_bytes("5GB", "x") == 5 * 10**9 and parse_bytes("24GiB", "x") == 24 << 30
    assert parse_bytes("512MiB", "x") == 512 << 20 and parse_bytes("1.5g", "x") == 3 << 29
    assert parse_bytes("4096", "x") == 4096 and parse_bytes(7, "x") == 7
    with pytest.raises(ConfigError, match="--max-ram='2 gigs' is not a size"):
        parse_bytes("2 gigs", "--max-ram")


class _Payload:
    """What a crafted checkpoint could carry: a pickle that runs a command when loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_reading_a_checkpoint_runs_no_code_from_it(tmp_path):
    from zerofit.checkpoint.torchfile import Opaque, TorchFile

    marker = tmp_path / "ran"
    torch.save({"weights": torch.arange(6.0).view(2, 3), "trap": _Payload(marker)}, tmp_path / "crafted.pt")
    loaded = TorchFile(tmp_path / "crafted.pt").load()
    assert isinstance(loaded["trap"], Opaque) and not marker.exists()
    ref = loaded["weights"]
    assert ref.shape == (2, 3) and ref.dtype == torch.float32


@pytest.mark.e2e
def test_per_tensor_transform_seam_sees_every_row_once(one_rank, tmp_path):
    """What a LoRA merge will plug into: a transform on row blocks before the cast."""
    from safetensors.torch import load_file

    from zerofit.checkpoint.zerofiles import open_checkpoint
    from zerofit.export.checkpoint import output_tensors
    from zerofit.export.shards import plan_shards, write_model

    checkpoint_dir = one_rank / "checkpoints" / "step-000002"
    tensors = output_tensors(open_checkpoint(checkpoint_dir), torch.float32, tied=False)
    seen = []

    def add_row_index(first, end, rows):
        seen.append((first, end))
        return rows + torch.arange(first, end, dtype=rows.dtype).view(-1, *[1] * (rows.dim() - 1))

    target = next(t for t in tensors if t.name == "model.embed_tokens.weight")  # 128 rows of 64
    target.transform = add_row_index
    write_model(tmp_path, plan_shards(tensors, 10**9), block=64 * 5, progress=False)
    assert seen[0] == (0, 5) and seen[-1] == (125, 128) and len(seen) == 26
    written = load_file(tmp_path / "model.safetensors")
    reference = deepspeed_state_dict(checkpoint_dir)
    expected = reference[target.name] + torch.arange(128.0).view(-1, 1)
    assert torch.equal(written[target.name], expected)
    assert torch.equal(written["model.norm.weight"], reference["model.norm.weight"])


@pytest.mark.e2e
@pytest.mark.parametrize("bundled", [False, True])
def test_a_run_with_its_own_chat_template_exports_it(tmp_path, bundled):
    """model.chat_template (a file, or a bundled template's name) trained the rows; the export's
    tokenizer renders chat with the same one. Llama-3's turns end with <|eot_id|>, a base model's
    EOS is another token: the export's generation config stops at both (LLaMA-Factory made
    <|eot_id|> the EOS), else chat talked past the answer."""
    from conftest import write_jsonl

    from zerofit.demo import build_tokenizer
    from zerofit.infer.generate import eos_ids
    from zerofit.infer.load import load
    from zerofit.models import BUNDLED_TEMPLATES

    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "chatml.jinja").write_text(template)
    model = {"chat_template": str(tmp_path / "chatml.jinja")}
    if bundled:
        template = (BUNDLED_TEMPLATES / "llama3.jinja").read_text()
        tokenizer = build_tokenizer()  # a base model's: Llama-3's markers, no chat template
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>",
                                                                    "<|eot_id|>"]})
        tokenizer.chat_template = None
        tokenizer.save_pretrained(tmp_path / "base-tokenizer")
        model = {"chat_template": "llama3", "tokenizer": str(tmp_path / "base-tokenizer")}
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": turns}] * 64)
    config = tiny_config(tmp_path / "run", data, model=model,
                         train={"max_steps": 2}, eval={"at_end": False, "every_steps": 0}, checkpoint={"every_steps": 0})
    done = run_zerofit(["train", "--config", str(write_config(tmp_path / "c.yaml", config))])
    assert "messages rows by the tokenizer's chat template" in done.stderr
    run_zerofit(["export", str(tmp_path / "run"), "--out", str(tmp_path / "model")])
    assert (tmp_path / "model" / "chat_template.jinja").read_text() == template
    ends = eos_ids(load(str(tmp_path / "model")))
    if bundled:
        eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
        assert f"generation also stops at <|eot_id|> (id {eot})" in done.stderr and "warning" not in done.stderr
        assert ends == {tokenizer.eos_token_id, eot}
    else:  # <|im_end|> is no token of the demo tokenizer: the stop problem is said, nothing written
        assert "never with the EOS token" in done.stderr and ends == {build_tokenizer().eos_token_id}
        assert not (tmp_path / "run" / "model" / "generation_config.json").exists()


@pytest.mark.e2e
def test_gather_16bit_weights_on_save_writes_the_16bit_model_into_each_checkpoint(tmp_path):
    """zero.gather_16bit_weights_on_save: each checkpoint also holds DeepSpeed's consolidated 16-bit
    state dict (save_16bit_model's pytorch_model.bin, HF key names), the same weights an export of
    that checkpoint writes; it used to set DeepSpeed's flag and write nothing."""
    config = tiny_config(tmp_path / "run", zero={"gather_16bit_weights_on_save": True},
                         train={"max_steps": 2}, eval={"at_end": False, "every_steps": 0}, checkpoint={"every_steps": 2})
    run_zerofit(["train", "--config", str(write_config(tmp_path / "c.yaml", config))])
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    gathered = torch.load(checkpoint / "pytorch_model.bin", weights_only=True)
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    assert manifest["files"].get("pytorch_model.bin")  # hashed, verified as the others are
    planned = json.loads((tmp_path / "run" / "plan.json").read_text())["checkpoint_bytes"]
    assert abs(planned - manifest["total_bytes"]) < 0.05 * manifest["total_bytes"]  # the disk plan counts it
    run_zerofit(["export", str(checkpoint), "--out", str(tmp_path / "model"), "--dtype", "bf16"])
    exported = exported_tensors(tmp_path / "model")
    assert sorted(gathered) == sorted(exported) and len(gathered) == 2 * 9 + 3
    for key, tensor in gathered.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, exported[key]), key


def test_verify_judges_the_export_against_its_own_rounding_and_warns_of_the_dtypes(capsys):
    """A 4-step demo run's bf16 export matched the checkpoint rounded to bf16 exactly (max |diff| 0)
    and was refused, its logits (all under 1) 5.05e-2 from fp32: that drift is bf16's, not the
    export's. An export off its own rounding, or with load problems, is still refused."""
    from zerofit.export.verify import VerifyError, compare

    class Logits(torch.nn.Module):  # a model's forward as compare calls it: .logits of the ids
        def __init__(self, values):
            super().__init__()
            self.values = torch.tensor(values)

        def forward(self, ids):
            return type("Output", (), {"logits": self.values})()

    fp32, bf16 = Logits([[0.20, -0.31, 0.05]]), Logits([[0.26, -0.30, 0.05]])
    ids = torch.zeros(1, 3, dtype=torch.long)
    result = compare(bf16, fp32, bf16, torch.bfloat16, ids, {}, "DeepSpeed's reconstruction")
    assert result["ok"] and not result["rounding_ok"] and result["max_abs_diff"] == 0.0
    assert "bfloat16 rounding moves this model's logits by 6.00e-02" in " ".join(capsys.readouterr().err.split())
    with pytest.raises(VerifyError, match="the export does not reproduce the checkpoint"):
        compare(Logits([[0.27, -0.30, 0.05]]), fp32, bf16, torch.bfloat16, ids, {}, "DeepSpeed's reconstruction")
    with pytest.raises(VerifyError, match="load problems: {'missing': "):
        compare(bf16, fp32, bf16, torch.bfloat16, ids, {"missing": ["lm_head.weight"]}, "DeepSpeed's reconstruction")


@pytest.mark.e2e
def test_a_disk_too_small_or_a_directory_that_takes_no_files_is_an_error_not_a_traceback(one_rank, tmp_path,
                                                                                          monkeypatch, capsys):
    """A full disk ended the export in `OSError: [Errno 28]` and /proc/x in a FileNotFoundError,
    both as tracebacks: the weights' size is checked against the free space first, and a write
    that fails anyway is named, nothing published, no staging directory left."""
    from collections import namedtuple

    from zerofit.export import checkpoint as export_module

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(export_module.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))
    assert main(["export", str(one_rank), "--out", str(tmp_path / "small")]) == 1
    said = capsys.readouterr().err
    assert "the export's weights take" in said and "4.0KiB free; free space there" in said and "Traceback" not in said
    monkeypatch.undo()
    assert main(["export", str(one_rank), "--out", "/proc/zerofit-export"]) == 1  # /proc: 0 bytes free
    assert "and /proc has 0B free" in capsys.readouterr().err
    long_name = tmp_path / ("m" * 250)  # its staging directory's name is over the filesystem's 255 bytes
    assert main(["export", str(one_rank), "--out", str(long_name)]) == 1
    said = capsys.readouterr().err
    assert f"writing the export beside --out {long_name} failed: File name too long" in said, said
    assert "Traceback" not in said
    assert not (tmp_path / "small").exists() and not list(tmp_path.glob(".tmp-*"))
