"""End-to-end runs of `zerofit train` on real DeepSpeed ZeRO-3 (CPU accelerator, gloo)."""
import json
import os
import re
import shutil

import pytest
from conftest import (
    assert_resumes_exactly,
    read_jsonl,
    run_zerofit,
    tiny_config,
    trained_run,
    write_config,
    write_jsonl,
)

from zerofit.core import runlock
from zerofit.core.timeline import human_count


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    """6 steps, checkpoints at 3 and 6, 2 CPU threads asked for (the test environment says
    OMP_NUM_THREADS=1): shared by the tests that read its files."""
    base = tmp_path_factory.mktemp("one")
    return trained_run(base, tiny_config(base / "run", train={"cpu_threads": 2}))


@pytest.mark.e2e
def test_run_writes_the_run_directory(one_rank_run):
    run, _, done = one_rank_run
    for name in ("config.yaml", "ds_config.json", "metrics.jsonl", "memory.jsonl", "model/config.json",
                 "model/tokenizer.json"):
        assert (run / name).is_file(), name
    ds = json.loads((run / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["train_batch_size"] == 4 and "auto" not in json.dumps(ds)
    # one rank, parameters on the device: every parameter persistent (planner.all_persistent), and it trains
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 8192
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(m["tokens_per_s"] > 0 and m["lr"] > 0 for m in metrics)
    assert metrics[0]["lr"] < metrics[1]["lr"]  # warmup
    assert "eval_loss" in metrics[2] and "eval_loss" in metrics[5]
    timeline = read_jsonl(run / "memory.jsonl")
    assert {"forward", "backward", "optimizer_step", "save", "eval"} <= {r["phase"] for r in timeline}
    assert timeline[0]["phase"] == "start" and timeline[0]["cpu_threads"] == 2  # train.cpu_threads over the env
    assert timeline[0]["cpu_cores"] == len(os.sched_getaffinity(0)) and timeline[0]["local_world_size"] == 1
    # the tokens trained, padding left out: the loop state's count, under 6 steps of 4 rows of 64
    tokens = json.loads((run / "checkpoints" / "step-000006" / "loop_state.json").read_text())["tokens_seen"]
    assert 0 < tokens < 6 * 4 * 64 and f"done: step 6, {human_count(tokens)} tokens trained" in done.stderr
    # every eval has its line (plain lines come every 5 s: an eval between them went unsaid)
    evals = [f"step {m['step']}/6 eval loss {m['eval_loss']:.4f}" for m in metrics if "eval_loss" in m]
    assert len(evals) == 2 and all(line in done.stderr for line in evals)
    # the last step's line, its eval, then its checkpoint (the save's line came first)
    said = done.stderr
    assert said.index("step 6/6 loss") < said.index(evals[-1]) < said.index("checkpoint step-000006:")
    # the demo data is alpaca, rendered by the demo tokenizer's chat template: the saved tokenizer
    # (what exports copy) keeps it
    from transformers import AutoTokenizer

    from zerofit.demo import CHAT_TEMPLATE

    assert AutoTokenizer.from_pretrained(run / "model").chat_template == CHAT_TEMPLATE


@pytest.mark.e2e
def test_run_records_predicted_next_to_measured(one_rank_run):
    """plan.json holds what DeepSpeed got; every phase line of memory.jsonl carries the
    prediction next to the measurement (CPU accelerator: everything is host RAM)."""
    run, _, _ = one_rank_run
    plan = json.loads((run / "plan.json").read_text())
    assert plan["fits"] is True and plan["params"] == 90_432
    assert plan["deepspeed_config"] == json.loads((run / "ds_config.json").read_text())
    rows = [r for r in read_jsonl(run / "memory.jsonl") if r["phase"] in ("forward", "backward", "optimizer_step")]
    assert rows and all("predicted_host_rss" in r and "predicted_gpu_peak" in r for r in rows)
    for r in rows:  # the tiny model is all process baseline: the prediction is close
        assert 0.75 < r["host_peak"] / r["predicted_host_rss"] < 1.3, r
    assert checkpoint_size(run / "checkpoints" / "step-000006") / plan["checkpoint_bytes"] == pytest.approx(1, abs=0.1)


def checkpoint_size(path):
    return sum(f.stat().st_size for f in path.iterdir())


@pytest.mark.e2e
def test_a_plan_that_does_not_fit_is_refused(tmp_path):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run"))
    done = run_zerofit(["train", "--config", str(config), "--set", "plan.host_mem=1MiB"], check=False)
    assert done.returncode == 1
    assert "no configuration fits" in done.stderr and "host:" in done.stderr
    assert "what would fit" in done.stderr and "MiB of host RAM (have 1.0MiB)" in done.stderr
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["fits"] is False
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.e2e
def test_checkpoints_are_published_with_manifests(one_rank_run):
    run, _, _ = one_rank_run
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == "step-000006"
    for step in ("step-000003", "step-000006"):
        manifest = json.loads((ckpts / step / "MANIFEST.json").read_text())
        assert manifest["world_size"] == 1
        assert "zero_pp_rank_0_mp_rank_00_model_states.pt" in manifest["files"]
        assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in manifest["files"]
        assert json.loads((ckpts / step / "loop_state.json").read_text())["step"] == int(step[-6:])
    assert not list(ckpts.glob(".tmp-*"))


@pytest.mark.e2e
def test_resume_continues_exactly(one_rank_run, tmp_path):
    """Drop the step-6 checkpoint, resume from step 3: steps 4-6 reproduce the losses."""
    run, config, _ = one_rank_run
    assert_resumes_exactly(run, config, tmp_path / "run", drop="step-000006", resumed_at=3)


@pytest.mark.e2e
def test_a_resume_with_another_seq_len_keeps_the_epochs_share(one_rank_run, tmp_path):
    """train.seq_len doubled on resume from step 3: the data position is carried over as the
    same share of the epoch (in micro batches of the new, fewer sequences), with a
    warning that the epoch's order is a new one; before, the old count of micro batches
    landed twice as far into the epoch."""
    import shutil

    run, config, _ = one_rank_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step-000006")
    done = run_zerofit(["train", "--config", str(config), "--run-dir", str(copy), "--resume",
                        "--set", "train.seq_len=128"])
    assert "resumed from" in done.stderr and "step 3" in done.stderr
    said = " ".join(done.stderr.split())  # warnings wrap at the terminal's width
    shares = {m["step"]: m["epoch"] for m in read_jsonl(copy / "metrics.jsonl")}
    before = {m["step"]: m["epoch"] for m in read_jsonl(run / "metrics.jsonl")}
    assert f"the position carries over as the same share of epoch 1 ({before[3]:.1%})" in said
    new_micro_batch = shares[5] - shares[4]  # of the epoch; one micro batch a step
    assert new_micro_batch > 1.5 * (before[2] - before[1])  # fewer sequences (examples are cut at seq_len first)
    carried = shares[4] - new_micro_batch  # where the resumed run started
    assert before[3] <= carried + 1e-9 < before[3] + new_micro_batch


@pytest.mark.e2e
def test_hf_loss_trains_the_same_steps(one_rank_run, tmp_path):
    """train.chunked_loss=false (HF's loss) on the same config: every step's loss and the
    eval losses equal zerofit.loss's within fp32 rounding (the tiny model trains in bf16
    on CPU, whose logits the two losses read alike)."""
    run, _, _ = one_rank_run
    hf_run, _, _ = trained_run(tmp_path, tiny_config(tmp_path / "run", train={"cpu_threads": 2, "chunked_loss": False}))
    chunked = read_jsonl(run / "metrics.jsonl")
    hf = read_jsonl(hf_run / "metrics.jsonl")
    assert [m["step"] for m in hf] == [m["step"] for m in chunked]
    for ours, theirs in zip(chunked, hf):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-3), ours["step"]
        if "eval_loss" in theirs:
            assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-3)
    assert chunked[-1]["loss"] < chunked[0]["loss"]


