"""The timeline recorder's mechanics, on this machine's real readings."""
import json

from zerofit.core import timeline as memory
from zerofit.core.files import read_jsonl


def test_records_peaks_flags_and_per_step_readings(tmp_path):
    nvme = tmp_path / "nvme" / "zero_stage_3" / "optimizer" / "rank0"
    nvme.mkdir(parents=True)
    (nvme / "1.tensor.swp").write_bytes(b"\0" * 4096)
    (nvme / "notes.txt").write_text("not a swap file")
    timeline = memory.Timeline(tmp_path, 0, on_gpu=False, nvme_path=str(tmp_path / "nvme"))
    before = timeline.observe("forward")
    kept = b"\1" * (64 * 2**20)  # written, so RSS grows by 64 MiB within the next phase
    backward = timeline.observe("backward")
    assert backward["host_rss"] - before["host_rss"] > 60 * 2**20
    again = timeline.observe("forward")  # grad accumulation: forward recurs in the step
    first = timeline.flush(1)
    assert [r["phase"] for r in first] == ["forward", "backward"]
    assert first[0]["host_peak"] == max(before["host_peak"], again["host_peak"])  # the larger peak is kept
    assert first[0]["host_rss"] == again["host_rss"]  # the end-of-phase reading is the latest
    assert all(r["nvme_swap"] == 4096 and r["pinned"] >= 0 and r["host_avail"] > 0 for r in first)
    save = timeline.mark(1, "save", seconds=0.5)
    assert save["seconds"] == 0.5 and "after_save" not in save
    timeline.observe("forward")
    assert timeline.flush(2)[0]["after_save"] is True
    timeline.observe("forward")
    assert "after_save" not in timeline.flush(3)[0]
    assert timeline.last_phase == "forward"
    timeline.close()
    lines = [json.loads(line) for line in (tmp_path / "memory.jsonl").read_text().splitlines()]
    assert [(r["step"], r["phase"]) for r in lines] == [(1, "forward"), (1, "backward"), (1, "save"), (2, "forward"),
                                                         (3, "forward")]
    del kept


def test_host_peak_resets_between_phases(tmp_path):
    timeline = memory.Timeline(tmp_path, 0, on_gpu=False)
    timeline.observe("a")
    spike = b"\1" * (128 * 2**20)
    del spike
    with_spike = timeline.observe("b")
    without = timeline.observe("c")
    assert with_spike["host_peak"] - without["host_peak"] > 100 * 2**20
    timeline.close()


def test_rank_files_and_torn_lines(tmp_path):
    timeline = memory.Timeline(tmp_path, 3, on_gpu=False)
    timeline.mark(0, "start")
    timeline.close()
    assert memory.read_timeline(tmp_path, 3)[0]["phase"] == "start" and memory.read_timeline(tmp_path) == []
    with (tmp_path / "memory-rank3.jsonl").open("a") as f:
        f.write('{"step": 1, "pha')
    assert len(memory.read_timeline(tmp_path, 3)) == 1


def test_parse_bytes_and_budgets():
    assert memory.parse_bytes("24GiB") == 24 * 2**30
    assert memory.parse_bytes("64 GB") == 64 * 10**9
    assert memory.parse_bytes("512MiB") == 512 * 2**20
    assert memory.parse_bytes("1e9") == 10**9
    found = memory.budgets(on_gpu=False, host_mem="8GiB")
    assert found["host_budget"] == 8 * 2**30 and not found["host_budget_is_machine"] and found["gpu_budget"] == 0
    assert memory.budgets(on_gpu=False)["host_budget"] == found["host_total"]


def test_the_progress_line_shows_the_steps_gpu_peak_against_the_budget():
    """The step's phases' peaks (the allocator's own peak is reset at every phase, so reading
    it after the step gave about the current allocation) against the planned budget."""
    from zerofit.core.timeline import budget_summary

    records = [{"phase": "forward", "gpu_peak": 3 * 2**30}, {"phase": "backward", "gpu_peak": 5 * 2**30}]
    assert budget_summary(records, True, 24 * 2**30).startswith("gpu 5.0GiB/24.0GiB host ")
    assert budget_summary(records, False, 0).startswith("host ")


def test_a_full_disk_costs_the_timeline_not_the_run(tmp_path, capsys):
    """With checkpoint.on_error continue a full disk reached memory.jsonl next, and the run
    died there with a traceback: now the timeline stops being written, with a warning."""
    import errno

    from zerofit.core.timeline import Timeline

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    timeline = Timeline(tmp_path, 0, False)
    timeline.mark(1, "save")
    timeline._file.close()
    timeline._file = Full()
    record = timeline.mark(2, "save")  # no exception
    assert record["step"] == 2 and timeline.last["step"] == 2
    timeline.mark(3, "eval")
    timeline.close()
    assert capsys.readouterr().err.count("can no longer be written") == 1
    assert [r["step"] for r in read_jsonl(tmp_path / "memory.jsonl")] == [1]
