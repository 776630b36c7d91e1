"""The planner's replay of ZeRO-3's parameter coordinator (zerotrace.gathered_timeline)
against what DeepSpeed really keeps gathered: bench/gathered_probe.py wraps the
coordinator's fetch and release calls in a real `zerofit train` and records the parameter
elements gathered after each."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerofit.plan import hookorder, states, trace
from zerofit.plan import spec as modelspec
from zerofit.plan.activations import nvme_parameters
from zerofit.plan.estimate import Candidate, Shape

ROOT = Path(__file__).parents[1]


def as_events(record: dict) -> tuple[tuple[str, str], ...]:
    """The probe's fetch calls as hookorder's events: the coordinator's `forward` flag is set in
    a block's recompute too, which comes after the forward's lm_head."""
    step = record["steps"][-1]
    forward_end = max(i for i, e in enumerate(step) if e[0] == "fetch" and e[1] and e[2].endswith("lm_head"))
    return tuple(("backward" if not forward else "recompute" if i > forward_end else "forward", name)
                 for i, (kind, forward, name, _) in enumerate(step) if kind == "fetch")


def replayed(record: dict, events=None) -> tuple[modelspec.ModelSpec, Candidate, list[int], list[int]]:
    """The replay of the record's run: with DeepSpeed's own hook order where `events` is given
    (a GPU machine's transformers may order them otherwise than this one's), else hookorder's."""
    cand = Candidate(**record["replay"]["candidate"])
    spec = modelspec.from_name(record["model"])
    if events is not None:
        spec = dataclasses.replace(spec, hook_events=events)
    nvme = nvme_parameters(spec, Shape(seq_len=record["seq_len"], micro_batch=1), cand)
    lives, after_release = trace.gathered_timeline(
        spec, True, cand.prefetch_bucket_size, cand.max_live_parameters, cand.max_reuse_distance,
        cand.param_persistence_threshold, nvme)
    return spec, cand, lives, after_release


def fetches(record: dict, spec: modelspec.ModelSpec, cand: Candidate) -> list[list]:
    """The last step's fetches of modules that fetch (not all persistent), in order."""
    fetching = {m.name for m, fetches in zip(spec.modules, trace.fetching_modules(
        spec, cand.param_persistence_threshold)) if fetches}
    return [e for e in record["steps"][-1] if e[0] == "fetch" and e[2] in fetching]


@pytest.mark.e2e
def test_replay_follows_deepspeed_fetch_by_fetch_on_a_narrowed_window(tmp_path):
    """A real run on the CPU accelerator, the tiny preset with a live window of 20,000
    elements and a 5,000-element prefetch bucket: hookorder's run of the model gives the hook
    calls DeepSpeed makes, call by call, and after every one of the step's 46 fetches the replay
    has as many elements gathered as DeepSpeed, the recompute of each block included."""
    env = dict(os.environ, OUT=str(tmp_path), TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, str(ROOT / "bench" / "gathered_probe.py"), "--model", "tiny",
                    "--mode", "optimizer_param_cpu", "--seq-len", "64", "--steps", "3",
                    "--zero", "max_live_parameters=20000", "--zero", "prefetch_bucket_size=5000",
                    "--zero", "max_reuse_distance=0"], check=True, env=env, capture_output=True, timeout=600)
    record = json.loads(next(tmp_path.glob("gathered_probe-tiny-*.json")).read_text())
    spec, cand, lives, _ = replayed(record)
    assert (cand.max_live_parameters, cand.prefetch_bucket_size, cand.max_reuse_distance) == (20000, 5000, 0)
    assert spec.hook_events == as_events(record)  # 87 calls, parameterless modules' too
    measured = fetches(record, spec, cand)
    assert [e[2] for e in measured] == replay_names(spec, cand)
    assert [e[3] for e in measured] == lives
    assert max(lives) < sum(p.numel for p in spec.params)  # the window bounds it: not everything gathered


def replay_names(spec: modelspec.ModelSpec, cand: Candidate) -> list[str]:
    return [spec.modules[i].name for i, _ in trace.trace_entries(spec, True, cand.param_persistence_threshold)]


@pytest.mark.parametrize("name", ["llama-0.5b-optimizer_param_cpu", "llama-1.5b-optimizer_param_cpu",
                                  "tinyllama-1.1b-param_nvme"])
