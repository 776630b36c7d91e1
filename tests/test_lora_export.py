"""`zerofit export` of LoRA runs on real DeepSpeed checkpoints: merged exports equal peft's own
merge_and_unload of the same weights (a model.path base streamed from its files, a random-init
base replayed), adapter directories load in peft and run in chat/generate, a base that is not
the trained one is refused, and a merge stays under --max-ram."""
import json
import shutil
import sys

import pytest
import torch
from conftest import deepspeed_lines, exported_tensors, peak_rss_of, run_zerofit, tiny_config, trained_run

from zerofit.cli import main
from zerofit.core.errors import ConfigError
from zerofit.export.checkpoint import export
from zerofit.infer.load import load_adapter
from zerofit.lora import adapters, reinit
from zerofit.lora import base as basemodel
from zerofit.models import PRESETS, config_from_name

IDS = torch.tensor([[1, 40, 73, 80, 80, 83, 4, 91, 83, 86, 80, 72, 2]])


def lora_run_config(run_dir, model: dict, steps: int, **lora) -> dict:
    config = tiny_config(run_dir, lora={"enabled": True, "r": 8, "alpha": 32, **lora},
                         eval={"every_steps": 0, "at_end": False}, checkpoint={"every_steps": 0})
    config["model"] = {**model, "gradient_checkpointing": False}
    config["train"].update(max_steps=steps, lr=5e-2, warmup_steps=0)
    return config


@pytest.fixture(scope="module")
def random_run(tmp_path_factory):
    """Random init (preset tiny), adapters on every projection and a fully trained lm_head."""
    base = tmp_path_factory.mktemp("random")
    run, _, _ = trained_run(base, lora_run_config(base / "run", {"config": "tiny"}, 4, modules_to_save=["lm_head"]))
    return run


@pytest.fixture(scope="module")
def path_run(tmp_path_factory):
    """A 38M-parameter base saved in fp32 (152 MB: more than a merge under the RAM cap may
    hold), LoRA-trained for 2 steps from its model.path."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zerofit.demo import build_tokenizer

    root = tmp_path_factory.mktemp("path")
    fields = {k: v for k, v in PRESETS["tiny"].items() if k != "model_type"}
    fields.update(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                  num_key_value_heads=8)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**fields)).save_pretrained(root / "base")
    build_tokenizer().save_pretrained(root / "base")
    config = lora_run_config(root / "run", {"path": str(root / "base")}, 2)
    # at lr 5e-2 two steps can leave this base where bf16 rounding alone moves its logits by more
    # than their scale (12.2 vs 7.0), which --verify's bf16-vs-fp32 check warns of
    config["train"].update(seq_len=96, micro_batch_size=1, lr=1e-2)
    run, _, _ = trained_run(root, config)
    return run, root / "base"


def step_of(run):
    return sorted((run / "checkpoints").glob("step-*"))[-1]


def peft_merged(base_model, checkpoint_dir, scratch):
    """The reference: peft's PeftModel.from_pretrained + merge_and_unload, fp32 adapters."""
    from peft import PeftModel

    adapter_dir = adapters.write_peft_dir(checkpoint_dir, scratch / "fp32-adapter", dtype="fp32")
    return PeftModel.from_pretrained(base_model, adapter_dir, autocast_adapter_dtype=False).merge_and_unload().eval()


def assert_equals_peft_merge(out_fp32, out_bf16, merged):
    """Exported tensors are peft's merged weights bit for bit (bf16: the same numbers rounded
    once), and the exports' logits are peft's."""
    from transformers import AutoModelForCausalLM

    reference = merged.state_dict()
    for out, dtype in ((out_fp32, torch.float32), (out_bf16, torch.bfloat16)):
        tensors = exported_tensors(out)
        assert set(tensors) == set(reference)
        for name, tensor in tensors.items():
            assert torch.equal(tensor, reference[name].to(dtype)), (out.name, name)
    with torch.no_grad():
        want = merged(IDS).logits
        for out, tolerance in ((out_fp32, 0.0), (out_bf16, 5e-2)):
            got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(IDS).logits
            assert float((got - want).abs().max()) <= tolerance * float(want.abs().max()), out.name


