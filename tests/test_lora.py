"""LoRA under ZeRO-3 on real DeepSpeed (CPU accelerator, gloo): only adapters carry optimizer
state and go into checkpoints, resume is exact, offload and two ranks work, the adapters
read back from a checkpoint are the trained ones, and bad targets are named."""
import json
import shutil

import pytest
import torch
from conftest import assert_resumes_exactly, read_jsonl, run_zerofit, tiny_config, trained_run, write_config

from zerofit.config.load import validate
from zerofit.config.schema import LoraConfig
from zerofit.core import runlock
from zerofit.core.errors import ConfigError
from zerofit.export.checkpoint import export
from zerofit.lora import adapters
from zerofit.lora import attach as lora
from zerofit.lora import base as basemodel
from zerofit.models import config_from_name
from zerofit.train.engine import check_base_files

LLAMA_DEFAULT = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def lora_config(run_dir, **sections) -> dict:
    """The tiny model with r=8 adapters: 12 steps, eval and checkpoint every 6."""
    config = tiny_config(run_dir, lora={"enabled": True, "r": 8, "alpha": 32},
                         eval={"every_steps": 6, "max_sequences": None}, checkpoint={"every_steps": 6, "keep_last": 2})
    config["train"].update(max_steps=12, lr=5e-2)
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


def meta_model(name="tiny"):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config_from_name(name))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora")
    return trained_run(base, lora_config(base / "run"))


# ------------------------------------------------------------------ end to end
@pytest.mark.e2e
def test_only_adapters_have_optimizer_state_and_checkpoint_files(lora_run):
    run, _, done = lora_run
    model = meta_model()
    adapted = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in LLAMA_DEFAULT]
    expected = sum(8 * (m.in_features + m.out_features) for m in adapted)  # A: r x in, B: out x r
    assert f"LoRA on {len(adapted)} modules" in done.stderr and "frozen and without adapters" not in done.stderr
    assert "is_gradient_checkpointing" not in done.stderr  # peft's deprecated question, in the planner's build too
    step = run / "checkpoints" / "step-000012"
    optim = torch.load(step / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    inner = optim["optimizer_state_dict"]
    assert sum(t.numel() for t in inner["fp32_flat_groups"]) == expected
    moments = inner["optimizer_state_dict"]["state"]
    assert sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in moments.values()) == 2 * expected
    states = torch.load(step / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)
    shapes = {name: shape for group in states["param_shapes"] for name, shape in group.items()}
    assert all(adapters.is_adapter(name) for name in shapes) and len(shapes) == 2 * len(adapted)
    assert states["frozen_param_fragments"] is None  # exclude_frozen_parameters: no base in the checkpoint
    total = sum(p.numel() for p in model.parameters())
    assert expected < 0.2 * total
    adapter_config = adapters.adapter_config(step)
    assert sorted(adapter_config["target_modules"]) == LLAMA_DEFAULT and adapter_config["r"] == 8


@pytest.mark.e2e
def test_repro_trains_the_adapters(lora_run, tmp_path):
    """`zerofit doctor --repro` of a LoRA run: the script attaches the run's adapters with peft
    (it full-fine-tuned every weight), and trains only them."""
    import subprocess
    import sys

    run, _, _ = lora_run
    run_zerofit(["doctor", "--repro", str(run), "--out", str(tmp_path / "repro.py")])
    script = (tmp_path / "repro.py").read_text()
    assert "'r': 8" in script and "'target_modules': [" in script and "'down_proj'" in script
    ran = subprocess.run([sys.executable, "repro.py", "--steps", "1", "--save-every", "0"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "step 1 loss" in ran.stdout


@pytest.mark.e2e
def test_loss_falls(lora_run):
    run, _, _ = lora_run
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 13))
    # B starts at zero, so step 1's loss is the frozen base's own.
    assert metrics[-1]["eval_loss"] < metrics[0]["loss"] - 0.2, metrics


