"""Decoder layers kept in host memory and streamed to the GPU ahead of the compute.

A layer that does not fit the GPU budget keeps its weights in one pinned host buffer. Two
GPU buffers ("slots") take turns: the copy of a layer into a slot is issued, on a side
stream, as soon as the layer that last used that slot has run, so the copy of layer i+1 (and
i+2) overlaps the compute of layer i and the link never waits for Python. One DMA per layer
from pinned memory runs at the link's rate; pageable copies (accelerate's offload hooks) are
several times slower and wait for the compute. A layer's parameters point at its slot only
while it runs, at its host buffer otherwise.

The alternative the issue asks to weigh, running those layers on the CPU, is measured by
`cpu_or_stream` and taken where the CPU is faster (`CpuLayers`).

Without a GPU the same code runs with synchronous copies, which is how the tests run it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

ALIGN = 256  # bytes: every tensor in a packed buffer starts aligned for vectorised kernels


# ------------------------------------------------------------------------- planning
def decoder_layers_name(model) -> str | None:
    """The name of the ModuleList holding the decoder layers (the model's no-split blocks),
    e.g. "model.layers"; None for a model without one."""
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    best = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and \
                all(type(m).__name__ in blocks for m in module):
            best = name if best is None or len(module) > len(model.get_submodule(best)) else best
    return best


def embedding_on_host(model) -> bool:
    """Whether the input embedding can live in host RAM: an embedding not tied to the output
    head (a tied table is read in full by the head every step)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    return embedding is not None and getattr(embedding, "weight", None) is not None and \
        (head is None or head.weight is not embedding.weight)


def fixed_bytes(total: int, layer_bytes: list[int]) -> int:
    """What streaming needs on the GPU whatever the split: all but the layers, and two layer buffers."""
    return total - sum(layer_bytes) + 2 * max(layer_bytes, default=0)


def plan_stream(total: int, layer_bytes: list[int], room: int) -> tuple[int, int] | None:
    """(layers kept on the GPU, bytes of stream buffers) for `room` bytes of weights: all of
    them when they fit, else the first layers that fit beside two buffers of the largest
    layer (the rest are streamed through those); None when not even that fits."""
    if total <= room:
        return len(layer_bytes), 0
    if not layer_bytes or fixed_bytes(total, layer_bytes) > room:
        return None
    slots = 2 * max(layer_bytes)
    free, resident = room - fixed_bytes(total, layer_bytes), 0
    while resident < len(layer_bytes) and layer_bytes[resident] <= free:
        free -= layer_bytes[resident]
        resident += 1
    return resident, slots


def move_except(model: torch.nn.Module, kept: list[torch.nn.Module], device: torch.device) -> None:
    """Every parameter and buffer of `model` to `device` but those of the `kept` layers."""
    skip = {id(m) for layer in kept for m in layer.modules()}
    for module in model.modules():
        if id(module) in skip:
            continue
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is not None and tensor.device != device:
                    if isinstance(tensor, torch.nn.Parameter):
                        tensor.data = tensor.data.to(device)
                    else:
                        store[name] = tensor.to(device)


class HostEmbedding(torch.nn.Module):
    """The input embedding kept in host RAM: a decode step looks up a few rows, which the CPU
    does in microseconds, where holding the table costs the GPU a gigabyte (llama-8b) that
    layers use better. The table is hidden from .parameters() so `model.device` stays the GPU."""

    def __init__(self, embedding: torch.nn.Module, device: torch.device | str):
        super().__init__()
        self.host = [embedding]  # a list, not a submodule: .to() and .parameters() pass it by
        self.device = torch.device(device)

    @property
    def weight(self):
        return self.host[0].weight

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for *_, t in layer_tensors(self.host[0]))

    def forward(self, input_ids):
        return self.host[0](input_ids.to("cpu")).to(self.device, non_blocking=True)


# ------------------------------------------------------------------------ streaming
@dataclass
class Packed:
    """One layer's tensors as views into one flat byte buffer: (owner module, attribute name, is
    a parameter, byte offset, dtype, shape)."""
    host: torch.Tensor
    entries: list[tuple[torch.nn.Module, str, bool, int, torch.dtype, torch.Size]]

    @property
    def nbytes(self) -> int:
        return self.host.numel()

    def point_at(self, buffer: torch.Tensor) -> None:
        """Make the layer's parameters and buffers views into `buffer` (host or a GPU slot)."""
        for module, name, is_param, offset, dtype, shape in self.entries:
            size = shape.numel() * dtype.itemsize
            view = buffer[offset:offset + size].view(dtype).view(shape)
            if is_param:
                module._parameters[name].data = view
            else:
                module._buffers[name] = view


def layer_tensors(layer: torch.nn.Module):
    """(owner, name, is_param, tensor) of every parameter and buffer of `layer`, once each."""
    seen = set()
    for module in layer.modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in store.items():
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                yield module, name, is_param, tensor


def pack(layer: torch.nn.Module, pin: bool) -> Packed:
    """Copy `layer`'s tensors into one (pinned) host buffer and point the layer at it."""
    entries, offset = [], 0
    tensors = list(layer_tensors(layer))
    for module, name, is_param, tensor in tensors:
        entries.append((module, name, is_param, offset, tensor.dtype, tensor.shape))
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    host = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
    for (module, name, is_param, tensor), (_, _, _, start, dtype, shape) in zip(tensors, entries):
        host[start:start + tensor.numel() * tensor.element_size()].view(dtype).view(shape).copy_(tensor)
    packed = Packed(host, entries)
    packed.point_at(host)
    return packed


