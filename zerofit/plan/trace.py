"""ZeRO-3's fetch trace and the gathered-parameter timeline of one training step (pure
arithmetic): which modules fetch their partitioned parameters and in what order, how many
fetch calls DeepSpeed makes, which gradients each backward module produces, and how many
full (gathered) parameter elements are live on a rank at each point of the step.

It mirrors DeepSpeed 0.19's runtime/zero/partitioned_param_coordinator.py (fetch_sub_module,
_fetch_sub_module_impl, __params_to_release, _is_currently_on_nvme,
__prefetch_nvme_param_partitions), parameter_offload.py's module hooks (persistent parameters
never fetched), stage3.py __add_grad_to_ipg_bucket (the reduce bucket's first flush) and
offload_param.buffer_count's swap buffers (zerostates.PARAM_SWAP_BUFFERS); the orders were
read from bench/gathered_probe.py's runs and zerofit/plan/hookorder.py's hook events.
"""
from __future__ import annotations

import functools
from types import MappingProxyType
from typing import NamedTuple

from zerofit.plan.spec import ModelSpec
from zerofit.plan.states import PARAM_SWAP_BUFFERS


class Gathered(NamedTuple):
    """Gathered (full) parameter elements live on a rank at points of a training step."""
    forward: int       # most during the forward pass
    at_loss: int       # at the last forward module (lm_head): the loss and its backward
    after_head: int    # once lm_head's backward released it: when its gradient is reduced
    backward: int      # most during the backward pass
    at_end: int        # at the last backward module (the embedding)
    at_first_flush: int = 0  # when the backward's first gradients overflow the reduce bucket


# DeepSpeed's defaults for (stage3_max_live_parameters, stage3_max_reuse_distance), elements.
DEEPSPEED_LIVE_WINDOW = (1_000_000_000, 1_000_000_000)


def fetching_modules(spec: ModelSpec, persistence_threshold: int) -> list[bool]:
    """Per module, whether ZeRO-3 fetches it: not all of its parameters persistent."""
    numel = {p.name: p.numel for p in spec.params}
    return [any(numel[n] > persistence_threshold for n in m.params) for m in spec.modules]


def _backward_order(spec: ModelSpec, checkpointing: bool, fetched: list[bool]) -> list[tuple[int, bool]]:
    """(module index, a recompute) in backward: the modules after the blocks in reverse, each
    block in reverse, the modules before the blocks. A checkpointed block is recomputed in
    forward order once the backward of its last module that fetches (`fetched`: not all
    persistent) has fetched its parameters and unpacks the block's input."""
    layers: dict[int, list[int]] = {}
    for i, m in enumerate(spec.modules):
        if m.layer is not None:
            layers.setdefault(m.layer, []).append(i)
    last_block = max((i for ids in layers.values() for i in ids), default=-1)
    outside = [i for i, m in enumerate(spec.modules) if m.layer is None]
    head, tail = [i for i in outside if i < last_block], [i for i in outside if i > last_block]
    backward = [(i, False) for i in reversed(tail)]
    for layer in sorted(layers, reverse=True):
        ids = layers[layer]
        first = max((i for i in ids if fetched[i]), default=None)
        if checkpointing and first is not None:
            backward += [(first, False)] + [(i, True) for i in ids] + [(i, False) for i in reversed(ids) if i != first]
        else:
            backward += [(i, False) for i in reversed(ids)]
    return backward + [(i, False) for i in reversed(head)]


def trace_entries(spec: ModelSpec, checkpointing: bool, persistence_threshold: int) -> list[tuple[int, bool]]:
    """ZeRO-3's module trace of one step as (module index, a recompute): the modules that fetch
    (fetching_modules) in module order, then in the backward's (_backward_order)."""
    fetches = fetching_modules(spec, persistence_threshold)
    return [(i, False) for i in range(len(spec.modules)) if fetches[i]] + \
        [(i, recompute) for i, recompute in _backward_order(spec, checkpointing, fetches) if fetches[i]]


@functools.lru_cache(maxsize=64)
def zero3_trace(spec: ModelSpec, checkpointing: bool, persistence_threshold: int):
    """ZeRO-3's module trace of one step (trace_entries) as each entry's fetched parameters, how
    many entries the forward has, and every parameter's elements. Persistent parameters are
    never fetched. Kept per spec and settings (the planner asks twice for each of ~150
    candidates), so read-only: a tuple and a mapping proxy."""
    numel = {p.name: p.numel for p in spec.params}
    trace = tuple(tuple(n for n in spec.modules[i].params if numel[n] > persistence_threshold)
                  for i, _ in trace_entries(spec, checkpointing, persistence_threshold))
    return trace, sum(fetching_modules(spec, persistence_threshold)), MappingProxyType(numel)