@pytest.mark.e2e
def test_resume_continues_exactly(lora_run, tmp_path):
    """Steps 7-12 reproduce every loss and LR, and the step-12 adapter optimizer state is
    bit-equal (it was not before checkpointer.replay_cpu_adam_steps: masters ~1e-5 apart,
    the last eval loss 5e-5)."""
    run, config, _ = lora_run
    assert_resumes_exactly(run, config, tmp_path / "run", drop="step-000012", resumed_at=6)


@pytest.mark.e2e
@pytest.mark.parametrize("change, reason", [
    ("train.seed=8", "frozen base model differs"),  # checkpoints hold no base: it must be rebuilt the same
    # refused before anything is rewritten (resume.unloadable_changes)
    ("lora.r=4", "step-000012 cannot be loaded under this config (lora.r "),
    ("lora.target_modules=[q_proj,v_proj]", "cannot be loaded under this config (lora targets "),
])
def test_resume_refuses_what_the_adapters_do_not_fit(lora_run, tmp_path, change, reason):
    run, config, _ = lora_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    done = run_zerofit(["train", "--config", str(config), "--run-dir", str(copy), "--resume",
                        "--set", change, "--set", "train.max_steps=13"], check=False)
    assert done.returncode == 1, done.stderr[-2000:]
    assert reason in done.stderr.strip().splitlines()[-1]
    assert not (copy / "checkpoints" / "step-000013").exists()
    assert (copy / "checkpoints" / "step-000012" / "MANIFEST.json").is_file()


@pytest.mark.e2e
def test_resume_takes_the_same_targets_however_written(lora_run, tmp_path):
    """The default targets written out, in another order: the same adapted modules, so the
    checkpoint loads (it was refused as a change of lora.target_modules, null -> [...])."""
    run, config, _ = lora_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    written = ",".join(reversed(LLAMA_DEFAULT))
    done = run_zerofit(["train", "--config", str(config), "--run-dir", str(copy), "--resume",
                        "--set", f"lora.target_modules=[{written}]", "--set", "train.max_steps=13",
                        "--set", "lora.alpha=64"], env={"COLUMNS": "400"})
    stderr = done.stderr.replace("\n", "")
    assert "step-000012 at step 12" in stderr and "different config" in stderr and "lora targets" not in stderr
    # and what another alpha does to the adapter trained so far is said with it
    assert "lora.alpha 32 -> 64" in stderr and "its update now counts 2x what it did; keep 32" in stderr, stderr[-2000:]
    assert (copy / "checkpoints" / "step-000013").is_dir()


@pytest.mark.e2e
def test_offload_param_cpu_trains_the_same(lora_run, tmp_path):
    """The frozen base and the adapters offloaded to CPU: the very same losses."""
    run, _, _ = lora_run
    config = write_config(tmp_path / "c.yaml", lora_config(tmp_path / "run", zero={"offload_param": "cpu"},
                                                            checkpoint={"every_steps": 0}))
    run_zerofit(["train", "--config", str(config)])
    ds = json.loads((tmp_path / "run" / "ds_config.json").read_text())
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    offloaded = [m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert offloaded == [m["loss"] for m in read_jsonl(run / "metrics.jsonl")]


@pytest.mark.multirank
def test_two_ranks_with_a_fully_trained_head(tmp_path):
    config = write_config(tmp_path / "c.yaml", lora_config(tmp_path / "run", train={"max_steps": 4},
                                                            lora={"modules_to_save": ["lm_head"]},
                                                            checkpoint={"every_steps": 2}, eval={"every_steps": 2}))
    run_zerofit(["train", "--config", str(config)], nproc=2)
    step = tmp_path / "run" / "checkpoints" / "step-000004"
    manifest = json.loads((step / "MANIFEST.json").read_text())
    assert manifest["world_size"] == 2
    for rank in (0, 1):
        assert f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in manifest["files"]
    loop_state = json.loads((step / "loop_state.json").read_text())
    assert len(loop_state["extra"][basemodel.BASE_FINGERPRINT]) == 2
    tensors = adapters.read_adapter(step)  # reassembled from both ranks' partitions
    assert len(tensors) == 2 * 14 + 1  # A and B of 14 modules, and the trained copy of lm_head
    assert tensors["base_model.model.lm_head.weight"].shape == (128, 64)
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]
    # The merge replays the random init and checks both ranks' shares of it.
    result = export(tmp_path / "run", tmp_path / "merged", progress=False)
    assert result.lora.endswith("(fingerprint checked)") and result.world_size == 2
    # On one rank the rebuilt random init is gathered and digested as two ranks' shares: the same
    # base goes on; a record it does not match (one digit changed) is refused, as on two ranks.
    tampered = tmp_path / "tampered"
    shutil.copytree(tmp_path / "run", tampered)
    state_file = tampered / "checkpoints" / "step-000004" / "loop_state.json"
    recorded = json.loads(state_file.read_text())["extra"][basemodel.BASE_FINGERPRINT][1]
    state_file.write_text(state_file.read_text().replace(recorded, ("0" if recorded[0] != "0" else "1") + recorded[1:]))
    for run_dir, refused in ((tmp_path / "run", False), (tampered, True)):
        done = run_zerofit(["train", "--config", str(config), "--run-dir", str(run_dir), "--resume", "--set",
                            "train.max_steps=5", "--set", "checkpoint.verify=sizes"], check=False,
                           env={"COLUMNS": "400"})
        assert done.returncode == int(refused) and "cannot check" not in done.stderr, done.stderr[-2000:]
        assert (BASE_DIFFERS.format(step=4) in done.stderr) == refused and ("resumed from" in done.stderr) != refused