class LayerStream:
    """Streams `layers` (run in this order, every forward) through `slots` device buffers.

    Copy k (k counts every layer copy issued) fills slot k % slots with layer k % N, after the
    compute that used that slot before (copy k - slots) has finished; the forward pre-hook of
    that layer makes the compute wait for copy k. A forward that leaves the order (an error
    mid-way) is caught at the next layer and the ring restarts there."""

    def __init__(self, layers: list[torch.nn.Module], device: torch.device | str, slots: int = 2):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.layers = layers
        self.packed = [pack(layer, pin=self.cuda) for layer in layers]
        self.slots = [torch.empty(max(p.nbytes for p in self.packed), dtype=torch.uint8, device=self.device)
                      for _ in range(min(slots, len(layers)))]
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.copied: list = [None] * len(self.slots)  # event per slot: its copy has landed
        self.consumed = 0                             # layer forwards run so far (all layers, all forwards)
        self.index = {id(layer): i for i, layer in enumerate(layers)}
        self.handles = []
        self.attach()

    def attach(self) -> None:
        for layer in self.layers:
            self.handles.append(layer.register_forward_pre_hook(self.before))
            self.handles.append(layer.register_forward_hook(self.after))
        self.restart(0)

    @property
    def slot_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    @property
    def host_bytes(self) -> int:
        return sum(p.nbytes for p in self.packed)

    def issue(self, k: int, after=None) -> None:
        """Copy k: layer k % N into slot k % slots, once `after` (the slot's last compute) is done."""
        packed, s = self.packed[k % len(self.layers)], k % len(self.slots)
        target = self.slots[s][:packed.nbytes]
        if not self.cuda:
            target.copy_(packed.host)
            return
        with torch.cuda.stream(self.copy_stream):
            if after is not None:
                self.copy_stream.wait_event(after)
            target.copy_(packed.host, non_blocking=True)
            self.copied[s] = torch.cuda.Event()
            self.copied[s].record(self.copy_stream)

    def restart(self, k: int) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.consumed = k
        for j in range(k, k + len(self.slots)):
            self.issue(j)

    def before(self, layer, args):
        i = self.index[id(layer)]
        if self.consumed % len(self.layers) != i:  # the last forward stopped part-way
            self.restart(i)
        s = self.consumed % len(self.slots)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[s])
        self.packed[i].point_at(self.slots[s])

    def after(self, layer, args, output):
        i = self.index[id(layer)]
        self.packed[i].point_at(self.packed[i].host)
        done = None
        if self.cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        self.issue(self.consumed + len(self.slots), after=done)
        self.consumed += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def to_device(value, device):
    """Tensors in `value` (nested tuples, lists, dicts) moved to `device`; the rest as is."""
    if isinstance(value, torch.Tensor):  # to the CPU blocking: the CPU reads it next
        return value.to(device, non_blocking=torch.device(device).type != "cpu")
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


class CpuLayers:
    """Runs `layers` on the CPU: their inputs go to the CPU and their outputs back to `device`
    (the activations of one step are kilobytes; the weights never cross the link)."""

    def __init__(self, layers: list[torch.nn.Module], device: torch.device | str):
        self.device = torch.device(device)
        self.layers = layers
        self.handles = []
        self.attach()

    def attach(self) -> None:
        for layer in self.layers:
            self.handles.append(layer.register_forward_pre_hook(self.before, with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self.after))

    @property
    def slot_bytes(self) -> int:
        return 0

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for *_, t in layer_tensors(layer))

    def before(self, layer, args, kwargs):
        return to_device(args, "cpu"), to_device(kwargs, "cpu")

    def after(self, layer, args, output):
        return to_device(output, self.device)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def decode_step_seconds(model, device, batch: int) -> float:
    """Seconds of one greedy decode step of `model` at `batch` (8-token prompts): generate 5
    tokens less generate 1, over 4 (the prefill cancels out)."""
    ids = torch.ones(batch, 8, dtype=torch.long, device=device)

    def timed(new: int) -> float:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, disable_compile=True, pad_token_id=0,
                           temperature=None, top_p=None, top_k=None)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    timed(1)  # first use: kernels, threads
    return max(timed(5) - timed(1), 0.0) / 4


def cpu_or_stream(model, layers: list[torch.nn.Module], device, batches=(1, 8)):
    """Stream `layers` or run them on the CPU, whichever decodes faster measured on `model`
    at each of `batches` (the CPU only where it wins at all of them). (the chosen LayerStream
    or CpuLayers, {mode: {batch: seconds per step}})."""
    stream = LayerStream(layers, device)
    seconds = {"stream": {b: decode_step_seconds(model, device, b) for b in batches}}
    stream.remove()
    on_cpu = CpuLayers(layers, device)
    seconds["cpu"] = {b: decode_step_seconds(model, device, b) for b in batches}
    if all(seconds["cpu"][b] < seconds["stream"][b] for b in batches):
        if stream.cuda:
            torch.cuda.synchronize(stream.device)  # copies still landing in the slots
        stream.slots.clear()  # their GPU memory goes back to the allocator
        return on_cpu, seconds
    on_cpu.remove()
    stream.attach()
    return stream, seconds
