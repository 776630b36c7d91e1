"""The step-time model: one optimizer step's work and its seconds (pure arithmetic).

`step_work` counts what a step has to do, whatever the device (FLOPs, PCIe bytes, optimizer
elements, ZeRO-3 hook visits, reduce flushes); `step_time_terms` turns it into seconds per term
at the rates in hardware.py (fitted by bench/cost_fit.py to the steps measured on the GPU
machine); `step_seconds` says which terms overlap; `step_time_notes`, what the terms say to
change. Sources, named where used: Kaplan et al. (arXiv:2001.08361) and PaLM (arXiv:2204.02311)
for the FLOPs, ZeRO-Infinity (arXiv:2104.07857) and DeepSpeed 0.19's stage3.py for the bytes
offloading moves, the ZeRO paper (arXiv:1910.02054) for the collectives.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from zerofit.machine import hardware as hw_rates
from zerofit.machine.hardware import Hardware, ranks_on_this_node
from zerofit.nvme.swaplayout import nvme_seconds
from zerofit.plan.spec import ModelSpec
from zerofit.plan.states import PARAM_MAX_IN_CPU, optimizer_groups, swap_layout
from zerofit.plan.trace import zero3_trace

if TYPE_CHECKING:
    from zerofit.plan.estimate import Candidate, Shape

# CPU accelerator (tests, the demo, CPU-only machines): the forward and backward run on the
# host's cores in the Python thread that also runs ZeRO-3's hooks, so nothing overlaps: a step
# is step_work's FLOPs at this rate plus the hooks at their per-visit cost (the GPU host's
# fitted rates fit here too) plus the optimizer. The rate is the one that fits steps of the
# tiny, demo and mini models on a 2-core CPU machine (CPU seconds per steady step, so other
# processes' load drops out; bench/results/README.md). Threads add nothing measurable at these
# sizes, so the rate is one process's, whatever its cores.
CPU_FLOPS_PER_S = 1.3e11


def step_work(spec: ModelSpec, shape: Shape, cand: Candidate) -> dict[str, float]:
    """What one optimizer step has to do, device-independent: the quantities the cost model
    and the roofline (bench/speed_record.py) turn into seconds with a rate.

    - flops: 6 x params x tokens (Kaplan et al. arXiv:2001.08361; forward 2, backward 4;
      4 + 2 x trainable/params with a frozen base) plus attention 12 x layers x hidden x seq
      per token (PaLM, arXiv:2204.02311 app. B), plus a forward with recompute;
    - pcie_param_bytes: offloaded 16-bit parameters copied to the GPU for forward, recompute
      and backward (ZeRO-Infinity, arXiv:2104.07857 sec. 5);
    - pcie_grad_bytes: 16-bit gradient partitions to the host each micro batch, a round trip
      when accumulating (stage3.py partition_grads: a CPU buffer is copied to the GPU, added
      to, copied back);
    - boundary_grad_bytes: fp32 gradients of the host-stepped elements at the accumulation
      boundary (_offload_grad_partition_at_boundary), once per step;
    - copy_back_bytes: the updated 16-bit parameters of the host-stepped sub-groups, copied
      to the GPU when the parameters live there (_reassign_or_swap_out_partitioned_parameters:
      converted on the host, then an unpinned copy; zerofit/machine/hostalloc.py); with parameters
      offloaded the copy stays on the host;
    - copy_out_bytes: with parameters offloaded, the fp32 masters of the sub-groups stepped on
      the GPU (a partial offload), copied into the host's 16-bit parameters (the same
      function; torch converts on the host, after a pageable copy of the fp32);
    - adam_host_params / adam_device_params: optimizer elements stepped on the CPU / GPU;
    - fetch_visits / idle_visits: ZeRO-3 module hook calls that fetch and release
      partitioned parameters, and those whose parameters are all persistent (nothing to fetch:
      partitioned_param_coordinator.py fetch_sub_module filters on ds_status);
    - reduce_flushes: gradient reduce buckets filled and flushed, each micro batch, for all
      trainable elements (stage 2 and 3: the bucket gathers whole gradients before the
      reduce-scatter partitions them; reduce_bucket_size elements each)."""
    a, W, T = shape.element_bytes, shape.world_size, shape.tokens_per_micro
    accum, ckpt = shape.grad_accum, shape.gradient_checkpointing
    N, trainable = spec.total_params, spec.trainable_params
    n_rank = -(-N // W) if cand.stage == 3 else N
    t_rank = -(-trainable // W) if cand.stage >= 2 else trainable
    passes = 3 if ckpt else 2
    # Forward 2N; backward computes input gradients through every weight (2N) but weight
    # gradients only for the trainable ones (2T): 6N for full fine-tuning, ~4N for LoRA.
    # Recompute adds a forward (2N): 4/3 for full fine-tuning.
    per_token = 4 * N + 2 * trainable + 12 * spec.num_layers * spec.hidden_size * shape.seq_len
    work = {"flops": accum * (per_token + (2 * N if ckpt else 0)) * T}
    groups = optimizer_groups(spec, shape, cand)
    n_device_groups = len(groups) if cand.offload_optimizer == "none" else int((1 - cand.offload_optimizer_ratio) * len(groups))
    work["adam_device_params"], work["adam_host_params"] = sum(groups[:n_device_groups]), sum(groups[n_device_groups:])
    work["pcie_param_bytes"] = accum * passes * a * n_rank if cand.offload_param != "none" else 0
    work["pcie_grad_bytes"] = 0
    if cand.offload_optimizer != "none":
        work["pcie_grad_bytes"] = a * t_rank * (accum + 2 * (accum - 1))
    work["boundary_grad_bytes"] = 4 * work["adam_host_params"]
    work["copy_back_bytes"] = a * work["adam_host_params"] if cand.offload_param == "none" else 0
    work["copy_out_bytes"] = 4 * work["adam_device_params"] if cand.offload_param != "none" else 0
    if cand.stage >= 2:
        work["reduce_flushes"] = accum * -(-trainable // cand.reduce_bucket_size)
    if cand.stage == 3:
        every = len(zero3_trace(spec, ckpt, -1)[0])
        fetching = len(zero3_trace(spec, ckpt, cand.param_persistence_threshold)[0])
        work["fetch_visits"], work["idle_visits"] = accum * fetching, accum * (every - fetching)
    return work


def step_time_terms(spec: ModelSpec, hw: Hardware, shape: Shape, cand: Candidate,
                    rates: hw_rates.StepRates = hw_rates.STEP_RATES, work: dict | None = None) -> dict[str, float]:
    """Seconds one optimizer step spends per term (step_seconds says which overlap), from
    step_work's quantities at the rates in zerofit/machine/hardware.py (`rates`: the fitted ones;
    `work`: step_work's result when the caller has it, as bench/cost_fit.py does for the
    thousands of rates it tries).

    - compute: the step's FLOPs at the calibrated matmul rate x utilisation; on the CPU
      accelerator cpu_compute, at CPU_FLOPS_PER_S, which nothing overlaps;
    - pcie_params / pcie_grads: parameter and 16-bit gradient bytes over pinned PCIe;
    - grad_boundary: the boundary's fp32 gradients into the host optimizer's buffer;
    - param_copy_back: the updated 16-bit parameters to the GPU at the rate measured for
      that copy (host conversion and an unpinned copy), with or without heap temporaries;
    - param_copy_out: the GPU-stepped fp32 masters to the host's 16-bit parameters, at the
      rate measured for that blocking pageable copy;
    - cpu_adam / device_adam: DeepSpeedCPUAdam at its measured rate (x (16 / cores)^0.5,
      hardware.CPU_ADAM_CORE_EXPONENT); a device Adam streams
      ~36 bytes per parameter (fp32 param, grad, moments read and written, 16-bit copy);
    - nvme: swapped optimizer sub groups (master, moments and gradients in, master, moments
      and gradients out, swaplayout.SwapLayout) and parameters, at the path's measured rates
      (the `zerofit doctor --system --nvme-path` sweep, cached) or the GPU machine's disk;
    - zero3_hooks: ZeRO-3's per-module work: fetch, wait and release per fetching visit,
      the hook bookkeeping alone per visit of a module whose parameters are persistent;
    - reduce_flushes: the fixed work of each gradient reduce-bucket flush;
    - collectives: all-gather of parameters per pass and reduce-scatter of gradients
      across W ranks (ZeRO paper sec. 7: 3 x the data-parallel volume for stage 3)."""
    a, W = shape.element_bytes, shape.world_size
    accum, passes = shape.grad_accum, 3 if shape.gradient_checkpointing else 2
    N = spec.total_params
    n_rank = -(-N // W) if cand.stage == 3 else N
    cores = max(1, hw.cpu_cores // ranks_on_this_node(hw, W))
    work = step_work(spec, shape, cand) if work is None else work
    if hw.on_gpu:
        terms = {"compute": work["flops"] / (hw_rates.BF16_MATMUL_FLOPS * rates.model_flops_utilisation)}
    else:  # a lane of its own: the hooks run in the same thread, after it (step_seconds adds it)
        terms = {"cpu_compute": work["flops"] / CPU_FLOPS_PER_S}
    offloaded, on_device = work["adam_host_params"], work["adam_device_params"]
    if hw.on_gpu:
        if work["pcie_param_bytes"]:
            terms["pcie_params"] = work["pcie_param_bytes"] / hw_rates.PCIE_BYTES_PER_S
        if work["pcie_grad_bytes"]:
            terms["pcie_grads"] = work["pcie_grad_bytes"] / hw_rates.PCIE_BYTES_PER_S
        if work["boundary_grad_bytes"]:
            terms["grad_boundary"] = work["boundary_grad_bytes"] / rates.boundary_grad_bytes_per_s
        if work["copy_back_bytes"]:
            terms["param_copy_back"] = work["copy_back_bytes"] / hw_rates.COPY_BACK_BYTES_PER_S[
                shape.heap_step_temporaries]
        if work["copy_out_bytes"]:
            terms["param_copy_out"] = work["copy_out_bytes"] / hw_rates.COPY_OUT_BYTES_PER_S
    if offloaded:
        terms["cpu_adam"] = offloaded * hw_rates.CPU_ADAM_SECONDS_PER_PARAM \
            * (hw_rates.CPU_ADAM_CORES / cores) ** hw_rates.CPU_ADAM_CORE_EXPONENT
    if on_device:
        terms["device_adam"] = on_device * 36 / (hw_rates.GPU_MEMORY_BYTES_PER_S if hw.on_gpu else 5e9 * cores)
    if cand.offload_optimizer == "nvme":
        terms["nvme"] = nvme_seconds(swap_layout(spec, shape, cand), *nvme_rates(hw))
    if cand.offload_param == "nvme" and n_rank > PARAM_MAX_IN_CPU:
        swapped = a * (n_rank - PARAM_MAX_IN_CPU)
        read_rate, write_rate = nvme_rates(hw)
        terms["nvme"] = terms.get("nvme", 0) + accum * passes * swapped / read_rate + swapped / write_rate
    if cand.stage == 3:
        terms["zero3_hooks"] = work["fetch_visits"] * rates.seconds_per_fetching_visit \
            + work["idle_visits"] * rates.seconds_per_idle_visit
    if work.get("reduce_flushes"):
        terms["reduce_flushes"] = work["reduce_flushes"] * rates.seconds_per_reduce_flush
    if W > 1:
        volume = a * N * (W - 1) / W
        gathers = passes if cand.stage == 3 else 0
        terms["collectives"] = accum * (gathers + 1) * volume / hw_rates.NVLINK_BYTES_PER_S
    return {k: round(v, 4) for k, v in terms.items()}


OVERLAPPED_TERMS = ("compute", "pcie_params", "zero3_hooks", "pcie_grads")
# paid once per optimizer step, after the backward, whatever its micro batches
OPTIMIZER_STEP_TERMS = ("grad_boundary", "param_copy_back", "param_copy_out", "cpu_adam", "device_adam")


def step_seconds(terms: dict[str, float]) -> float:
    """One step's seconds from its terms. Three lanes run side by side through forward and
    backward: the GPU computing; the Python thread running ZeRO-3's hooks and waiting for the
    parameters they fetch (DeepSpeed prefetches on its own stream); the 16-bit gradients
    leaving for the host on the reduction stream. So they take max(compute, pcie_params +
    zero3_hooks, pcie_grads); the rest (the boundary's fp32 gradients, the CPU optimizer step,
    the copy back, NVMe, collectives) adds up, as does the CPU accelerator's cpu_compute (its
    hooks run in the computing thread). The gradients are a lane of their own because steps
    of many micro batches run faster than compute and the gradient round trip in a row
    (bench/cost_fit.py compares the alternatives)."""
    overlapped = max(terms.get("compute", 0.0), terms.get("pcie_params", 0.0) + terms.get("zero3_hooks", 0.0),
                     terms.get("pcie_grads", 0.0))
    return round(overlapped + sum(v for k, v in terms.items() if k not in OVERLAPPED_TERMS), 4)


def nvme_rates(hw: Hardware) -> tuple[float, float]:
    """(read, write) bytes/s of the NVMe path: measured there when known, else the GPU machine's disk."""
    return (hw.nvme_read_bytes_per_s or hw_rates.DISK_READ_BYTES_PER_S,
            hw.nvme_write_bytes_per_s or hw_rates.DISK_WRITE_BYTES_PER_S)