def test_replay_equals_deepspeed_after_every_fetch_on_the_gpu(name):
    """bench/results/gathered_probe-<name>-s512.json (one H200, DeepSpeed's coordinator wrapped
    in a real `zerofit train`): given DeepSpeed's hook order, the replay has DeepSpeed's gathered
    elements after each of the step's 340 (466) fetches, and after lm_head's release. llama-1.5b's
    forward window reaches max_live_parameters (every hooked module's call prefetches). tinyllama-
    1.1b's parameters are over offload_param.max_in_cpu: its last layer and lm_head stay on NVMe,
    the prefetch stops at each until a swap buffer reads it, and its plan was 5% under."""
    record = json.loads((ROOT / f"bench/results/gathered_probe-{name}-s512.json").read_text())
    spec, cand, lives, after_release = replayed(record, as_events(record))
    measured = fetches(record, spec, cand)
    assert [e[2] for e in measured] == replay_names(spec, cand)
    assert [e[3] for e in measured] == lives
    head = [t for t, e in enumerate(measured) if e[2] == "lm_head"]
    released = [e for e in record["steps"][-1] if e[0] == "release" and e[2] == "lm_head"][-1][3]
    assert released == after_release[head[1]]
    if name.startswith("llama-1.5b"):
        assert max(lives[:head[0] + 1]) >= cand.max_live_parameters
    if name.startswith("tinyllama"):
        assert sorted(record["replay"]["nvme"]) == sorted(nvme_parameters(spec, Shape(512, 1), cand))
        assert {n.split(".")[2] for n in record["replay"]["nvme"] if n.startswith("model.layers.")} == {"21"}


def test_nvme_residency_follows_the_optimizers_cpu_flat_buffers():
    """offload_param nvme keeps in host RAM the sub groups that fit max_in_cpu (1e9 elements),
    group by group (decay first), and leaves the rest, and a frozen base, on NVMe; partitions
    under max(1 MiB, aio.block_size) are never swapped."""
    small = modelspec.from_name("llama-0.5b")
    assert states.nvme_resident(small, 1, 100_000_000, 2**20, 2) == frozenset()  # all fit
    big = modelspec.from_name("tinyllama-1.1b")  # 1.1e9 elements in its decay group
    resident = states.nvme_resident(big, 1, 100_000_000, 2**20, 2)
    assert "lm_head.weight" in resident and "model.layers.21.mlp.down_proj.weight" in resident
    assert not any(n.startswith(("model.layers.19.", "model.embed_tokens")) for n in resident)
    held = sum(p.numel for p in big.params if p.trainable and p.ndim >= 2 and p.name not in resident)
    assert held <= states.PARAM_MAX_IN_CPU
    assert states.nvme_resident(big, 1, 100_000_000, 64 * 2**20, 2) == frozenset(
        n for n in resident if 2 * next(p.numel for p in big.params if p.name == n) >= 64 * 2**20)
    frozen = dataclasses.replace(small, params=tuple(dataclasses.replace(p, trainable=False) for p in small.params))
    assert states.nvme_resident(frozen, 1, 100_000_000, 2**20, 2) == frozenset(
        p.name for p in small.params if 2 * p.numel >= 2**20)


def test_hook_order_is_taken_from_a_narrowed_run_of_the_architecture():
    """The calls between two fetches come from the model's own execution order, not its module
    tree: Llama's rotary embedding runs before the first layer and has no backward, act_fn runs
    between gate_proj and up_proj, the norms before the projections they feed; each block's
    recompute runs in the backward. Where the run's fetch order is not the trace's (an
    architecture that registers its modules in another order than it runs them) or no run is
    possible, the calls are counted by the module tree."""
    spec = modelspec.from_name("llama-0.5b")
    forward = [name for kind, name in spec.hook_events if kind == "forward"]
    backward = [name for kind, name in spec.hook_events if kind == "backward"]
    recompute = [name for kind, name in spec.hook_events if kind == "recompute"]
    assert forward.index("model.rotary_emb") < forward.index("model.layers.0") and "model.rotary_emb" not in backward
    mlp = [n.rsplit(".", 1)[1] for n in forward if n.startswith("model.layers.3.mlp.")]
    assert mlp == ["gate_proj", "act_fn", "up_proj", "down_proj"]
    assert len(recompute) == 16 * len([n for n in forward if n.startswith("model.layers.3.")])
    tree = dataclasses.replace(spec, hook_events=None)
    assert sum(trace.fetch_calls(spec, True, 20480)) == len(spec.hook_events)
    assert trace.fetch_calls(tree, True, 20480) != trace.fetch_calls(spec, True, 20480)
    no_recompute = [kind for kind, _ in spec.hook_events if kind != "recompute"]
    assert sum(trace.fetch_calls(spec, False, 20480)) == len(no_recompute)

    from transformers import AutoConfig

    assert hookorder.hook_events(AutoConfig.for_model("llama", num_hidden_layers=2, hidden_act="no-such-act")) is None
    olmo2 = modelspec.from_hf_config(AutoConfig.for_model("olmo2", num_hidden_layers=2))  # norms after the projections
    assert olmo2.hook_events is not None
    assert trace.fetch_calls(olmo2, True, 0) == trace.fetch_calls(
        dataclasses.replace(olmo2, hook_events=None), True, 0)


