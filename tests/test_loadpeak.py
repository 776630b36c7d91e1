"""The host peak of loading and tokenizing the data (zerofit/plan/loadpeak.py): predicted before the
load, against a real load's VmHWM; in the plan; and a start refused before loading on a host
too small for it."""
from __future__ import annotations

import json

import pytest
from conftest import bench_module, run_zerofit, tiny_config, write_config

from zerofit.config.load import load
from zerofit.plan import loadpeak, render


@pytest.fixture
def peak_bench(tmp_path, monkeypatch):
    """bench/tokenize_peak.py working under tmp_path: its datasets, its 32k-id BPE, its HF cache."""
    bench = bench_module("tokenize_peak")
    monkeypatch.setattr(bench, "WORK", tmp_path)
    return bench


@pytest.mark.e2e
def test_predicted_peak_is_within_its_tolerance_of_a_real_load(peak_bench):
    """20k alpaca rows of varying lengths (2.8M tokens of a 32k-id BPE) loaded as train loads
    them, in a process of their own: the prediction made before the load is within -10%..+20%
    of its VmHWM, and what the load adds (the examples' lists, the arrays, HF datasets and its
    table) within 25% of what VmHWM rose by."""
    path = peak_bench.write_dataset("alpaca", 20_000, "jsonl")
    measured = peak_bench.run_case({"path": str(path), "tokenizer": str(peak_bench.bpe_tokenizer()), "workers": 1})
    assert -0.10 <= measured["predicted"] / measured["vm_hwm"] - 1 <= 0.20, measured
    added = measured["predicted"] - measured["predicted_components"]["process"]
    assert abs(added / (measured["vm_hwm"] - measured["base_rss"]) - 1) <= 0.25, measured
    assert measured["predicted_components"]["examples"] > 200 * 2**20  # big enough for the lists to matter


def data_config(tmp_path, rows: int = 3000, **sections) -> dict:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Say {i} in words.", "output": "many words " * (i % 50)})
                            + "\n" for i in range(rows)))
    return tiny_config(tmp_path / "run", data, **sections)


def test_plan_shows_loading_the_data(tmp_path, capsys):
    """`zerofit plan --config` predicts the loading of the config's files (plan.json's
    data_load_peak, the 'other peaks' table); a config on the demo data, or --model alone,
    has nothing to load: no such peak, the plan as before."""
    config_file = write_config(tmp_path / "c.yaml", data_config(tmp_path))
    decision, spec, hw = render.plan(config_path=str(config_file))
    host = decision.plan.data_load_peak["host"]
    assert {"process", "examples", "datasets_library", "arrow_table"} <= set(host.components)
    assert host.fits and decision.plan.fits
    record = render.plan_json(decision, spec, hw)
    assert record["data_load_peak"]["host"]["total_bytes"] == host.total_bytes
    assert record["fits"] and "start_peak" in record  # the existing keys kept
    render.render(decision, spec, hw)
    assert "loading the data" in capsys.readouterr().out
    for model_only in (render.plan(model="tiny")[0], render.plan_config(load(str(write_config(
            tmp_path / "demo.yaml", tiny_config(tmp_path / "run2")))))[0]):
        assert model_only.plan.data_load_peak == {} and model_only.plan.to_json()["data_load_peak"] == {}


def test_plan_does_not_fit_a_host_too_small_to_load_the_data(tmp_path):
    """The loading alone over plan.host_mem (the training steps' ~620 MiB fit its 630 MiB usable,
    the loading of 6000 rows ~700 MiB): the plan does not fit, and its advice names the loading's
    figure and its fix."""
    config_file = write_config(tmp_path / "c.yaml", data_config(tmp_path, rows=6000, plan={"host_mem": "700MiB"}))
    decision, _, _ = render.plan(config_path=str(config_file))
    assert decision.plan.devices["host"].fits and not decision.plan.data_load_peak["host"].fits
    assert not decision.plan.fits
    said = " ".join(decision.advice)
    assert "host (loading the data)" in said and "data.cache_dir" in said and "streaming" in said


@pytest.mark.e2e
def test_start_refuses_before_loading_when_the_host_is_too_small(tmp_path):
    """train on a 600 MiB host budget (plan.host_mem), whose process alone takes ~0.4 GiB: refused
    before any row is tokenized, with the figure and the fix; nothing of the load is written."""
    config = data_config(tmp_path, rows=5000, plan={"host_mem": "600MiB"}, data={"num_workers": 2})
    done = run_zerofit(["train", "--config", str(write_config(tmp_path / "c.yaml", config))], check=False)
    assert done.returncode != 0
    error = done.stderr
    assert "loading the data would peak at" in error and "over the 540.0MiB usable (600.0MiB less plan.headroom " \
        "10%)" in error and "refused before loading" in error, error[-3000:]
    assert "tokenizing_workers " in error and "lower data.num_workers" in error
    assert "data.cache_dir" in error and "streaming the data is not supported" in error
    assert not (tmp_path / "run" / "data-cache").exists() and not (tmp_path / "run" / "plan.json").exists()


def test_a_tokenized_cache_is_priced_without_the_tables(tmp_path):
    """Once a start has kept the rows in data.cache_dir (datacache), the next start's prediction
    holds the process and the lists alone: no HF datasets, Arrow table or workers."""
    from zerofit.config.data import DataConfig
    from zerofit.data import cache
    from zerofit.data.files import data_entries
    from zerofit.demo import build_tokenizer

    config = data_config(tmp_path, rows=2000)["data"]
    cfg, tokenizer = DataConfig(**config, num_workers=2, cache_dir=str(tmp_path / "cache")), build_tokenizer()
    before = loadpeak.load_peak(loadpeak.load_facts(cfg, tokenizer, tmp_path / "run"))
    assert {"datasets_library", "arrow_table", "tokenizing_workers"} <= set(before)
    cache.read(data_entries(cfg.path), cfg, tokenizer, tmp_path / "run", "train")
    shape = loadpeak.load_facts(cfg, tokenizer, tmp_path / "run")
    assert shape.cached and set(loadpeak.load_peak(shape)) == {"process", "examples"}


@pytest.mark.e2e
def test_doctor_sets_the_measured_loading_beside_its_prediction(tmp_path):
    """The loading's prediction was in plan.json and its measured peak in the start record, but
    the doctor's plan vs measured showed neither: its host row now has the loading as a phase,
    and its summary says both figures."""
    from zerofit.doctor.run import diagnose

    config = data_config(tmp_path, rows=3000, train={"max_steps": 2}, eval={"every_steps": 0},
                         checkpoint={"every_steps": 0})
    run_zerofit(["train", "--config", str(write_config(tmp_path / "c.yaml", config))])
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    host = next(row for row in diagnose(tmp_path / "run").plan if row["device"] == "host")
    loading = next(phase for phase in host["phases"] if phase["phase"] == "loading the data")
    assert loading["predicted_bytes"] == plan["data_load_peak"]["host"]["total_bytes"]
    assert 0.7 < loading["measured_bytes"] / loading["predicted_bytes"] < 1.3, loading
    said = " ".join(run_zerofit(["doctor", str(tmp_path / "run"), "--no-hashes"]).stdout.split())
    assert f"before training: loading the data peaked at {loading['measured_bytes'] / 2**30:.2f} GiB host (planned " \
           f"{loading['predicted_bytes'] / 2**30:.2f} GiB;" in said, said
