"""DeepSpeed asks py-cpuinfo about the CPU three times at each start, each a subprocess of about
a second: zerofit answers from its cache after the first."""
import json

import cpuinfo

from zerofit.machine import accelerator


def counting_probe(calls: list):
    def probe():
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2", "avx512f"], "brand_raw": "a CPU"}
    return probe


def test_the_cpu_is_asked_once_per_cpu_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROFIT_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", counting_probe(calls))
    accelerator.remember_cpu_info()
    answers = [cpuinfo.get_cpu_info() for _ in range(3)]  # cpu_arch, simd_width, cpu_adam
    assert calls == [1] and answers[0] == answers[2] and answers[0]["flags"] == ["avx2", "avx512f"]
    cached = list((tmp_path / "cache").glob("cpuinfo-*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text()) == answers[0]

    # the next process: its own probe, never run, the answer read from the file
    monkeypatch.setattr(cpuinfo, "get_cpu_info", counting_probe(calls))
    accelerator.remember_cpu_info()
    assert cpuinfo.get_cpu_info()["brand_raw"] == "a CPU" and calls == [1]


def test_a_damaged_cache_is_asked_again_and_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROFIT_CACHE_DIR", str(tmp_path / "cache"))
    path = accelerator.cpu_info_path(getattr(cpuinfo, "CPUINFO_VERSION_STRING", ""))
    path.parent.mkdir(parents=True)
    path.write_text('{"arch": "X86_')  # a write cut short
    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", counting_probe(calls))
    accelerator.remember_cpu_info()
    assert cpuinfo.get_cpu_info()["arch"] == "X86_64" and calls == [1]
    assert json.loads(path.read_text())["arch"] == "X86_64"


def test_remembering_twice_wraps_once(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROFIT_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", counting_probe(calls))
    accelerator.remember_cpu_info()
    wrapped = cpuinfo.get_cpu_info
    accelerator.remember_cpu_info()
    assert cpuinfo.get_cpu_info is wrapped
