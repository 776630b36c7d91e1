"""Parameter counts (modelspec.py) and ZeRO model states (zerostates.py): by hand, against DeepSpeed's estimator."""
import os

import pytest
from conftest import TINY, cpu_box

from zerofit.config.load import validate
from zerofit.plan import estimate, states
from zerofit.plan import spec as modelspec
from zerofit.plan.estimate import Candidate, Shape


# ------------------------------------------------------------------ modelspec
def tiny_configs():
    from transformers import GPTNeoXConfig, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return {
        "llama": LlamaConfig(num_key_value_heads=2, **common),
        "qwen2": Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False, **common),
        "qwen2-tied": Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common),
        "mistral": MistralConfig(num_key_value_heads=2, **common),
        "gpt_neox": GPTNeoXConfig(**common),
    }


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2-tied", "mistral", "gpt_neox"])
def test_parameter_counts_equal_instantiated_numel(name):
    import torch
    from deepspeed.runtime.zero.stage3 import model_to_params
    from transformers import AutoModelForCausalLM

    hf_config = tiny_configs()[name]
    spec = modelspec.from_hf_config(hf_config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config)
    assert spec.total_params == sum(p.numel() for p in model.parameters())
    total, largest = model_to_params(model)  # DeepSpeed's own count (tied weights once)
    assert (spec.total_params, spec.largest_module.numel) == (total, largest)
    assert spec.tied_embeddings == (name == "qwen2-tied")
    assert spec.lm_head_params == (0 if name == "qwen2-tied" else 96 * 32 + (0 if name != "gpt_neox" else 0))
    assert spec.gated_mlp == (name != "gpt_neox")
    assert (spec.hidden_size, spec.num_layers, spec.vocab_size) == (32, 2, 96)
    assert spec.num_kv_heads == (4 if name == "gpt_neox" else 2)
    # the tied lm_head still fetches the embedding (ZeRO-3 gathers it for both modules)
    if name == "qwen2-tied":
        assert spec.modules[-1].name == "lm_head" and spec.modules[-1].params == ("model.embed_tokens.weight",)