# ------------------------------------------------------------------ merged exports
@pytest.mark.e2e
def test_merge_onto_a_replayed_random_init_base_equals_peft(random_run, tmp_path):
    checkpoint_dir = step_of(random_run)
    results = [export(random_run, tmp_path / dtype, dtype=dtype, progress=False) for dtype in ("fp32", "bf16")]
    for result in results:  # the replayed base has the training base's fingerprint
        assert "merged 14 LoRA adapter(s) into the random-init (seed 7, bf16, drawn on cpu) base (fingerprint " \
               "checked)" in result.lora
    recipe = basemodel.read_recipe(checkpoint_dir)
    base, _ = reinit.build_model(config_from_name("tiny"), torch.bfloat16, recipe.seed)
    merged = peft_merged(base.float(), checkpoint_dir, tmp_path)
    assert_equals_peft_merge(tmp_path / "fp32", tmp_path / "bf16", merged)
    trained_head = adapters.read_adapter(checkpoint_dir)["base_model.model.lm_head.weight"]
    assert torch.equal(exported_tensors(tmp_path / "fp32")["lm_head.weight"], trained_head)  # modules_to_save
    assert not json.loads((tmp_path / "bf16" / "config.json").read_text())["tie_word_embeddings"]


@pytest.mark.e2e
def test_merge_of_a_model_path_base_equals_peft(path_run, tmp_path):
    from transformers import AutoModelForCausalLM

    run, base_dir = path_run
    done = run_zerofit(["export", str(run), "--out", str(tmp_path / "bf16"), "--verify"])
    assert f"into the base at {base_dir} (fingerprint checked)" in done.stderr
    assert "vs peft's unmerged base + adapter" in done.stderr and ": ok" in done.stderr
    export(run, tmp_path / "fp32", dtype="fp32", progress=False)
    merged = peft_merged(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), step_of(run), tmp_path)
    assert_equals_peft_merge(tmp_path / "fp32", tmp_path / "bf16", merged)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(exported_tensors(base_dir)[name], exported_tensors(tmp_path / "fp32")[name])  # merged


@pytest.mark.e2e
def test_out_over_the_base_is_refused_and_the_base_kept(path_run, capsys):
    """`export RUN --out BASE --overwrite` replaced the model.path the merge read (and the run
    then had no base to resume, export or chat with); like the run's own files, it is refused."""
    run, base_dir = path_run
    before = {f.name: f.read_bytes() for f in base_dir.iterdir() if f.is_file()}
    for extra in ([], ["--adapter-only"]):
        assert main(["export", str(run), "--out", str(base_dir), "--overwrite", *extra]) == 1
        assert f"is or holds {base_dir.resolve()}, which this export reads" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in base_dir.iterdir() if f.is_file()} == before


@pytest.mark.e2e
def test_changed_base_is_refused(path_run, tmp_path, capsys):
    """The run's model.path now holds other weights: the export stops before writing."""
    run, base_dir = path_run
    weights = base_dir / "model.safetensors"
    original = weights.read_bytes()
    try:
        from safetensors.torch import save_file

        tensors = exported_tensors(base_dir)
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.01
        save_file(tensors, str(weights), metadata={"format": "pt"})
        assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 1
        reason = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"the base at {base_dir} is not the base model the adapters were trained on" in reason, reason
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))
        # an adapter directory names its base for peft and vLLM: the same check, without --verify
        assert main(["export", str(run), "--out", str(tmp_path / "adapter"), "--adapter-only"]) == 1
        assert "is not the base model the adapters were trained on" in capsys.readouterr().err
        assert not (tmp_path / "adapter").exists()
    finally:
        weights.write_bytes(original)