def lora_spec(record: dict) -> modelspec.ModelSpec:
    """The peft model the record's run trained (the lora section's defaults), with DeepSpeed's
    hook order."""
    from conftest import bench_module

    from zerofit.config.load import validate

    planner_accuracy = bench_module("planner_accuracy")
    cell = planner_accuracy.Cell(record["model"], record["mode"], record["seq_len"], 8, lora=True)
    spec = modelspec.from_config(validate(planner_accuracy.run_config(cell, Path("/unused"), 2, "64GiB")))
    return dataclasses.replace(spec, hook_events=as_events(record))


def test_a_lora_base_gathered_in_a_recompute_is_released_when_the_recompute_ends():
    """bench/results/gathered_probe-llama-1.5b-optimizer_param_cpu-s512-lora.json (H200, LoRA r16
    on the 7 projections, the base frozen on the CPU): in a block's recompute DeepSpeed holds the
    frozen parameters it fetches for the backward module that set the recompute off
    (update_recompute_parameters) and releases them all at that module's release, whatever the
    reuse distance says; each frozen weight is fetched again for its own backward. Replayed so,
    every one of the step's 916 fetches is within 0.2% of DeepSpeed's gathered elements (as if
    trainable: 23% off). What is left is peft's lora_A weight, which DeepSpeed also lists as its
    parent's (read through the parent in the first step: an external parameter)."""
    pytest.importorskip("peft")
    record = json.loads((ROOT / "bench/results/gathered_probe-llama-1.5b-optimizer_param_cpu-s512-lora.json").read_text())
    spec = lora_spec(record)
    cand = Candidate(**record["replay"]["candidate"])

    def off_by(spec) -> float:
        measured = [e[3] for e in fetches(record, spec, cand)]
        lives, _ = trace.gathered_timeline(spec, True, cand.prefetch_bucket_size, cand.max_live_parameters,
                                                cand.max_reuse_distance, cand.param_persistence_threshold)
        assert len(lives) == len(measured) == 916
        return max(abs(replayed - seen) / seen for replayed, seen in zip(lives, measured))

    assert off_by(spec) < 0.002
    trainable = dataclasses.replace(spec, params=tuple(dataclasses.replace(p, trainable=True) for p in spec.params))
    assert off_by(trainable) > 0.2


@pytest.mark.e2e
def test_an_eval_leaves_no_parameter_gathered_for_the_next_forward(tmp_path):
    """A forward with no backward keeps what the training trace would reuse, and the next
    forward's reset_step counts none of it: on the H200 an eval and the training step after it
    gathered a live window on top (llama-3.6b LoRA, base on the CPU: 2.78 -> 4.48 GiB,
    bench/results/eval-leftovers-s29/). A real run on the CPU accelerator with an eval of 4
    batches after every step: each forward (eval batches and the next step) opens with nothing
    gathered."""
    pytest.importorskip("peft")
    env = dict(os.environ, OUT=str(tmp_path), TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, str(ROOT / "bench" / "gathered_probe.py"), "--model", "tiny", "--mode",
                    "optimizer_param_cpu", "--seq-len", "64", "--steps", "2", "--lora", "--eval"],
                   check=True, env=env, capture_output=True, timeout=600)
    record = json.loads(next(tmp_path.glob("gathered_probe-tiny-*-lora-eval.json")).read_text())
    forwards = record["steps"][1:]  # the first opens the run
    assert len(forwards) == 2 * 4 + 1  # step 1's eval batches, step 2, step 2's eval batches
    assert [f[0][:2] for f in forwards] == [["reset", True]] * len(forwards)
    assert [f[0][3] for f in forwards] == [0] * len(forwards)
    assert max(e[3] for f in forwards for e in f) > 0  # and they did gather