def fetch_calls(spec: ModelSpec, checkpointing: bool, persistence_threshold: int) -> list[int]:
    """zero3_trace's entries as the fetch_sub_module calls DeepSpeed makes up to each: its own
    and those of the modules that fetch nothing since the one before. Every call prefetches,
    whatever it fetches itself (partitioned_param_coordinator._fetch_sub_module_impl). Counted
    from the model's own hook order (spec.hook_events) where it gives the trace's modules in
    the trace's order; else from the module tree: a module's own call, those of the modules
    without parameters before it (ModuleSize.hooked_before) and of the modules dropped as all
    persistent."""
    if spec.hook_events is not None:
        traced = [spec.modules[i].name for i, _ in trace_entries(spec, checkpointing, persistence_threshold)]
        fetching, calls, called, pending = set(traced), [], [], 0
        for kind, name in spec.hook_events:
            if kind == "recompute" and not checkpointing:
                continue
            pending += 1
            if name in fetching:
                calls.append(pending)
                called.append(name)
                pending = 0
        if called == traced:
            return calls
    fetches = fetching_modules(spec, persistence_threshold)
    order = list(range(len(spec.modules))) + [i for i, _ in _backward_order(spec, checkpointing, fetches)]
    calls, pending = [], 0
    for i in order:
        pending += 1 + spec.modules[i].hooked_before
        if fetches[i]:
            calls.append(pending)
            pending = 0
    return calls


def recompute_spans(spec: ModelSpec, checkpointing: bool, persistence_threshold: int) -> dict[int, int]:
    """For each checkpointed block, zero3_trace's entry of its first backward fetch (its last
    module) -> the entry of its recompute's last module. That module's backward runs only once
    the block is recomputed: its parameters stay gathered through the recompute, and its
    gradient comes after it."""
    recomputes = [recompute for _, recompute in trace_entries(spec, checkpointing, persistence_threshold)]
    spans = {}
    for k in range(len(recomputes) - 1):
        if not recomputes[k] and recomputes[k + 1]:
            last = k + 1
            while last + 1 < len(recomputes) and recomputes[last + 1]:
                last += 1
            spans[k] = last
    return spans


def backward_grads(spec: ModelSpec, checkpointing: bool, persistence_threshold: int) -> list[int]:
    """zero3_trace's entries as the trainable gradient elements each produces: a module's
    backward produces its own (persistent ones too), a forward or a block's recompute none; a
    block's last module at the end of its recompute (recompute_spans)."""
    trainable = {p.name: p.numel for p in spec.params if p.trainable}
    entries = trace_entries(spec, checkpointing, persistence_threshold)
    n_forward = sum(fetching_modules(spec, persistence_threshold))
    grads = [0 if k < n_forward or recompute else sum(trainable.get(n, 0) for n in spec.modules[i].params)
             for k, (i, recompute) in enumerate(entries)]
    for first, last in recompute_spans(spec, checkpointing, persistence_threshold).items():
        grads[last], grads[first] = grads[first], 0
    return grads


@functools.lru_cache(maxsize=64)
def gathered_numel(spec: ModelSpec, checkpointing: bool, prefetch: int, max_live: int,
                   reuse_distance: int, persistence_threshold: int, reduce_bucket: int = 0,
                   nvme: frozenset[str] = frozenset()) -> Gathered:
    """Gathered parameter elements at the moments of a step (gathered_timeline). The
    backward's gradients fill a bucket of `reduce_bucket` elements, reduced when the next
    would overflow it (stage3.__add_grad_to_ipg_bucket): at_first_flush is what is gathered
    then."""
    lives, after_release = gathered_timeline(spec, checkpointing, prefetch, max_live, reuse_distance,
                                             persistence_threshold, nvme)
    if not lives:
        return Gathered(0, 0, 0, 0, 0)
    n_forward = zero3_trace(spec, checkpointing, persistence_threshold)[1]
    flush = first_flush(backward_grads(spec, checkpointing, persistence_threshold), reduce_bucket)
    at_flush = lives[-1 if flush is None else flush]
    return Gathered(forward=max(lives[:n_forward]), at_loss=lives[n_forward - 1],
                    after_head=after_release[min(n_forward, len(lives) - 1)],
                    backward=max(lives[n_forward:] or [0]), at_end=lives[-1], at_first_flush=at_flush)