BASE_DIFFERS = ("the frozen base model differs from the one this run's adapters were trained on (checkpoint at step "
                "{step}): checkpoints hold only the adapters, so the base must be rebuilt exactly.")


@pytest.fixture(scope="module")
def path_bases(tmp_path_factory):
    """The tiny model saved as a model.path base, and a copy with one weight moved by 1e-3."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from zerofit.demo import build_tokenizer

    root = tmp_path_factory.mktemp("bases")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config_from_name("tiny")).save_pretrained(root / "base")
    build_tokenizer().save_pretrained(root / "base")
    shutil.copytree(root / "base", root / "base_mod")
    tensors = load_file(root / "base_mod" / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] += 1e-3
    save_file(tensors, root / "base_mod" / "model.safetensors", metadata={"format": "pt"})
    return root / "base", root / "base_mod"


@pytest.mark.multirank
def test_resume_on_another_rank_count_checks_the_base(path_bases, tmp_path):
    """Two ranks recorded two shares' fingerprints; one rank resuming on a changed base is
    refused with the same-rank refusal (the fingerprint recomputed for the recorded split: it
    was skipped, and the adapters went on silently on the other base), and on the same base
    goes on (and then records its own split's fingerprint)."""
    base, base_mod = path_bases
    raw = lora_config(tmp_path / "run", train={"max_steps": 2}, eval={"every_steps": 0, "at_end": False},
                      checkpoint={"every_steps": 2}, lora={"modules_to_save": ["lm_head"]})
    raw["model"] = {"path": str(base), "gradient_checkpointing": False}
    config = write_config(tmp_path / "c.yaml", raw)
    run_zerofit(["train", "--config", str(config)], nproc=2)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "run", copy)
    done = run_zerofit(["train", "--config", str(config), "--run-dir", str(copy), "--resume", "--set",
                        f"model.path={base_mod}", "--set", "train.max_steps=3"], check=False, env={"COLUMNS": "400"})
    assert done.returncode == 1
    assert BASE_DIFFERS.format(step=2) in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
    assert not (copy / "checkpoints" / "step-000003").exists()
    done = run_zerofit(["train", "--config", str(config), "--resume", "--set", "train.max_steps=3"])
    assert "resumed from" in done.stderr and "cannot check" not in done.stderr
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-000003" / "loop_state.json").read_text())
    assert len(state["extra"][basemodel.BASE_FINGERPRINT]) == 1


def files_of(directory):
    """{relative path: (bytes, mtime)} of every file under `directory`, the lock too: every start
    takes it first and writes its pid into it (runlock.hold); a refused one gives it back as it was."""
    return {str(f.relative_to(directory)): (f.read_bytes(), f.stat().st_mtime_ns)
            for f in sorted(directory.rglob("*")) if f.is_file()}


