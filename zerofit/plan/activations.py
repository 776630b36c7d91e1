"""Activation memory of a training step, per phase, as named components (pure arithmetic).

The counting method is Korthikanti et al. (arXiv:2205.05198, sec. 4.1): sum the tensors each
op keeps for backward; the tensors are those HF transformers' Llama-style blocks keep with
SDPA attention, and those its causal-LM loss materialises at vocab size.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from zerofit import loss
from zerofit.nvme.swaplayout import Aio, min_swap_bytes
from zerofit.plan.spec import ModelSpec
from zerofit.plan.states import nvme_resident, optimizer_step_device, partition_numel
from zerofit.plan.trace import Gathered, gathered_numel

if TYPE_CHECKING:
    from zerofit.plan.estimate import Candidate, Shape


def layer_activation_bytes_per_token(spec: ModelSpec, a: int, eager_seq_len: int = 0) -> int:
    """Bytes one decoder block saves for backward per token, without recompute; with
    `eager_seq_len`, under eager attention over sequences of that length.

    The method is Korthikanti et al. (arXiv:2205.05198, sec. 4.1: sum the tensors each op
    keeps for backward); the tensors are those of HF's Llama-style block with SDPA:
    - each RMSNorm computes in fp32 (LlamaRMSNorm): keeps the fp32 input (4h), the 16-bit
      normalised tensor its weight multiplies (a*h), and its output, which the next
      projections keep as their input (a*h);
    - attention keeps q and k after RoPE, v, the SDPA output (flash/efficient kernels keep
      no s x s matrix, only a fp32 logsumexp per head);
    - eager attention (eager_attention_forward) keeps q, k and v repeated to every query head
      (repeat_kv), its output, and per head s x s: softmax's fp32 output (softmax(dtype=float32)
      keeps it for its backward) and the 16-bit weights the value matmul keeps; dropout at p=0
      keeps no mask. tests/test_activations.py counts what a real block saves, both kernels;
    - the SwiGLU MLP keeps gate, up, silu(gate) and their product (4 x intermediate);
      a 2-matrix MLP keeps the fc1 output and the activation (2 x intermediate);
    - LoRA (peft): each adapter's lora_B keeps lora_A's output (rank wide), and with
      dropout each lora_A keeps its own dropped input and dropout keeps its mask (1 byte)."""
    h, i = spec.hidden_size, spec.intermediate_size
    norm = 4 * h + 2 * a * h
    if eager_seq_len:
        attention = a * 4 * spec.q_dim + (4 + a) * spec.num_heads * eager_seq_len
    else:
        attention = a * (2 * spec.q_dim + 2 * spec.kv_dim) + 4 * spec.num_heads
    mlp = a * (4 * i if spec.gated_mlp else 2 * i)
    adapters = a * spec.adapter_rank_per_layer + (a + 1) * spec.adapter_inputs_per_layer * spec.adapter_dropout
    return 2 * norm + attention + mlp + adapters


def layer_backward_working_per_token(spec: ModelSpec, a: int, eager_seq_len: int = 0) -> int:
    """Gradients alive inside one block's backward: at the MLP, grad of the product, of
    silu and of up (3 x intermediate) plus the incoming and outgoing hidden gradients; under
    eager attention the larger is at the softmax: per head s x s, the 16-bit weights' gradient,
    its fp32 copy and softmax's fp32 input gradient (read in eager_attention_forward)."""
    i = spec.intermediate_size
    mlp = a * ((3 if spec.gated_mlp else 2) * i + 2 * spec.hidden_size)
    return max(mlp, (a + 8) * spec.num_heads * eager_seq_len + 2 * a * spec.hidden_size)


def attention_scores_per_token(spec: ModelSpec, a: int, eager_seq_len: int) -> int:
    """Forward working set of eager attention beyond what it saves, per token: per head s x s,
    the 16-bit masked scores and softmax's fp32 copy of them (SDPA's kernels: none)."""
    return (a + 4) * spec.num_heads * eager_seq_len