@pytest.mark.e2e
def test_merge_stays_under_max_ram(path_run, tmp_path):
    run, _ = path_run
    code, baseline, err = peak_rss_of([sys.executable, "-c", "import zerofit.cli, zerofit.export.checkpoint, zerofit.export.merge, "
                                       "peft, transformers.models.llama.modeling_llama"], tmp_path)
    assert code == 0, err
    room = 96 << 20
    cap = baseline + room
    code, peak, err = peak_rss_of([sys.executable, "-m", "zerofit", "export", str(run), "--out", str(tmp_path / "out"),
                                   "--max-ram", str(cap)], tmp_path)
    assert code == 0, err
    assert "fingerprint checked" in err
    fp32_bytes = 2 * sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors"))
    assert fp32_bytes > 1.5 * room  # neither the base nor the merged model could have been held
    assert peak <= cap, f"peak RSS {peak / 2**20:.0f} MiB > cap {cap / 2**20:.0f} MiB (baseline {baseline / 2**20:.0f})"


# ------------------------------------------------------------ adapter directories
@pytest.mark.e2e
def test_adapter_only_loads_in_peft_and_generates(path_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, base_dir = path_run
    out = tmp_path / "adapter"
    result = export(run, out, adapter_only=True, dtype="fp32", progress=False)
    assert result.lora == f"peft adapter directory for the base {base_dir}"
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir)
    assert (out / "tokenizer.json").is_file() and not (out / "config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out).eval()
    merged = peft_merged(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), step_of(run), tmp_path)
    with torch.no_grad():
        got, want = model(IDS).logits, merged(IDS).logits
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    done = run_zerofit(["generate", str(out), "--prompt", "Add the two numbers.", "--max-new-tokens", "5",
                        "--min-new-tokens", "5"])
    assert "5 new tokens" in done.stderr and "+ the LoRA adapter" in done.stderr
    # the run's generation config (a template's turn end among the end tokens: runfiles.write_generation_config)
    # stops generation on the base too, not only in a merged export
    from zerofit.infer.generate import eos_ids

    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert eos_ids(load_adapter(out)) == {2, 7}
    (out / "generation_config.json").unlink()
    # the base moved: pointing the adapter's base_model_name_or_path at it is enough (still fingerprinted)
    moved = tmp_path / "moved-base"
    base_dir.rename(moved)
    try:
        adapter_config = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**adapter_config, "base_model_name_or_path": str(moved)}))
        done = run_zerofit(["generate", str(out), "--prompt", "Add the two numbers.", "--max-new-tokens", "5",
                            "--min-new-tokens", "5"])
        assert "5 new tokens" in done.stderr
    finally:
        moved.rename(base_dir)


@pytest.mark.e2e
def test_adapter_dir_on_a_random_init_base_chats(random_run, tmp_path):
    out = tmp_path / "adapter"
    done = run_zerofit(["export", str(random_run), "--out", str(out), "--adapter-only", "--verify"])
    assert "rebuilt by zerofit chat" in done.stderr and ": ok" in done.stderr
    assert deepspeed_lines(done) == []  # DeepSpeed's "Setting accelerator to CPU" came with the adapters
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    chat = run_zerofit(["chat", str(out), "--max-new-tokens", "4", "--min-new-tokens", "4"],
                       input_text="hello\nand now?\n")
    assert chat.stderr.count("[4 tokens, ") == 2 and "+ the LoRA adapter" in chat.stderr
    # Another seed rebuilds another base: refused, not run.
    record = json.loads((out / basemodel.ADAPTER_BASE_FILE).read_text())
    record["recipe"]["seed"] += 1
    (out / basemodel.ADAPTER_BASE_FILE).write_text(json.dumps(record))
    done = run_zerofit(["generate", str(out), "--prompt", "hi"], check=False)
    assert done.returncode == 1
    assert "the rebuilt random-init (seed 8, bf16, drawn on cpu) base is not the base model the adapters were " \
           "trained on" in done.stderr.strip().splitlines()[-1]
    if not torch.cuda.is_available():  # a base the GPU's RNG drew cannot be rebuilt here
        record["recipe"].update(seed=record["recipe"]["seed"] - 1, init_device="cuda")
        (out / basemodel.ADAPTER_BASE_FILE).write_text(json.dumps(record))
        with pytest.raises(ConfigError, match="drawn by the GPU's RNG"):
            load_adapter(out)