@pytest.mark.e2e
def test_resume_refused_for_another_base_leaves_the_run_as_it_was(path_bases, tmp_path):
    """The base is compared before the run's files are rewritten: a refusal left config.yaml
    naming the refused base (so resuming with the run's own config failed too), plan.json,
    ds_config.json and model/ rewritten, and said "resumed from" first. Now not a byte or an
    mtime changes, the lock's pid neither (the refused start's was left there), and the run's own
    config resumes."""
    base, base_mod = path_bases
    raw = lora_config(tmp_path / "run", train={"max_steps": 2}, eval={"every_steps": 0, "at_end": False},
                      checkpoint={"every_steps": 2})
    raw["model"] = {"path": str(base), "gradient_checkpointing": False}
    config = write_config(tmp_path / "c.yaml", raw)
    run_zerofit(["train", "--config", str(config)])
    run = tmp_path / "run"
    before = files_of(run)
    done = run_zerofit(["train", "--config", str(config), "--set", f"model.path={base_mod}", "--set",
                        "train.max_steps=3"], check=False, env={"COLUMNS": "400"})
    assert done.returncode == 1
    assert BASE_DIFFERS.format(step=2) in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
    assert "resumed from" not in done.stderr
    after = files_of(run)
    assert runlock.LOCK_FILE in before  # the first run's pid, which the refused start wrote over (and left)
    assert after.keys() == before.keys() and [k for k in before if after[k] != before[k]] == []
    done = run_zerofit(["train", "--config", str(run / "config.yaml"), "--set", "train.max_steps=3"])
    assert f"resumed from {run / 'checkpoints' / 'step-000002'} at step 2" in done.stderr.replace("\n", "")
    assert (run / "checkpoints" / "step-000003").is_dir()


def rewrite_loop_state(step_dir, change) -> None:
    """`change(extra)` applied to a checkpoint's loop_state.json extra, its manifest entry made to
    match (bytes and hash): the checkpoint as another zerofit, machine or base would have written it."""
    from zerofit.checkpoint import files as checkpoint

    state_file = step_dir / "loop_state.json"
    state = json.loads(state_file.read_text())
    change(state["extra"])
    state_file.write_text(json.dumps(state))
    manifest = checkpoint.read_manifest(step_dir)
    entry = manifest["files"]["loop_state.json"]
    manifest["total_bytes"] += state_file.stat().st_size - entry["bytes"]
    entry.update({"bytes": state_file.stat().st_size, checkpoint.HASH: checkpoint.file_hash(state_file)})
    (step_dir / checkpoint.MANIFEST).write_text(json.dumps(manifest, indent=1))


@pytest.mark.e2e
def test_random_init_base_drawn_with_other_versions_is_replayed_before_the_rewrite(tmp_path):
    """A random-init base with the same recipe that this machine draws otherwise (other torch /
    transformers / DeepSpeed versions, another device type) was refused only after the engine
    build, config.yaml, plan.json, ds_config.json and model/ rewritten by then. Where the versions
    the checkpoint records differ from these, the base is replayed before anything is rewritten
    (reinit.InitReplay, as export rebuilds it): one that draws the recorded base goes on; one that
    draws another (here: the recorded fingerprint another) is refused, every file as it was."""
    from zerofit.lora.base import BASE_FINGERPRINT, BASE_RECIPE

    raw = lora_config(tmp_path / "run", train={"max_steps": 2}, eval={"every_steps": 0, "at_end": False},
                      checkpoint={"every_steps": 2})
    config = write_config(tmp_path / "c.yaml", raw)
    run_zerofit(["train", "--config", str(config)])

    def other_torch(extra):
        extra[BASE_RECIPE]["versions"] = {**extra[BASE_RECIPE].get("versions", {}), "torch": "1.0.0"}

    def other_torch_drawing_another_base(extra):
        other_torch(extra)
        extra[BASE_FINGERPRINT] = ["0" * 32]

    for name, change, refused in (("other", other_torch_drawing_another_base, True), ("same", other_torch, False)):
        run = tmp_path / name
        shutil.copytree(tmp_path / "run", run)
        rewrite_loop_state(run / "checkpoints" / "step-000002", change)
        before = files_of(run)
        done = run_zerofit(["train", "--config", str(config), "--run-dir", str(run), "--set", "train.max_steps=3"],
                           check=False, env={"COLUMNS": "400"})
        said = " ".join(done.stderr.split())
        assert done.returncode == int(refused), said[-3000:]
        assert (BASE_DIFFERS.format(step=2) in said) == refused and ("resumed from" in said) != refused
        if refused:
            after = files_of(run)
            assert after.keys() == before.keys() and [k for k in before if after[k] != before[k]] == []
            assert "It was drawn on cpu with torch 1.0.0, " in said and "replayed here, it is another base." in said
        else:  # said why it replayed; the next checkpoint records the versions that drew it here
            assert "with torch 1.0.0, " in said and "replaying the random-init base to compare it" in said
            recipe = json.loads((run / "checkpoints" / "step-000003" / "loop_state.json").read_text())["extra"]
            assert recipe[BASE_RECIPE]["versions"]["torch"] == torch.__version__