@pytest.mark.e2e
def test_a_step_trains_on_the_mean_over_its_tokens_however_it_is_split(tmp_path):
    """The same 4 padded sequences per step (answers of 1 to 60 tokens) as 4 x 1, 1 x 4
    accumulated, and 2 per rank on 2 ranks: each step's loss is the mean over the step's
    tokens, and its gradient that mean's, so the runs agree step for step (fp32). A plain mean
    of micro-batch means (DeepSpeed's accumulation alone) weighted a 1-token answer like a
    60-token one: the 1 x 4 run's losses differed from the 4 x 1 run's."""
    rows = [{"instruction": f"say {i}", "output": "ab" * (1 + (i * 7) % 30)} for i in range(64)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    held = write_jsonl(tmp_path / "e.jsonl", rows[:7])  # 7: no split fills its last global batch
    losses = {}
    for name, micro, accum, ranks in (("4x1", 4, 1, 1), ("1x4", 1, 4, 1), ("2x1x2ranks", 2, 1, 2)):
        config = write_config(tmp_path / f"{name}.yaml", tiny_config(
            tmp_path / name, data_path=str(path), data={"packing": False, "eval_path": str(held)},
            train={"max_steps": 3, "micro_batch_size": micro, "grad_accum_steps": accum, "precision": "fp32",
                   "seq_len": 96}, eval={"every_steps": 0, "at_end": True},
            checkpoint={"every_steps": 0, "save_final": False}))
        run_zerofit(["train", "--config", str(config)], nproc=ranks)
        metrics = read_jsonl(tmp_path / name / "metrics.jsonl")
        losses[name] = [m["loss"] for m in metrics] + [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert losses["1x4"] == pytest.approx(losses["4x1"], rel=1e-5)
    assert losses["2x1x2ranks"] == pytest.approx(losses["4x1"], rel=1e-5)  # the eval too: the same 7 sequences
    assert len(losses["4x1"]) == 4 and losses["4x1"][2] < losses["4x1"][0]


def test_the_data_line_counts_examples_and_says_where_eval_comes_from(tmp_path, tokenizer, capsys):
    """The data line counts examples as well as the sequences laid out from them, and says where
    the eval set comes from (a default 5% hold-out surprises a LLaMA-Factory user: val_size is 0
    there); an eval_fraction beside eval_path is said to be unused; examples cut in the eval set
    are said too."""
    from zerofit.config.load import validate
    from zerofit.data import pipeline as data
    from zerofit.train import datareport

    rows = [{"instruction": f"say {i} " * (1 + i % 9), "output": "ab" * (1 + i % 5)} for i in range(40)]
    path, held = write_jsonl(tmp_path / "d.jsonl", rows), write_jsonl(tmp_path / "e.jsonl", rows[:6])
    for extra in ({}, {"eval_path": str(held), "eval_fraction": 0.1}):
        config = validate(tiny_config(tmp_path / "run", data_path=str(path), data=extra, train={"seq_len": 24}))
        train_set, eval_set = data.load_splits(config.data, tokenizer, 24, 7, 4096)
        datareport.report_data(train_set, eval_set, config, tokenizer)
        said = capsys.readouterr().err.replace("\n", " ")
        source = "6 from data.eval_path" if extra else "2 held out (data.eval_fraction 0.05)"
        assert f"data: {len(rows) - (0 if extra else 2)} examples, eval {source} -> {len(train_set)} train / " in said
        assert ("data.eval_fraction 0.1 is not used: the eval set is data.eval_path" in said) == bool(extra)
        assert "eval set: " in said and "examples longer than train.seq_len 24 were cut" in said


def isolated_loss(model, batches) -> float:
    """The mean next-token loss over `batches` (data.MicroBatch) with each packed example run
    through `model` alone: a row is cut where its position ids restart."""
    import numpy as np
    import torch

    summed, counted = 0.0, 0
    for batch in batches:
        for ids, labels, positions in zip(batch.input_ids, batch.labels, batch.position_ids):
            for segment in np.split(np.arange(len(ids)), np.flatnonzero(positions == 0)[1:]):
                with torch.no_grad():
                    logits = model(input_ids=torch.from_numpy(ids[segment])[None]).logits[0, :-1]
                targets = torch.from_numpy(labels[segment][1:])
                summed += float(torch.nn.functional.cross_entropy(logits.double(), targets, reduction="sum",
                                                                  ignore_index=-100))
                counted += int((targets != -100).sum())
    return summed / counted


@pytest.mark.e2e
def test_neat_packing_trains_each_example_alone(tmp_path, tokenizer):
    """data.neat_packing: a packed row's examples do not see each other. The step's loss and the
    eval loss of a run are what the model gives each example on its own (fp32; the LR so small
    that the step leaves the weights as they were); packing without it sees across them."""
    import torch
    from transformers import AutoModelForCausalLM

    from zerofit.config.load import load
    from zerofit.data import pipeline as data
    from zerofit.models import config_from_name

    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(config_from_name("tiny")).save_pretrained(base)
    tokenizer.save_pretrained(base)
    rows = [{"text": f"{i}:" + "ab" * (1 + (i * 5) % 9)} for i in range(60)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    held = write_jsonl(tmp_path / "e.jsonl", rows[::7])
    losses = {}
    for neat in (True, False):
        run_dir = tmp_path / f"neat-{neat}"
        config = write_config(tmp_path / f"{neat}.yaml", tiny_config(
            run_dir, data_path=str(path), data={"neat_packing": neat, "eval_path": str(held)},
            model={"path": str(base), "config": None, "gradient_checkpointing": True},  # the mask recomputed too
            train={"max_steps": 1, "seq_len": 48, "precision": "fp32", "lr": 1e-12, "warmup_steps": 0},
            eval={"every_steps": 0, "at_end": True}, checkpoint={"every_steps": 0, "save_final": False}))
        done = run_zerofit(["train", "--config", str(config)])
        assert "deprecated" not in done.stderr  # transformers 5 warns at every gradient_checkpointing_enable
        losses[neat] = read_jsonl(run_dir / "metrics.jsonl")[0]
    loaded = load(run_dir.parent / "True.yaml")
    train_set, eval_set = data.load_splits(loaded.data, tokenizer, 48, loaded.train.seed, 128)
    assert (train_set.positions == 0).sum() > 2 * len(train_set)  # several examples a row
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    step = [data.Batches(train_set, 4, 0, 1, loaded.train.seed).next()]
    evaluated = list(data.eval_batches(eval_set, 4, 0, 1))
    assert losses[True]["loss"] == pytest.approx(isolated_loss(model, step), rel=1e-5)
    assert losses[True]["eval_loss"] == pytest.approx(isolated_loss(model, evaluated), rel=1e-5)
    assert abs(losses[False]["eval_loss"] - losses[True]["eval_loss"]) > 1e-3


@pytest.mark.e2e
def test_finished_run_is_not_retrained(one_rank_run):
    """Started again, a finished run says so; with max_steps lowered under the step reached too,
    and its config.yaml (the run's own, which messages name) still says what its checkpoints were
    trained under: nothing is rewritten and no engine is built, and the lock file keeps the pid of
    the run that trained (the start that said so left its own)."""
    run, config, _ = one_rank_run
    files = {name: (run / name).read_bytes() for name in ("config.yaml", "plan.json", "ds_config.json",
                                                           runlock.LOCK_FILE)}
    done = run_zerofit(["train", "--config", str(config)])
    assert "is complete at step 6" in done.stderr and "done: step 6, train loss n/a" not in done.stderr
    lowered = run_zerofit(["train", "--config", str(config), "--set", "train.max_steps=4"])
    assert "is complete at step 6" in lowered.stderr.replace("\n", " ")
    assert {name: (run / name).read_bytes() for name in files} == files


@pytest.mark.e2e
def test_resume_without_checkpoint_is_an_error(tmp_path):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run"))
    done = run_zerofit(["train", "--config", str(config), "--resume"], check=False)
    assert done.returncode == 1
    assert f"--resume: no checkpoint under {tmp_path / 'run' / 'checkpoints'}; run without --resume" in done.stderr
    assert not (tmp_path / "run").exists()  # refused before the run directory (a lock, the data cache) was made


@pytest.mark.multirank
def test_two_ranks_write_both_ranks_files(tmp_path):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run", train={"max_steps": 4},
                                                             checkpoint={"every_steps": 2}))
    done = run_zerofit(["train", "--config", str(config)], nproc=2)
    step = tmp_path / "run" / "checkpoints" / "step-000004"
    manifest = json.loads((step / "MANIFEST.json").read_text())
    assert manifest["world_size"] == 2
    for rank in (0, 1):
        assert f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" in manifest["files"]
        assert f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in manifest["files"]
        assert f"rng_state_rank{rank}.pt" in manifest["files"]
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    ds = json.loads((tmp_path / "run" / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 8  # 4 per rank x 2 ranks
    # torchrun's OMP_NUM_THREADS=1 is replaced by the cores shared out over the ranks
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    for name in ("memory.jsonl", "memory-rank1.jsonl"):
        assert read_jsonl(tmp_path / "run" / name)[0]["cpu_threads"] == share
    assert f"zerofit gives each rank {share} CPU thread{'s' if share > 1 else ''}" in done.stderr.replace("\n", "")
    assert "train rows: tokenized once per machine, by its first rank with all of its cores; its 1 other rank " \
           "read them" in done.stderr.replace("\n", "")
    assert len(list((tmp_path / "run" / "data-cache").glob("train-*.npz"))) == 1


@pytest.mark.multirank
def test_two_ranks_a_bad_row_is_said_once_and_the_start_leaves_no_run_directory(tmp_path):
    """The first rank of the machine reads the rows and names the bad one; the other, waiting for
    it, stops without a word of its own about the data. Rank 1 used to make the run directory
    while rank 0 looked whether it was there (about 1 start in 3), and rank 0 then left it."""
    rows = [{"instruction": f"say {i}", "output": f"ok {i}"} for i in range(300)]
    rows[150] = {"instruction": 5, "output": "ok"}
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "deep" / "run",
                                                             write_jsonl(tmp_path / "d.jsonl", rows)))
    done = run_zerofit(["train", "--config", str(config)], nproc=2, check=False)
    assert done.returncode != 0
    assert done.stderr.count("d.jsonl, line 151: field `instruction`: expected a string, got int") == 1
    assert "another rank of this run is gone" not in done.stderr
    assert not (tmp_path / "deep").exists()


def test_cpu_threads_per_rank():
    from zerofit.machine.procenv import cpu_threads_per_rank

    threads, note = cpu_threads_per_rank(None, 32, 2, "1", True)  # torchrun's default for 2 ranks
    assert threads == 16 and "torchrun set OMP_NUM_THREADS=1" in note
    assert cpu_threads_per_rank(None, 32, 2, "4", True) == (4, None)     # the user's own setting is kept
    assert cpu_threads_per_rank(None, 32, 1, "1", False) == (1, None)    # set by hand, no launcher: kept
    assert cpu_threads_per_rank(None, 32, 1, None, False) == (32, None)
    assert cpu_threads_per_rank(None, 3, 4, None, True) == (1, None)     # never zero
    assert cpu_threads_per_rank(6, 32, 2, "1", True) == (6, None)        # train.cpu_threads wins
    assert cpu_threads_per_rank(None, 32, 2, None, True, writer_core=True) == (15, None)  # a core for the writer


def test_allocator_setting_leaves_the_users_choice():
    """procenv.allocator_setting: expandable segments by default; the config or the user's
    allocator variables (either name, either value) turn zerofit's setting off."""
    from zerofit.machine.procenv import allocator_setting

    assert allocator_setting(True, {}) == "expandable_segments:True"
    assert allocator_setting(True, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == "expandable_segments:True"
    assert allocator_setting(False, {}) is None
    assert allocator_setting(True, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) is None
    assert allocator_setting(True, {"PYTORCH_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:64"}) is None


@pytest.mark.e2e
def test_a_launched_rank_exits_at_once_with_its_code():
    """ranks.finish_distributed: in one of several launched ranks (WORLD_SIZE > 1) the
    process ends there with the run's code, what it printed flushed, nothing after it runs
    (no interpreter teardown, where gloo could abort the exit); a lone process goes on."""
    import subprocess
    import sys

    from conftest import ROOT

    program = ("import atexit; from zerofit.train import ranks; atexit.register(print, 'teardown ran'); "
               "print('trained', end=''); ranks.finish_distributed(7); print(' went on')")
    for world_size, code, printed in (("2", 7, "trained"), ("1", 0, "trained went on\nteardown ran\n")):
        done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "WORLD_SIZE": world_size}, timeout=120)
        assert (done.returncode, done.stdout) == (code, printed), done.stderr


