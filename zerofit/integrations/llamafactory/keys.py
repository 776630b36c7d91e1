"""The keys a LLaMA-Factory training YAML may hold: what its argument dataclasses and HF's
(Seq2Seq)TrainingArguments declare. LLaMA-Factory stops on any other ("Some keys are not used by
the HfArgumentParser"), so a key outside these is a slip, not a setting (lfconfig.translate).

LLaMA-Factory's own: the fields of src/llamafactory/hparams/ model_args.py, finetuning_args.py,
training_args.py (hiyouga/LLaMA-Factory 00577a85), data_args.py (072bfe29), generating_args.py
(cd9847ff), evaluation_args.py (171b825b), and names earlier releases declared (image_resolution,
new_special_tokens, visual_inputs, system_message, train_mm_proj_only, ...) or that later ones
added (default_system, enable_thinking): a YAML of another release is not refused for them.
HF's: the installed transformers' fields, and those transformers 4.x declared that 5 dropped
(LLaMA-Factory 0.9 runs on transformers 4).
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

SOURCE_RELEASE = "0.9"

LLAMAFACTORY = frozenset("""
    adapter_folder adapter_name_or_path add_special_tokens add_tokens additional_target apollo_layerwise apollo_proj
    apollo_proj_type apollo_rank apollo_scale apollo_scale_front apollo_scale_type apollo_target
    apollo_update_interval audio_sampling_rate badam_mask_mode badam_mode badam_start_block badam_switch_interval
    badam_switch_mode badam_update_ratio badam_verbose batch_size block_diag_attn buffer_size cache_dir chunk_size
    compute_accuracy compute_dtype cpu_infer create_new_adapter crop_to_patches cutoff_len data_shared_file_system
    dataset dataset_dir default_system device_map disable_gradient_checkpointing disable_shuffling do_sample
    double_quantization download_mode dpo_label_smoothing early_stopping_steps enable_liger_kernel enable_thinking
    eval_dataset eval_num_beams eval_on_each_dataset export_device export_dir export_hub_model_id
    export_legacy_format export_quantization_bit export_quantization_dataset export_quantization_maxlen
    export_quantization_nsamples export_size finetuning_type flash_attn fp8 fp8_backend
    fp8_enable_fsdp_float8_all_gather freeze_extra_modules freeze_language_model freeze_multi_modal_projector
    freeze_trainable_layers freeze_trainable_modules freeze_vision_tower galore_layerwise galore_proj_type
    galore_rank galore_scale galore_target galore_update_interval hf_hub_token ignore_pad_token_for_loss
    image_do_pan_and_scan image_max_pixels image_min_pixels image_resolution include_effective_tokens_per_second
    infer_backend infer_dtype init_special_tokens interleave_probs kt_force_think kt_maxlen kt_mode kt_optimize_rule
    kt_use_cuda_graph kto_chosen_weight kto_rejected_weight lang ld_alpha length_penalty lora_alpha lora_dropout
    lora_rank lora_target loraplus_lr_embedding loraplus_lr_ratio low_cpu_mem_usage mask_history max_length
    max_new_tokens max_samples media_dir mix_strategy mixture_of_depths mode model_max_length model_name_or_path
    model_revision module_dropout moe_aux_loss_coef ms_hub_token n_shot neat_packing new_special_tokens
    new_special_tokens_config num_beams offload_folder oft_block_size oft_rank oft_target om_hub_token
    overwrite_cache overwrite_output_dir packing pissa_convert pissa_init pissa_iter placement_strategy plot_loss
    ppo_buffer_size ppo_epochs ppo_score_norm ppo_target ppo_whiten_rewards pref_bco_weight pref_beta pref_ftx
    pref_loss preprocessing_batch_size preprocessing_num_workers print_param_status pure_bf16 quantization_bit
    quantization_device_map quantization_method quantization_type ray_init_kwargs ray_num_workers ray_run_name
    ray_storage_filesystem ray_storage_path ref_model ref_model_adapters ref_model_quantization_bit
    repetition_penalty resize_vocab resources_per_worker reward_model reward_model_adapters
    reward_model_quantization_bit reward_model_type rope_scaling save_dir seed sglang_config sglang_lora_backend
    sglang_maxlen sglang_mem_fraction sglang_tp_size shift_attn simpo_gamma skip_special_tokens split_special_tokens
    stage streaming swanlab_api_key swanlab_lark_secret swanlab_lark_webhook_url swanlab_logdir swanlab_mode
    swanlab_project swanlab_run_name swanlab_workspace system_message task task_dir temperature template
    tokenized_path tool_format top_k top_p train_from_scratch train_mm_proj_only train_on_prompt trust_remote_code
    upcast_layernorm upcast_lmhead_output use_adam_mini use_apollo use_audio_in_video use_badam use_cache
    use_dft_loss use_dora use_fast_tokenizer use_galore use_kt use_kv_cache use_llama_pro use_mca use_muon
    use_reentrant_gc use_rslora use_swanlab use_unsloth use_unsloth_gc use_v1_kernels val_size video_fps
    video_max_pixels video_maxlen video_min_pixels visual_inputs vllm_config vllm_enforce_eager vllm_gpu_util
    vllm_max_lora_rank vllm_maxlen
""".split())

# transformers 4.x TrainingArguments / Seq2SeqTrainingArguments fields that transformers 5 no longer has
TRANSFORMERS_4_ONLY = frozenset("""
    adafactor dispatch_batches evaluation_strategy fp16_backend fp16_opt_level fsdp_min_num_params
    fsdp_transformer_layer_cls_to_wrap group_by_length half_precision_backend include_inputs_for_metrics
    include_tokens_per_second jit_mode_eval logging_dir mp_parameters no_cuda overwrite_output_dir past_index
    per_gpu_eval_batch_size per_gpu_train_batch_size push_to_hub_model_id push_to_hub_organization push_to_hub_token
    ray_scope save_safetensors split_batches torchdynamo tpu_metrics_debug tpu_num_cores use_ipex
    use_legacy_prediction_loop use_mps_device warmup_ratio
""".split())


@lru_cache(maxsize=1)
def theirs() -> frozenset[str]:
    """Every key LLaMA-Factory's parser reads, over the releases named above."""
    return LLAMAFACTORY | TRANSFORMERS_4_ONLY | trainer_fields()


# (file in the transformers package, class): where Seq2SeqTrainingArguments' fields are declared
TRAINER_CLASSES = (("training_args.py", "TrainingArguments"), ("training_args_seq2seq.py", "Seq2SeqTrainingArguments"))


def trainer_fields() -> frozenset[str]:
    """The installed transformers' Seq2SeqTrainingArguments fields, read from its source: importing
    the class imports torch and accelerate (several seconds of `config --from-llamafactory`). The
    import is the fallback where the source is not laid out so."""
    import ast
    import importlib.util
    from pathlib import Path

    package = importlib.util.find_spec("transformers")  # finds it without importing it
    fields: set[str] = set()
    try:
        root = Path(package.origin).parent
        for file, name in TRAINER_CLASSES:
            body = next(node.body for node in ast.parse((root / file).read_text(encoding="utf-8")).body
                        if isinstance(node, ast.ClassDef) and node.name == name)
            fields |= {node.target.id for node in body if isinstance(node, ast.AnnAssign)
                       and isinstance(node.target, ast.Name) and "ClassVar" not in ast.unparse(node.annotation)}
    except (AttributeError, OSError, SyntaxError, StopIteration):
        from transformers import Seq2SeqTrainingArguments

        return frozenset(f.name for f in dataclasses.fields(Seq2SeqTrainingArguments))
    return frozenset(fields)