@pytest.mark.e2e
def test_unknown_target_module_names_what_exists(tmp_path):
    config = write_config(tmp_path / "c.yaml", lora_config(tmp_path / "run", lora={"target_modules": ["qq_proj"]}))
    done = run_zerofit(["train", "--config", str(config)], check=False)
    assert done.returncode == 1
    reason = done.stderr.strip().splitlines()[-1]
    assert "'qq_proj' matches no module" in reason and "q_proj (Linear) x2" in reason, reason


@pytest.mark.e2e
def test_adapter_read_from_checkpoint_is_the_trained_one(tmp_path, tokenizer):
    """A base from model.path, LoRA-trained; the adapter read out of the ZeRO checkpoint,
    loaded by peft onto the same base outside DeepSpeed, gives the run's own eval loss."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from zerofit.config.load import load
    from zerofit.data import pipeline as data

    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    AutoModelForCausalLM.from_config(config_from_name("tiny")).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    raw = lora_config(tmp_path / "run", train={"max_steps": 4}, eval={"every_steps": 0},
                      checkpoint={"every_steps": 0})
    raw["model"] = {"path": str(base_dir), "gradient_checkpointing": True}
    run_zerofit(["train", "--config", str(write_config(tmp_path / "c.yaml", raw))])
    run = tmp_path / "run"
    out = adapters.write_peft_dir(run / "checkpoints" / "step-000004", tmp_path / "adapter", dtype="bf16")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, out, autocast_adapter_dtype=False).eval()
    config = load(run / "config.yaml")
    _, eval_set = data.load_splits(config.data, tokenizer, config.train.seq_len, config.train.seed, 128)
    batches = list(data.eval_batches(eval_set, config.train.micro_batch_size, 0, 1, config.eval.max_sequences))
    with torch.no_grad():  # the eval loss is the mean over every token evaluated
        summed = sum(model(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(labels)).loss.float()
                     * data.targets(labels) for ids, labels, _ in batches)
    tokens = sum(data.targets(batch.labels) for batch in batches)
    assert float(summed / tokens) == pytest.approx(read_jsonl(run / "metrics.jsonl")[-1]["eval_loss"], abs=1e-4)
    assert any(float(v.abs().sum()) > 0 for k, v in adapters.read_adapter(run / "checkpoints" / "step-000004").items()
               if ".lora_B." in k)  # B moved away from its zero init


# -------------------------------------------------------------- target modules
@pytest.fixture(scope="module")
def tiny_table():
    return lora.module_table(config_from_name("tiny"))


def test_default_targets_per_architecture(tiny_table):
    names = lora.resolve_targets(LoraConfig(), tiny_table, "llama")
    assert len(names) == 14 and "model.layers.1.mlp.down_proj" in names and "lm_head" not in names
    assert lora.compact_names(names, tiny_table) == LLAMA_DEFAULT


def test_unknown_architecture_falls_back_to_every_linear_but_the_head():
    from transformers import OPTConfig

    table = lora.module_table(OPTConfig(num_hidden_layers=1, hidden_size=16, ffn_dim=32, num_attention_heads=2,
                                        vocab_size=50, word_embed_proj_dim=16))
    names = lora.resolve_targets(LoraConfig(), table, "opt")
    assert {n.rsplit(".", 1)[-1] for n in names} == {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"}
    assert table.output_name == "lm_head" and "lm_head" not in names
    for everything in ("all", "all-linear"):  # LLaMA-Factory's lora_target: all, peft's all-linear
        assert lora.resolve_targets(LoraConfig(target_modules=[everything]), table, "opt") == names


def test_glob_patterns_match_full_names(tiny_table):
    names = lora.resolve_targets(LoraConfig(target_modules=["model.layers.1.*_proj"]), tiny_table, "llama")
    assert len(names) == 7 and all(n.startswith("model.layers.1.") for n in names)
    assert lora.compact_names(names, tiny_table) == names  # the short names would select layer 0 too


def test_pattern_on_a_module_lora_cannot_wrap(tiny_table):
    with pytest.raises(ConfigError, match=r"'self_attn' matches only self_attn \(LlamaAttention\) x2, which LoRA "
                                          r"cannot wrap.*q_proj \(Linear\) x2"):
        lora.resolve_targets(LoraConfig(target_modules=["self_attn"]), tiny_table, "llama")


def test_modules_to_save_must_exist(tiny_table):
    lora.check_modules_to_save(LoraConfig(modules_to_save=["lm_head"]), tiny_table)
    with pytest.raises(ConfigError, match=r"lora.modules_to_save: 'embed_out' matches no module"):
        lora.check_modules_to_save(LoraConfig(modules_to_save=["embed_out"]), tiny_table)


def test_globs_in_modules_to_save_are_expanded(tiny_table):
    """peft matches modules_to_save by name ending, so a glob handed to it trained nothing
    fully; expanded to the names it matches (outermost only), lm_* trains lm_head as lm_head does."""
    names = list(tiny_table.kinds)
    assert lora.expand_modules_to_save(["lm_*"], names) == ["lm_head"]
    assert lora.expand_modules_to_save(["model.layers.1.*", "lm_head"], names) == [
        "model.layers.1.self_attn", "model.layers.1.mlp", "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm", "lm_head"]
    assert lora.expand_modules_to_save(["lm_head", "embed_tokens"], names) == ["lm_head", "embed_tokens"]  # as is
    trainable = {}
    for written in ("lm_*", "lm_head"):
        config = validate(tiny_config("/tmp/unused", lora={"enabled": True, "modules_to_save": [written]}))
        model = lora.attach(meta_model(), config, lora.resolve(config, config_from_name("tiny")))
        trainable[written] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        assert model.peft_config["default"].modules_to_save == ["lm_head"]
    assert trainable["lm_*"] == trainable["lm_head"]
    assert "base_model.model.lm_head.modules_to_save.default.weight" in trainable["lm_*"]


def test_all_linear_with_other_names_says_it_must_be_alone(tiny_table):
    with pytest.raises(ConfigError, match=r"'all-linear' \(every Linear layer but the output head\) must be the "
                                          r"only entry, here with 'embed_tokens'; write \[all-linear\] alone"):
        lora.resolve_targets(LoraConfig(target_modules=["all-linear", "embed_tokens"]), tiny_table, "llama")


def test_lora_config_section(tmp_path):
    assert validate(tiny_config(tmp_path)).lora.enabled is False
    with pytest.raises(ConfigError, match=r"\['lm_head'\] is in both lora.target_modules and lora.modules_to_save"):
        validate(tiny_config(tmp_path, lora={"target_modules": ["lm_head"], "modules_to_save": ["lm_head"]}))
    with pytest.raises(ConfigError, match="lora.target_modules is empty"):
        validate(tiny_config(tmp_path, lora={"target_modules": []}))
    with pytest.raises(ConfigError, match=r"unknown key lora.rank; valid keys in lora: enabled, r, alpha"):
        validate(tiny_config(tmp_path, lora={"rank": 8}))


# ----------------------------------------------------------- adapter naming
@pytest.mark.parametrize("bias", ["none", "all", "lora_only"])
def test_adapter_names_are_peft_names(bias):
    """is_adapter/peft_key agree with peft's own get_peft_model_state_dict, on a model with
    biases (GPT-NeoX), adapters and a fully trained copy (modules_to_save)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    model = GPTNeoXForCausalLM(GPTNeoXConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                             intermediate_size=64, vocab_size=50))
    peft_model = get_peft_model(model, PeftLoraConfig(r=2, target_modules=["query_key_value", "dense"],
                                                      modules_to_save=["lm_head"], bias=bias, task_type="CAUSAL_LM"))
    state = peft_model.state_dict()
    name_of = {id(tensor): name for name, tensor in state.items()}
    expected = {name_of[id(t)]: key for key, t in get_peft_model_state_dict(peft_model, state_dict=state).items()}
    ours = {name: adapters.peft_key(name) for name in state if adapters.is_adapter(name, bias)}
    assert ours == expected
    assert set(ours) == {n for n, p in peft_model.named_parameters() if p.requires_grad}