def loss_bytes(spec: ModelSpec, a: int, tokens: int, chunked: bool, backward: bool) -> int:
    """Logits at vocab size and the loss for `tokens` tokens.

    HF's ForCausalLMLoss upcasts the 16-bit logits to fp32 (logits.float()), and
    cross_entropy keeps its fp32 log_softmax for backward. Forward peak: 16-bit logits + fp32
    copy + log_softmax; the backward of log_softmax holds its saved output, the incoming and
    the outgoing fp32 gradient (3 x 4 bytes). zerofit.loss (chunked) holds the 16-bit logits
    and a fixed fp32 working set in both, writing the gradient over the logits."""
    V = spec.vocab_size
    if chunked:
        return tokens * a * V + loss.working_bytes(V, tokens)
    if backward:
        return tokens * 12 * V
    return tokens * (a * V + (4 * V if a != 4 else 0) + 4 * V)


NORM_BUFFER_NUMEL = 250_000_000  # stage3._constant_buffered_norm2's buffer_size


def reduce_transient_bytes(numel: int, cand: Candidate, shape: Shape, several: bool, fp64_norm: bool = False) -> int:
    """GPU bytes in flight while ZeRO-3 reduces `numel` gradient elements (stage3.py):
    reduce_scatter_coalesced concatenates several tensors into one buffer
    (comm/coalesced_collectives.py); with the optimizer offloaded `partition_grads` copies
    the pinned partition back to the GPU (.to(device)) and, at the accumulation boundary,
    `_offload_grad_partition_at_boundary` takes its norm through fp64 copies of up to 250M
    elements (_constant_buffered_norm2, get_norm_dtype: fp64 where the device has it), then
    converts it to fp32 before the copy to the host: the larger of the two is the peak.
    fp64_norm counts the norm's copies, held at the moment of the peak only where the reduced
    tensor is large on its own: lm_head's gradient (the allocator's trace found them live at
    the peak) and the embedding's at the end of backward. A block's bucket takes its
    parameters' norms one at a time, each copy a block parameter's size: left out there."""
    a, W = shape.element_bytes, shape.world_size
    part = partition_numel(numel, W)
    total = a * numel if several else 0
    if cand.offload_optimizer != "none":
        total += a * part + max(8 * min(part, NORM_BUFFER_NUMEL) if fp64_norm else 0, 4 * part)
    return total


# -------------------------------------------------------------------- the phases
def trainable_outside_and_in_blocks(spec: ModelSpec) -> tuple[int, int, int]:
    """Trainable elements after the blocks (lm_head), before them (embedding), and of the
    largest trainable module inside a block."""
    trainable = {p.name for p in spec.params if p.trainable}
    numel = {p.name: p.numel for p in spec.params}
    blocks = [i for i, m in enumerate(spec.modules) if m.layer is not None]
    first, last = (min(blocks), max(blocks)) if blocks else (len(spec.modules), -1)
    sizes = [sum(numel[n] for n in m.params if n in trainable) for m in spec.modules]
    after = sum(size for i, size in enumerate(sizes) if i > last and spec.modules[i].layer is None)
    before = sum(size for i, size in enumerate(sizes) if i < first and spec.modules[i].layer is None)
    inside = max((sizes[i] for i in blocks), default=0)
    return after, before, inside


def trainable_block_numel(spec: ModelSpec) -> int | None:
    """The most trainable elements of one block (a LoRA block's adapters only); None when the
    model's blocks are not found."""
    trainable = {p.name: p.numel for p in spec.params if p.trainable}
    per_block: dict[int, int] = {}
    for m in spec.modules:
        if m.layer is not None:
            per_block[m.layer] = per_block.get(m.layer, 0) + sum(trainable.get(n, 0) for n in m.params)
    return max(per_block.values()) if per_block else None


def nvme_parameters(spec: ModelSpec, shape: Shape, cand: Candidate) -> frozenset[str]:
    """The parameters the coordinator reads from NVMe for each use (zerostates.nvme_resident);
    none unless offload_param is nvme. A model whose parameters all fit max_in_cpu behaves as
    on the CPU."""
    if cand.offload_param != "nvme":
        return frozenset()
    return nvme_resident(spec, shape.world_size, cand.sub_group_size,
                         min_swap_bytes(Aio(block_size=cand.aio_block_size)), shape.element_bytes)