def step_time_notes(terms: dict[str, float], seconds: float, on_gpu: bool) -> list[str]:
    """What the step's time says to change: an optimizer step that dominates, a slow copy-out."""
    notes = []
    optimizer_step = sum(terms.get(k, 0.0) for k in OPTIMIZER_STEP_TERMS)
    if on_gpu and optimizer_step > seconds / 3:
        # DeepSpeed 0.19.8 overlaps none of it here (bench/results/README.md)
        notes.append(f"{optimizer_step:.1f} s of the {seconds:.1f} s step is the optimizer's ("
                     + ", ".join(k for k in OPTIMIZER_STEP_TERMS if k in terms) + "), paid once per optimizer step "
                     "after the backward while the GPU waits: more sequences per step (train.global_batch_size) "
                     "amortise it")
    if terms.get("param_copy_out", 0.0) > seconds / 4:
        notes.append(f"{terms['param_copy_out']:.1f} s of the step copies the GPU-stepped optimizer sub-groups' fp32 "
                     "masters into the offloaded 16-bit parameters (a blocking pageable copy, "
                     "hardware.COPY_OUT_BYTES_PER_S): with the parameters offloaded, step the whole optimizer on the "
                     "CPU (zero.offload_optimizer: cpu, zero.offload_optimizer_ratio unset) or keep the parameters "
                     "on the GPU (zero.offload_param: none)")
    return notes