def test_hf_target_names_the_base_weight():
    assert adapters.hf_target("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight") == \
        ("model.layers.0.self_attn.q_proj.weight", "lora_A")
    assert adapters.hf_target("base_model.model.lm_head.weight") == ("lm_head.weight", "replace")
    assert adapters.hf_target("base_model.model.gpt_neox.layers.0.attention.dense.base_layer.bias") == \
        ("gpt_neox.layers.0.attention.dense.bias", "replace")
    assert adapters.scaling(8, 32) == 4.0


def test_lora_on_a_base_whose_files_hold_other_names_is_refused_before_training(tmp_path):
    """Mixtral: transformers 5 fuses the experts on load (mlp.experts.gate_up_proj) that its files
    hold one by one (block_sparse_moe.experts.N.w1): the run trained, then no export could read
    the base. Refused before training now, naming a missing weight; a Llama base passes."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    for name, hf_config in (("llama", LlamaConfig(**common)),
                            ("mixtral", MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common))):
        AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path / name)
    check_base_files(validate(lora_config(tmp_path / "run", model={"path": str(tmp_path / "llama"),
                                                                        "config": None})))
    mixtral = validate(lora_config(tmp_path / "run", model={"path": str(tmp_path / "mixtral"), "config": None}))
    with pytest.raises(ConfigError, match=r"its files do not hold 6 of the weights .*mlp\.gate\.weight.*lora.enabled: false"):
        check_base_files(mixtral)
    fully = validate(lora_config(tmp_path / "run", model={"path": str(tmp_path / "mixtral"), "config": None},
                                 lora={"enabled": False}))
    check_base_files(fully)  # full fine-tuning reads no base files


def test_experts_lora_cannot_wrap_are_named():
    """transformers 5 holds an MoE layer's experts as fused parameters (MixtralExperts.gate_up_proj),
    which LoRA's target_modules cannot wrap: the default targets adapt attention alone, and the
    run says how much of the model stays frozen (the router, MixtralTopKRouter, too). A Llama leaves
    nothing out."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    mixtral = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    config = validate(lora_config("unused"))
    peft_model = lora.attach(AutoModelForCausalLM.from_config(mixtral), config,
                             lora.resolve(config, mixtral))
    experts = 2 * 4 * (2 * 128 * 64 + 64 * 128 + 64)  # layers x experts x (gate_up + down + the router's row)
    total = sum(p.numel() for p in peft_model.parameters())
    message = lora.unadaptable_warning(peft_model)
    assert message.startswith(f"LoRA leaves {lora.human_count(experts)} of the {lora.human_count(total)} parameters "
                              f"({100 * experts / total:.0f}%) frozen")
    assert "experts.gate_up_proj, experts.down_proj, gate.weight are weights outside" in message
    llama = lora.attach(meta_model(), config, LLAMA_DEFAULT)
    assert lora.unadaptable_warning(llama) is None