def lm_head_reduce_moment(spec: ModelSpec, shape: Shape, cand: Candidate, head_numel: int, saved_at_head: int,
                          mask: int, gathered: Gathered) -> dict[str, int]:
    """Device bytes while lm_head's gradient is reduced (its partition's fp64 norm the largest).

    The gradient waits in the reduce bucket until the next one overflows it
    (stage3.__add_grad_to_ipg_bucket). One that fills the bucket alone goes at the final
    norm's gradient, before any block's backward: the logits' gradient and the gathered weight
    are gone by then (what the allocator's trace found live at that peak). A smaller one
    shares the bucket with block gradients and goes at a parameter's gradient inside a block's
    backward, that block's recompute and the MLP's gradients alive, the bucket's whole fill in
    reduce_scatter_coalesced's buffer (as the allocator's trace found it under SDPA and eager
    attention)."""
    a, T = shape.element_bytes, shape.tokens_per_micro
    head_reduce = reduce_transient_bytes(head_numel, cand, shape, several=False, fp64_norm=True)
    if head_numel >= cand.reduce_bucket_size:
        return {"activations_saved": saved_at_head, "attention_mask": mask, "param_grad": a * head_numel,
                "grad_reduce": head_reduce, "gathered_params": gathered.after_head}
    eager_seq = shape.seq_len if shape.eager_attention else 0
    _, _, block_module = trainable_outside_and_in_blocks(spec)
    # With the optimizer on NVMe each gradient partition's fp32 copy waits for its sub group's
    # swap-out (stage3._offload_grad_partition_at_boundary: offload_fp32_gradients), and lm_head,
    # the model's last parameter, is taken last: the bucket's other gradients are alive in fp32 at
    # its norm.
    waiting_fp32 = (4 * partition_numel(cand.reduce_bucket_size - head_numel, shape.world_size)
                    if cand.offload_optimizer == "nvme" else 0)
    return {"activations_saved": saved_at_head, "attention_mask": mask,
            "block_recompute": T * layer_activation_bytes_per_token(spec, a, eager_seq) if shape.gradient_checkpointing else 0,
            "block_grads": T * layer_backward_working_per_token(spec, a),
            "param_grad": a * block_module,
            "grad_reduce": a * cand.reduce_bucket_size + head_reduce + waiting_fp32,
            "gathered_params": gathered.at_first_flush}


BACKWARD_MOMENTS = {  # device_phases' backward sub-phases, as a note names them
    "loss": "the loss's backward", "lm_head": "lm_head's backward",
    "lm_head_reduce": "the reduce of lm_head's gradient", "last_block": "the last block's backward",
    "embedding": "the reduce of the embedding's gradient"}