@pytest.mark.e2e
def test_an_explained_error_ends_a_joined_process_at_once(tmp_path):
    """ranks.end_after_error: a process in a process group (one rank here, as a refused
    resume leaves it) ends with the error's code and no interpreter teardown, where gloo
    could abort the exit (-6 instead of 1); a process that joined none returns the code."""
    import subprocess
    import sys

    from conftest import ROOT

    join = ("import torch.distributed as d; d.init_process_group('gloo', init_method='file://{store}', rank=0, "
            "world_size=1); ")
    program = ("import atexit; from zerofit.train import ranks; atexit.register(print, 'teardown ran'); {join}"
               "print('refused', end=''); code = ranks.end_after_error(3); print(' returned', code)")
    for joined, code, printed in ((True, 3, "refused"), (False, 0, "refused returned 3\nteardown ran\n")):
        source = program.format(join=join.format(store=tmp_path / f"store-{joined}") if joined else "")
        done = subprocess.run([sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stdout) == (code, printed), done.stderr


@pytest.mark.e2e
def test_demo_learns(tmp_path):
    """The embedded default, shortened: eval loss clearly falls. Nothing is printed on stdout
    (DeepSpeed said there, before zerofit had chosen its accelerator, that it guessed CPU)."""
    done = run_zerofit(["train", "--run-dir", str(tmp_path / "demo"), "--set", "train.max_steps=60",
                        "--set", "eval.every_steps=20", "--set", "checkpoint.every_steps=0"])
    assert done.stdout == "" and "Setting accelerator" not in done.stderr
    assert re.search(r"\nplan: ZeRO-3, optimizer on \w+, params on \w+, micro batch \d+ x \d+, seq 128, .*; predicted "
                     r"peak host [\d.]+\w+ of [\d.]+\w+ usable \(the budgets less plan.headroom 10%\); "
                     r"~[\d.]+ s a step", done.stderr), done.stderr[:2000]
    evals = [m["eval_loss"] for m in read_jsonl(tmp_path / "demo" / "metrics.jsonl") if "eval_loss" in m]
    assert len(evals) == 3
    assert evals[-1] < evals[0] - 0.3, evals
    assert (tmp_path / "demo" / "checkpoints" / "step-000060" / "MANIFEST.json").is_file()


@pytest.mark.e2e
def test_a_random_init_config_json_trains_on_synthetic_data_without_a_tokenizer(tmp_path):
    """data.path synthetic draws token ids from the model's vocabulary: a config.json with no
    tokenizer beside it trains (it was refused: "comes without a tokenizer")."""
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                vocab_size=96).save_pretrained(tmp_path / "arch")
    config = tiny_config(tmp_path / "run", data_path="synthetic", model={"config": str(tmp_path / "arch" / "config.json")},
                         data={"synthetic_samples": 64}, train={"max_steps": 2}, checkpoint={"every_steps": 2})
    trained_run(tmp_path, config)
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2]


