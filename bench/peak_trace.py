"""What is live on the GPU at the allocation peak of a run: PyTorch's allocator trace, replayed.

Used by planner_accuracy.py --trace-peak, where a cell's measured peak and the planner's
prediction disagree and the per-phase memory lines cannot say which tensors made it.
`start()` turns on the CUDA caching allocator's history (torch.cuda.memory.
_record_memory_history, Python stacks only); `live_at_peak()` replays the snapshot's trace
(alloc adds a block's size, free_completed removes it: the moment
torch.cuda.memory_allocated drops) and groups the blocks live at the highest point by the
innermost frames outside torch itself, which name the module and line that allocated them.
Blocks allocated before the trace began are not in it: the result says how many frees had
no matching alloc, so a report built on a partial trace shows it.
"""
from __future__ import annotations

MAX_EVENTS = 2_000_000
FRAMES_PER_SITE = 3


def start() -> None:
    import torch

    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=MAX_EVENTS)


def site(frames: list[dict]) -> str:
    """The innermost frames that are not torch's own: where the allocation was asked for."""
    ours = [f for f in frames if "/torch/" not in f["filename"] and f["filename"] != "??"]
    return " < ".join(f'{f["filename"].rsplit("/", 2)[-1]}:{f["line"]} {f["name"]}' for f in ours[:FRAMES_PER_SITE])


def replay(events: list[dict]) -> dict:
    """The highest total of allocated bytes over the trace and the blocks live then."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    unmatched_frees = 0
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif event["action"] == "free_completed":
            block = live.pop(event["addr"], None)
            if block is None:
                unmatched_frees += 1
            else:
                total -= block["size"]
    return {"peak_traced_bytes": peak, "at_peak": at_peak, "unmatched_frees": unmatched_frees}


def live_at_peak(top: int = 30) -> dict:
    """Stop recording and report the peak's live blocks, largest sites first."""
    import torch

    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][torch.cuda.current_device()]
    result = replay(events)
    by_site: dict[str, list[int]] = {}
    for block in result.pop("at_peak"):
        by_site.setdefault(site(block.get("frames", [])), []).append(block["size"])
    sites = sorted(by_site.items(), key=lambda kv: -sum(kv[1]))
    return {**result, "events": len(events), "trace_wrapped": len(events) >= MAX_EVENTS,
            "sites": [{"site": name, "bytes": sum(sizes), "blocks": len(sizes), "largest": max(sizes)}
                      for name, sizes in sites[:top]]}