def device_phases(spec: ModelSpec, shape: Shape, cand: Candidate, on_gpu: bool) -> dict[str, dict[str, int]]:
    """Transient device bytes per phase as named components, on top of the resident
    states. The backward entry is its largest sub-phase, named in `backward_peak_at`."""
    a, T, W = shape.element_bytes, shape.tokens_per_micro, shape.world_size
    h, V, L = spec.hidden_size, spec.vocab_size, spec.num_layers
    ckpt = shape.gradient_checkpointing
    eager_seq = shape.seq_len if shape.eager_attention else 0
    layer_full = layer_activation_bytes_per_token(spec, a, eager_seq)
    # data.neat_packing: the model's forward builds one block-diagonal mask, micro x 1 x s x s (bool
    # for SDPA, the compute dtype's 0 / min for eager: masking_utils.sdpa_mask / eager_mask); every
    # block's attention holds it, through the last block's backward.
    mask = T * shape.seq_len * (a if shape.eager_attention else 1) if shape.packed_mask else 0
    # Saved for backward: with checkpointing only each block's input (HF's non-reentrant
    # checkpoint per decoder layer), else every block's tensors; the rotary cos/sin are
    # shared by all blocks; the final norm keeps its own (see layer_activation_bytes_per_token).
    blocks_saved = T * ((a * h if ckpt else layer_full) * L + 2 * a * spec.head_dim)
    final_norm = T * (4 * h + 2 * a * h)
    gathered = Gathered(0, 0, 0, 0, 0)
    if cand.stage == 3 and (cand.offload_param != "none" or W > 1):
        # Offloaded partitions are copied to the GPU one parameter at a time
        # (_no_gather_coalesced); with W > 1 the all-gather fills new flat buffers.
        gathered = Gathered(*(a * n for n in gathered_numel(
            spec, ckpt, cand.prefetch_bucket_size, cand.max_live_parameters, cand.max_reuse_distance,
            cand.param_persistence_threshold, cand.reduce_bucket_size, nvme_parameters(spec, shape, cand))))
    # Weight gradients exist only for trainable parameters (a LoRA base has none).
    head_numel, embedding_numel, block_module = trainable_outside_and_in_blocks(spec)
    # The last block's reduce holds at most its own gradients: a LoRA block's are a few
    # adapters, flushed once the bucket fills, blocks later (the first_flush moment).
    in_block = trainable_block_numel(spec)
    bucket = cand.reduce_bucket_size if in_block is None else min(cand.reduce_bucket_size, in_block)

    # The forward peaks at the loss, with what lm_head's fetch left gathered, or inside a block,
    # with the most gathered there (under eager attention its scores too; they are gone before
    # the logits exist). The two need not be one moment: a LoRA base, frozen, is gathered up to
    # the live window well before lm_head (summing them over-predicts).
    forward = max(({"activations_saved": blocks_saved + final_norm, "attention_mask": mask,
                    "logits_and_loss": loss_bytes(spec, a, T, shape.chunked_loss, backward=False),
                    "gathered_params": gathered.at_loss},
                   {"activations_saved": blocks_saved, "attention_mask": mask,
                    "attention_scores": T * attention_scores_per_token(spec, a, eager_seq),
                    "gathered_params": gathered.forward}), key=lambda comps: sum(comps.values()))
    backward_options = {
        "loss": {"activations_saved": blocks_saved + final_norm, "attention_mask": mask,
                 "logits_grad": loss_bytes(spec, a, T, shape.chunked_loss, backward=True), "gathered_params": gathered.at_loss},
        # lm_head's backward: its weight's gradient is computed from the logits' gradient...
        "lm_head": {"activations_saved": blocks_saved + final_norm, "attention_mask": mask, "logits_grad": T * a * V,
                    "param_grad": a * head_numel, "gathered_params": gathered.at_loss},
        "lm_head_reduce": lm_head_reduce_moment(spec, shape, cand, head_numel, blocks_saved + final_norm, mask,
                                                gathered),
        "last_block": {"activations_saved": blocks_saved, "attention_mask": mask,
                       "block_recompute": T * layer_full if ckpt else 0,
                       "block_grads": T * layer_backward_working_per_token(spec, a, eager_seq),
                       "param_grad": a * block_module,
                       "grad_reduce": reduce_transient_bytes(bucket, cand, shape, several=True),
                       "gathered_params": gathered.backward},
        "embedding": {"param_grad": a * embedding_numel,
                      "grad_reduce": reduce_transient_bytes(embedding_numel, cand, shape, several=False, fp64_norm=True),
                      "gathered_params": gathered.at_end},
    }
    at, backward = max(backward_options.items(), key=lambda kv: sum(kv[1].values()))
    # Evaluation runs forward under no_grad: nothing is saved, one block's tensors at a time;
    # its two moments are the forward's.
    evaluation = max(({"logits_and_loss": loss_bytes(spec, a, T, shape.chunked_loss, backward=False),
                       "attention_mask": mask, "gathered_params": gathered.at_loss},
                      {"block_working": T * layer_full, "attention_mask": mask,
                       "attention_scores": T * attention_scores_per_token(spec, a, eager_seq),
                       "gathered_params": gathered.forward}), key=lambda comps: sum(comps.values()))
    phases = {"forward": forward, "backward": backward,
              "optimizer_step": optimizer_step_device(spec, shape, cand, on_gpu), "eval": evaluation}
    return {name: {k: v for k, v in comps.items() if v} for name, comps in phases.items()} | {"backward_peak_at": at}