def test_a_model_directory_named_like_a_preset_is_the_directory(tmp_path, monkeypatch):
    """`--model tiny` with a ./tiny model directory planned the preset's 90K parameters."""
    tiny_configs()["qwen2"].save_pretrained(tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    assert modelspec.from_name("tiny").model_type == "qwen2"
    assert modelspec.from_name("mini").model_type == "llama"  # no such directory: the preset


def test_presets_sizes():
    assert modelspec.from_name("tiny").total_params == TINY
    spec = modelspec.from_name("llama-1.5b")
    assert spec.total_params == 1_498_482_688
    assert spec.largest_module.name == "model.embed_tokens" and spec.largest_module.numel == 128256 * 2048
    assert spec.layer_params == 60_821_504


def test_every_presets_count_from_its_shape_is_its_built_models():
    """`zerofit plan --presets` counts parameters from the shapes (models.preset_params), with no
    model built: each count is the built model's."""
    from zerofit.models import PRESETS, config_from_name, preset_params

    for name in PRESETS:
        assert preset_params(name) == modelspec.from_hf_config(config_from_name(name)).total_params, name


# ------------------------------------------------------------ by hand: tiny model
def test_tiny_model_states_by_hand():
    """ZeRO-3, 1 rank, nothing offloaded, bf16: 2 + 2 + 4 + 8 bytes per parameter on the
    device, the reduce bucket, and the fp32 grad buffer of the largest sub group (the >=2-D
    weights: 90,432 less 5 norms x 64 = 90,112) until the first step."""
    spec = modelspec.from_name("tiny")
    gpu, host, nvme = states.model_states(spec, Shape(seq_len=64, micro_batch=4),
                                           Candidate(offload_optimizer="none", reduce_bucket_size=1000), on_gpu=True)
    assert gpu == {"params_16bit": 2 * TINY, "grads_16bit": 2 * TINY, "master_fp32": 4 * TINY,
                   "adam_moments_fp32": 8 * TINY, "reduce_bucket": 2000,
                   "fp32_grad_buffer_until_first_step": 4 * 90_112}
    assert host == {} and nvme == {}
    assert states.sub_groups(spec, 1, 100_000_000) == (90_112, 320)


def test_tiny_offload_pins_powers_of_two():
    """Optimizer on the CPU, pinned (torch's CachingHostAllocator rounds to 2^k): the bf16
    grad partitions 180,864 B -> 262,144; fp32 grads per sub group 360,448 -> 524,288 and
    1,280 -> 2,048. Master weights and moments are pageable."""
    spec = modelspec.from_name("tiny")
    gpu, host, _ = states.model_states(spec, Shape(seq_len=64, micro_batch=4), Candidate(reduce_bucket_size=1000),
                                        on_gpu=True)
    assert gpu == {"params_16bit": 2 * TINY, "reduce_bucket": 2000}
    assert host == {"grads_16bit_pinned": 262_144, "master_fp32": 4 * TINY, "adam_moments_fp32": 8 * TINY,
                    "fp32_grads_pinned": 524_288 + 2_048}
    _, unpinned, _ = states.model_states(spec, Shape(seq_len=64, micro_batch=4), Candidate(), on_gpu=False)
    assert unpinned["grads_16bit_pinned"] == 2 * TINY and unpinned["fp32_grads_pinned"] == 4 * TINY


# ------------------------------------------------------- against DeepSpeed's estimator
@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("offload_optimizer, offload_param", [("cpu", "cpu"), ("cpu", "none"), ("none", "none")])
def test_model_states_equal_deepspeed_estimate(gpus, offload_optimizer, offload_param):
    """estimate_zero3_model_states_mem_needs counts, per node: params 2 + fp32 master 4 +
    Adam 8 + fp32 grads 4 bytes (18 or 16 with params on the GPU), and on the GPU the 16-bit
    partition (offloaded optimizer) or all 18 bytes (nothing offloaded). The same things in
    our breakdown (no pinning rounding, additional_buffer_factor 1, sub_group_size >= N so
    the one fp32 grad buffer covers the model) must give the same bytes."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    spec = modelspec.from_name("tiny")
    cand = Candidate(offload_optimizer=offload_optimizer, offload_param=offload_param, pin_memory=False,
                     sub_group_size=10**9)
    gpu, host, _ = states.model_states(spec, Shape(seq_len=64, micro_batch=1, world_size=gpus), cand, on_gpu=True)
    ds_cpu, ds_gpu, largest = estimate_zero3_model_states_mem_needs(
        TINY, spec.largest_module.numel, num_gpus_per_node=gpus, cpu_offload=offload_optimizer == "cpu",
        cpu_offload_params=offload_param == "cpu", additional_buffer_factor=1)
    counted = ("params_16bit_pinned", "params_16bit", "master_fp32", "adam_moments_fp32", "fp32_grads_pinned",
               "fp32_grad_buffer_until_first_step")
    if offload_optimizer == "cpu":
        assert sum(host.get(k, 0) for k in counted) * gpus == ds_cpu
        assert gpu.get("params_16bit", 0) == ds_gpu - largest
    else:
        # sub groups are per param group: the fp32 buffer covers the 2-D weights; the norms' 320
        # elements form their own (smaller) sub group
        assert sum(gpu.get(k, 0) for k in counted) + 4 * 320 // gpus == ds_gpu - largest


def test_lora_plans_adapters_only_for_gradients_and_optimizer():
    """peft on the meta device: r x (in + out) per adapted projection; the frozen base keeps
    its 16-bit partitions, and only adapters get grads, master weights, moments, checkpoints.
    tiny, r 16: q 16*(64+64) + k,v 16*(64+32) + o 16*(64+64) + gate,up,down 16*(64+128) =
    16,384 per block, 32,768 for two."""
    pytest.importorskip("peft")
    cfg = validate({"model": {"config": "tiny"}, "train": {"max_steps": 1}, "lora": {"enabled": True, "r": 16}})
    spec = modelspec.from_config(cfg)
    assert spec.trainable_params == 32_768 and spec.total_params == TINY + 32_768
    assert spec.adapter_rank_per_layer == 7 * 16 and spec.adapter_dropout
    gpu, host, _ = states.model_states(spec, Shape(seq_len=64, micro_batch=1), Candidate(reduce_bucket_size=10),
                                           on_gpu=False)
    assert gpu["params_16bit"] == 2 * (TINY + 32_768)
    assert host["master_fp32"] == 4 * 32_768 and host["adam_moments_fp32"] == 8 * 32_768
    plan = estimate.predict(spec, cpu_box(), Shape(seq_len=64, micro_batch=1), Candidate())
    assert plan.checkpoint_bytes == estimate.checkpoint_bytes(32_768) and plan.trainable_params == 32_768