@pytest.mark.e2e
def test_deepspeed_launcher_runs_two_ranks(tmp_path):
    """The `deepspeed` launcher passes --local_rank=N before the verb; zerofit accepts it."""
    import shutil
    import subprocess

    launcher = shutil.which("deepspeed")
    assert launcher, "the deepspeed launcher is installed with the deepspeed package"
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run", train={"max_steps": 2},
                                                             checkpoint={"every_steps": 0}, eval={"every_steps": 0}))
    from conftest import ROOT

    from zerofit.train.ranks import free_port

    # `-m zerofit` through the launcher's --module, run from this checkout
    done = subprocess.run([launcher, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "zerofit",
                           "train", "--config", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step-000002" / "MANIFEST.json").read_text())
    assert manifest["world_size"] == 2


ZENFLOW_SCRIPT = """
import sys
sys.path.insert(0, "tests")
import torch
from conftest import tiny_config
from zerofit.plan import deepspeed
from zerofit.train import engine, ranks
from zerofit.core.errors import ConfigError
from zerofit.config.load import validate

bucket, checkpointing, guarded = {bucket}, {checkpointing}, {guarded}
config = validate(tiny_config("{run}", model={{"gradient_checkpointing": checkpointing}},
                              zero={{"reduce_bucket_size": bucket}}))
dist = ranks.init_distributed()
ds_config = deepspeed.build(config, 1, dist.on_gpu)
ds_config["zero_optimization"]["zenflow"] = {{"topk_ratio": 0.05, "update_interval": 4, "overlap_step": True}}
if not guarded:
    engine.zenflow_refusal = lambda config, ds_config: None  # DeepSpeed's own behaviour
try:
    model = engine.build_model(config, ds_config)
except ConfigError as refused:
    print("refused:", refused)
    sys.exit(3)
print("built partitioned:", hasattr(model.model.layers[0].mlp.up_proj.weight, "ds_id"))
built = engine.build_engine(model, config, ds_config, total_steps=4)
weight = built.module.model.layers[0].mlp.up_proj.weight
print("up_proj as DeepSpeed keeps it:", tuple(weight.ds_shape))
input_ids = torch.randint(0, 100, (2, 16))
logits = built(input_ids=input_ids).logits
print("logits:", tuple(logits.shape), flush=True)
built.backward(logits.float().mean())
"""


def run_zenflow(tmp_path, bucket: int, checkpointing: bool = False, guarded: bool = True):
    import subprocess
    import sys

    from conftest import ROOT

    script = ZENFLOW_SCRIPT.format(run=tmp_path / "run", bucket=bucket, checkpointing=checkpointing,
                                   guarded=guarded)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)


# ZenFlow's backward allocates on 'cuda' whatever the accelerator (zenflow/engine_stage3.py
# update_selected_channels, where the reduced gradients arrive): on the CPU a backward that got
# through DeepSpeed's gradient reduce ends there, and nowhere earlier.
REDUCED_THEN_CUDA = "update_selected_channels"


@pytest.mark.e2e
def test_zenflow_gets_the_model_built_whole_and_its_forward_and_reduce_run(tmp_path):
    """ZenFlow's ZeRO-3 keeps 2-D weights transposed from the engine's start; under
    deepspeed.zero.Init they are partitioned before it can, and the first forward failed on
    the GPU ('mat1 and mat2 shapes cannot be multiplied'). Built whole, DeepSpeed partitions
    the transposed weights, the forward runs and the backward's gradients are reduced (with a
    reduce bucket as large as the largest weight: the next test)."""
    from transformers import LlamaConfig

    from zerofit.config.schema import ModelConfig
    from zerofit.models import hf_config

    tiny = hf_config(ModelConfig(config="tiny"))
    assert isinstance(tiny, LlamaConfig) and tiny.intermediate_size != tiny.hidden_size  # a non-square weight
    largest = max(tiny.vocab_size, tiny.intermediate_size) * tiny.hidden_size
    done = run_zenflow(tmp_path, bucket=largest)
    assert "built partitioned: False" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
    assert f"up_proj as DeepSpeed keeps it: {(tiny.hidden_size, tiny.intermediate_size)}" in done.stdout
    assert f"logits: (2, 16, {tiny.vocab_size})" in done.stdout
    assert REDUCED_THEN_CUDA in done.stderr and "view size is not compatible" not in done.stderr, done.stderr[-4000:]


@pytest.mark.e2e
def test_zenflow_is_refused_before_the_build_where_deepspeed_would_fail(tmp_path):
    """A 2-D weight larger than the reduce bucket is reduced transposed and DeepSpeed fails
    (llama-3.6b's embedding on the H200); activation checkpointing's recompute fails on the
    transposed weights. zerofit refuses both before the (whole, slow) build and names the fix;
    unguarded, DeepSpeed fails as said."""
    from zerofit.config.schema import ModelConfig
    from zerofit.models import hf_config

    tiny = hf_config(ModelConfig(config="tiny"))
    largest = max(tiny.vocab_size, tiny.intermediate_size) * tiny.hidden_size

    small = run_zenflow(tmp_path, bucket=largest - 1)
    assert small.returncode == 3, small.stdout[-2000:] + small.stderr[-4000:]
    assert f"set zero.reduce_bucket_size: {largest} or more" in small.stdout
    unguarded = run_zenflow(tmp_path, bucket=largest - 1, guarded=False)
    assert "view size is not compatible" in unguarded.stderr and REDUCED_THEN_CUDA not in unguarded.stderr

    # a bucket that flushes only after the backward, so the recompute runs before any reduce
    recomputing = run_zenflow(tmp_path, bucket=100 * largest, checkpointing=True)
    assert recomputing.returncode == 3 and "set model.gradient_checkpointing: false" in recomputing.stdout
    unguarded = run_zenflow(tmp_path, bucket=100 * largest, checkpointing=True, guarded=False)
    assert "mat1 and mat2 shapes cannot be multiplied" in unguarded.stderr, unguarded.stderr[-4000:]


def test_an_eta_past_a_day_keeps_its_days():
    from zerofit.core.console import clock

    assert clock(3 * 3600 + 45 * 60) == "03:45:00"
    assert clock(27.75 * 3600) == "1d 03:45:00"  # it read 03:45:00 (gmtime's hours wrap)
    assert clock(11.6 * 86400) == "11d 14:24:00"


def test_epochs_are_passes_over_the_data_as_the_loader_counts_them(tmp_path):
    """57 sequences, 4 x 3 accumulated: the loader's epoch is 14 micro batches (4.67 steps);
    counted in whole steps, `epochs: 2` ran 8 steps, 1.71 epochs."""
    from zerofit.config.load import validate
    from zerofit.train.setup import total_optimizer_steps

    config = validate(tiny_config(tmp_path, train={"max_steps": None, "epochs": 2, "micro_batch_size": 4,
                                                   "grad_accum_steps": 3}))
    steps = total_optimizer_steps(config, 57, world_size=1)
    assert steps == 10 and 2 <= steps * 3 / 14 < 2 + 3 / 14  # at least 2 epochs, at most one step more
    assert total_optimizer_steps(config.model_copy(update={"train": config.train.model_copy(update={"epochs": 1})}),
                                 48, world_size=2) == 2  # 48 // 8 = 6 micro batches of 4 on 2 ranks, 3 a step


@pytest.mark.e2e
def test_tensorboard_curves_follow_resumes_and_starts_over(tmp_path):
    """A resume from step 2 of a run that reached 4 wrote steps 3-4 twice into the event files
    (metrics.jsonl dropped them); --no-resume added a new run's steps 1.. to the old curves."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run", train={"max_steps": 4},
                                                           checkpoint={"every_steps": 2, "keep_last": 3},
                                                           log={"tensorboard": True, "progress": False}))
    run_zerofit(["train", "--config", str(config)])
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-000004")
    run_zerofit(["train", "--config", str(config), "--set", "train.max_steps=5", "--resume"])

    def steps(directory):
        events = EventAccumulator(str(directory))
        events.Reload()
        return [event.step for event in events.Scalars("loss")]

    assert steps(tmp_path / "run" / "tensorboard") == [1, 2, 3, 4, 5]
    again = run_zerofit(["train", "--config", str(config), "--no-resume"])
    assert steps(tmp_path / "run" / "tensorboard") == [1, 2, 3, 4]
    moved = next((tmp_path / "run" / "checkpoints").glob("earlier-*"))
    assert steps(moved / "tensorboard") == [1, 2, 3, 4, 5] and "moved" in again.stderr


def test_what_an_early_stop_can_go_on_from(tmp_path, monkeypatch):
    """The line a Ctrl-C or SIGTERM ends with: a command that works. Stopped before the run's
    files were written, there is no config.yaml to name (it pointed at one that did not exist)."""
    from zerofit.config.load import validate
    from zerofit.train.resume import where_to_go_on

    monkeypatch.chdir(tmp_path)
    config = validate(tiny_config(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    assert where_to_go_on(config) == "no checkpoint was saved; the same command starts again"
    (tmp_path / "run" / "config.yaml").write_text("model: {config: tiny}\n")
    assert where_to_go_on(config).startswith(f"no checkpoint was saved; `zerofit train --config {tmp_path}/run/"
                                             f"config.yaml` starts again")
    (tmp_path / "run" / "checkpoints" / "step-000003").mkdir(parents=True)
    assert where_to_go_on(config).startswith("the newest checkpoint is step-000003; `zerofit train --config ")


def test_an_evaluation_covers_the_same_sequences_however_the_run_is_split(tmp_path):
    """A cap in micro batches x ranks (the old eval.max_batches): micro 16 evaluated 100 sequences and micro 2
    16 of the same set, so two runs' eval losses (and one before and after an OOM retry's smaller
    micro batch) did not compare. The cap is in sequences now, the whole set unset."""
    from zerofit.config.load import validate
    from zerofit.core.errors import ConfigError
    from zerofit.train.loop import eval_sequences

    def config(micro, **eval_keys):
        raw = tiny_config(tmp_path, train={"micro_batch_size": micro})
        raw["eval"] = {"every_steps": 0, **eval_keys}  # not the test config's cap
        return validate(raw)

    for micro, ranks in ((16, 1), (2, 1), (1, 4)):
        assert eval_sequences(config(micro), ranks, held=100) == 100  # unset: the whole set, as HF Trainer
        assert eval_sequences(config(micro, max_sequences=40), ranks, held=100) == 40
    assert eval_sequences(config(16, max_sequences=400), 1, held=100) == 100
    with pytest.raises(ConfigError, match="max_batches"):  # the cap in micro batches is gone: one way to say it
        config(16, max_batches=8)


def test_warmup_as_a_share_of_the_run_counts_as_transformers_does():
    """HF's warmup_ratio (transformers 5: a warmup_steps below 1): ceil(ratio x steps) warmup steps,
    then the same decay as warmup_steps gives."""
    import math

    from transformers.training_args import TrainingArguments

    from zerofit.config.load import load
    from zerofit.train.engine import lr_lambda, warmup_steps

    by_ratio = load(None, ["train.warmup_ratio=0.03", "train.warmup_steps=0"])
    for total in (10, 100, 1234):
        expected = TrainingArguments(output_dir="/tmp/unused", warmup_steps=0.03).get_warmup_steps(total)
        assert warmup_steps(by_ratio.train, total) == expected == math.ceil(0.03 * total)
        by_steps = load(None, [f"train.warmup_steps={expected}"])
        assert [lr_lambda(by_ratio, total)(s) for s in range(total)] == [lr_lambda(by_steps, total)(s) for s in range(total)]
    from zerofit.core.errors import ConfigError

    with pytest.raises(ConfigError, match="set train.warmup_steps or train.warmup_ratio, not both"):
        load(None, ["train.warmup_ratio=0.1", "train.warmup_steps=5"])


TRAIN_MODE_SCRIPT = """
import sys
sys.path.insert(0, "tests")
import torch
from transformers import AutoModelForCausalLM
from conftest import tiny_config
from zerofit.plan import deepspeed
from zerofit.train import engine, ranks
from zerofit.config.load import validate
from zerofit.demo import build_tokenizer
from zerofit.models import config_from_name

