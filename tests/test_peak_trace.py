"""bench/peak_trace.py's replay of an allocator trace (the events PyTorch's
torch.cuda.memory._snapshot() records): the peak and what is live at it."""
from conftest import bench_module

peak_trace = bench_module("peak_trace")


def frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


def test_replay_finds_the_highest_point_and_the_blocks_live_there():
    events = [{"action": "alloc", "addr": 1, "size": 100},
              {"action": "alloc", "addr": 2, "size": 50},
              {"action": "free_requested", "addr": 1, "size": 100},  # still allocated until completed
              {"action": "alloc", "addr": 3, "size": 30},
              {"action": "free_completed", "addr": 1, "size": 100},
              {"action": "alloc", "addr": 4, "size": 60},            # 140: below the 180 before
              {"action": "free_completed", "addr": 9, "size": 5}]    # allocated before the trace began
    result = peak_trace.replay(events)
    assert result["peak_traced_bytes"] == 180
    assert sorted(b["addr"] for b in result["at_peak"]) == [1, 2, 3]
    assert result["unmatched_frees"] == 1


def test_site_names_the_innermost_frames_outside_torch():
    frames = [frame("/x/site-packages/torch/nn/functional.py", 10, "linear"),
              frame("/x/site-packages/deepspeed/runtime/zero/stage3.py", 1964, "_constant_buffered_norm2"),
              frame("??", 0, "??"),
              frame("/x/zerofit/train/loop.py", 159, "forward_loss"),
              frame("/x/zerofit/train/loop.py", 146, "train_step"),
              frame("/x/zerofit/train/loop.py", 88, "run")]
    assert peak_trace.site(frames) == ("stage3.py:1964 _constant_buffered_norm2 < loop.py:159 forward_loss"
                                       " < loop.py:146 train_step")