def gathered_timeline(spec: ModelSpec, checkpointing: bool, prefetch_bucket: int, max_live: int, reuse_distance: int,
                      persistence_threshold: int, nvme: frozenset[str] = frozenset()) -> tuple[list[int], list[int]]:
    """Replays partitioned_param_coordinator.py over zero3_trace: the elements gathered once
    each entry's module has fetched, and once it has released.

    A module fetches its parameters; each fetch call, those of modules without parameters too
    (fetch_calls), then prefetches from the parameter queue, which only moves forward: the next
    entries not gathered, up to min(prefetch_bucket_size, max_live_parameters - gathered)
    elements, at least one (so the prefetched window grows until max_live_parameters bounds
    it). Passing a
    gathered parameter's later use, the scan marks it: that parameter is not released before
    that use ("reuse skipped by prefetch", __params_to_release). On release a parameter whose
    next use is within max_reuse_distance elements is kept too.

    `nvme`: parameters whose partitions are on NVMe (nvme_resident). The scan stops at one not
    read into a swap buffer (_is_currently_on_nvme); after each scan the NVMe prefetch reads the
    queue's next ones into free buffers (offload_param.buffer_count), looking no further than
    twice the elements of the gathers in flight (__prefetch_nvme_param_partitions); a buffer is
    freed when its parameter is released."""
    trace, _, numel = zero3_trace(spec, checkpointing, persistence_threshold)
    sizes = [sum(numel[n] for n in params) for params in trace]
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    next_use: list[dict[str, int]] = [{} for _ in trace]
    last_seen: dict[str, int] = {}
    for t in range(len(trace) - 1, -1, -1):
        for n in trace[t]:
            if n in last_seen:
                next_use[t][n] = last_seen[n]
            last_seen[n] = t
    available: set[str] = set()
    in_flight: set[str] = set()       # prefetched, not yet waited for by their module's fetch
    in_buffers: set[str] = set()      # NVMe partitions read into a swap buffer
    fetched_for: dict[str, int] = {}  # __most_recent_step_id_param_fetched_for
    live, head, lives, after_release = 0, 0, [], []
    held_until = recompute_spans(spec, checkpointing, persistence_threshold)
    span_end = {t: last for first, last in held_until.items() for t in range(first + 1, last + 1)}
    frozen = {p.name for p in spec.params if not p.trainable}
    held_by_trigger: set[str] = set()  # a recompute's frozen parameters (update_recompute_parameters)

    def release(n: str) -> None:
        nonlocal live
        available.discard(n)
        in_buffers.discard(n)
        live -= numel[n]

    def prefetch() -> None:  # one fetch call's prefetch from the queue's head
        nonlocal live, head
        room, fetched = min(prefetch_bucket, max_live - live), 0
        while head < len(trace) and fetched < room:
            if any(n in nvme and n not in in_buffers for n in trace[head]):
                break
            ahead = [n for n in trace[head] if n not in available]
            available.update(ahead)
            in_flight.update(ahead)
            for n in trace[head]:
                fetched_for[n] = max(fetched_for.get(n, -1), head)
            fetched += sum(numel[n] for n in ahead)
            head += 1
        live += fetched
        if nvme:
            in_buffers.update(_nvme_prefetch(trace, head, numel, nvme, in_buffers, sum(numel[n] for n in in_flight)))

    for t, (params, calls) in enumerate(zip(trace, fetch_calls(spec, checkpointing, persistence_threshold))):
        for _ in range(calls - 1):  # the hooked modules before it that fetch nothing
            prefetch()
        in_buffers.update(n for n in params if n in nvme)  # read at once (_ensure_availability_of_partitioned_params)
        wanted = [n for n in params if n not in available]
        available.update(wanted)
        in_flight.difference_update(params)
        live += sum(numel[n] for n in wanted)
        for n in params:  # kept through its block's recompute when its backward waits for that
            fetched_for[n] = max(fetched_for.get(n, -1), held_until.get(t, t))
        head = max(head, t + 1)
        prefetch()
        lives.append(live)
        held_by_trigger.update(n for n in params if t in span_end and n in frozen)
        for n in params:
            nxt = next_use[t].get(n)
            if n not in held_by_trigger and fetched_for[n] <= t and \
                    (nxt is None or prefix[nxt] - prefix[t + 1] >= reuse_distance):
                release(n)
        if span_end.get(t) == t:  # the recompute is over: the backward module that ran it releases them
            for n in held_by_trigger & available:
                release(n)
            held_by_trigger.clear()
        after_release.append(live)
    return lives, after_release


def _nvme_prefetch(trace: list[tuple[str, ...]], head: int, numel: dict[str, int], nvme: frozenset[str],
                   in_buffers: set[str], in_flight: int) -> list[str]:
    """The NVMe partitions __prefetch_nvme_param_partitions reads from the queue's `head` on:
    into the free swap buffers, among the next twice `in_flight` elements."""
    considered, reading = 0, []
    free = PARAM_SWAP_BUFFERS - len(in_buffers)
    for params in trace[head:]:
        for n in params:
            if considered > 2 * in_flight or len(reading) >= free:
                return reading
            if n in nvme and n not in in_buffers and n not in reading:
                reading.append(n)
            considered += numel[n]
    return reading


def first_flush(grads: list[int], reduce_bucket: int) -> int | None:
    """The trace entry whose gradients first overflow a bucket of `reduce_bucket` elements
    holding those before it; None where the backward never fills it."""
    filled = 0
    for t, numel in enumerate(grads):
        if numel and filled and filled + numel > reduce_bucket:
            return t
        filled += numel
    return None