AutoModelForCausalLM.from_config(config_from_name("tiny")).save_pretrained("{base}")
build_tokenizer().save_pretrained("{base}")
config = validate(tiny_config("{run}", model={{"path": "{base}", "config": None, "gradient_checkpointing": True}}))
dist = ranks.init_distributed()
ds_config = deepspeed.build(config, 1, dist.on_gpu)
built = engine.build_engine(engine.build_model(config, ds_config), config, ds_config, total_steps=4)
mlp, calls = built.module.model.layers[0].mlp, []
forward = mlp.forward  # wrapped, not hooked: forward hooks do not fire in a checkpoint's recompute
mlp.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
logits = built(input_ids=torch.randint(0, 100, (2, 16))).logits
built.backward(logits.float().mean())
print("training:", built.module.training, "layer forwards:", len(calls))
"""


@pytest.mark.e2e
def test_a_model_from_a_directory_trains_in_training_mode(tmp_path):
    """from_pretrained returns a model in eval mode, where transformers skips gradient
    checkpointing and dropout: a model.path run trained without them until its first eval (on
    the H200 a 0.5B full fine-tune peaked at 25.9 GiB against a plan of 15.3). With checkpointing
    on, a layer's forward runs again in the backward."""
    import subprocess
    import sys

    from conftest import ROOT

    script = TRAIN_MODE_SCRIPT.format(base=tmp_path / "base", run=tmp_path / "run")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert "training: True layer forwards: 2" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