@pytest.mark.e2e
def test_universal_copy_of_a_lora_checkpoint_is_refused(random_run, tmp_path, capsys):
    """A resume on another number of ranks converts a LoRA checkpoint too; its universal copy
    lacks what the merge needs (the adapter settings in loop_state.json): export names step-N."""
    import shutil

    from zerofit.checkpoint import universal

    shutil.copytree(random_run / "model", tmp_path / "run" / "model")
    step_dir = tmp_path / "run" / "checkpoints" / "step-000004"
    shutil.copytree(random_run / "checkpoints" / step_dir.name, step_dir)
    universal_dir = universal.convert(step_dir)
    for extra in ([], ["--adapter-only"]):
        assert main(["export", str(universal_dir), "--out", str(tmp_path / "out"), *extra]) == 1
        err = capsys.readouterr().err
        assert "universal-step-000004 is a universal copy of a LoRA checkpoint" in err, err
        assert f"export {step_dir} instead" in err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------ a tied-embedding base
@pytest.fixture(scope="module")
def tied_base(tmp_path_factory):
    """The tiny model with tied input and output embeddings (as Llama-3.2-1B, Qwen2-0.5B), saved
    with save_pretrained: its files hold model.embed_tokens.weight alone."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zerofit.demo import build_tokenizer

    base = tmp_path_factory.mktemp("tied") / "base"
    fields = {k: v for k, v in PRESETS["tiny"].items() if k != "model_type"}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**{**fields, "tie_word_embeddings": True})).save_pretrained(base)
    build_tokenizer().save_pretrained(base)
    assert "lm_head.weight" not in exported_tensors(base)
    return base


@pytest.mark.e2e
@pytest.mark.parametrize("lora, adapted", [
    ({"target_modules": ["embed_tokens", "q_proj"]}, "model.embed_tokens.weight"),
    ({"target_modules": ["q_proj", "lm_head"]}, "lm_head.weight"),
    ({"target_modules": ["q_proj"], "modules_to_save": ["embed_tokens"]}, "model.embed_tokens.weight"),
])
def test_merge_of_an_adapted_tied_embedding_is_the_trained_model(tied_base, tmp_path, lora, adapted):
    """Training changed only the side of the tie peft wrapped; the merged export writes both
    sides apart (the other the base's own), unties the config, and its logits are peft's
    unmerged base + adapter. --verify passes it, and fails what the merge wrote before: one
    tied tensor carrying the change into both sides (eval loss 19.27 exported, 4.82 trained)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from zerofit.export import verify

    config = lora_run_config(tmp_path / "run", {"path": str(tied_base)}, 2, r=4, alpha=8, **lora)
    run, _, _ = trained_run(tmp_path, config)
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    result = export(run, merged, dtype="fp32", verify=True, progress=False)
    assert result.verify["ok"] and result.verify["max_abs_diff"] == 0.0
    export(run, adapter, dtype="fp32", adapter_only=True, progress=False)
    assert not json.loads((merged / "config.json").read_text())["tie_word_embeddings"]
    tensors, base_weight = exported_tensors(merged), exported_tensors(tied_base)["model.embed_tokens.weight"]
    other = ({"model.embed_tokens.weight", "lm_head.weight"} - {adapted}).pop()
    assert torch.equal(tensors[other], base_weight) and not torch.equal(tensors[adapted], base_weight)

    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tied_base, dtype=torch.float32),
                                        adapter, autocast_adapter_dtype=False).eval()
    with torch.no_grad():
        got, want = model(IDS).logits, trained(IDS).logits
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())

    # what the merge wrote before: the adapted side as the one tied tensor, the config still tied
    old = tmp_path / "old-merge"
    shutil.copytree(merged, old)
    from safetensors.torch import save_file

    save_file({**{k: v for k, v in tensors.items() if k != "lm_head.weight"},
               "model.embed_tokens.weight": tensors[adapted]}, str(old / "model.safetensors"), metadata={"format": "pt"})
    (old / "config.json").write_text(json.dumps({**json.loads((merged / "config.json").read_text()),
                                                 "tie_word_embeddings": True}))
    with pytest.raises(verify.VerifyError, match="does not reproduce the checkpoint"):
        verify.verify_lora_export(old, step_of(run), run / "model")
