"""Shared fixtures: tiny configs, tiny datasets, and zerofit run as a real process
(one per run, as users run it: DeepSpeed and torch.distributed keep global state)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from zerofit.checkpoint import files as checkpoint
from zerofit.config.load import validate
from zerofit.data.tokenize import IGNORE
from zerofit.machine import hardware
from zerofit.train import ranks
from zerofit.train.ranks import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fast_lane_starts_no_process(request, monkeypatch):
    """The fast lane (-m "not e2e and not multirank") stays fast: a test that starts a Python
    process (zerofit, torchrun, a script) is marked e2e (or multirank); starting one unmarked
    fails and says so. Small tools a library runs (ctypes' ldconfig) pass."""
    if any(request.node.get_closest_marker(lane) for lane in ("e2e", "multirank")):
        return
    popen_init = subprocess.Popen.__init__

    def refuse_python(self, args, *rest, **kwargs):
        program = Path(str(args if isinstance(args, (str, bytes)) else args[0]).split()[0]).name
        if "python" in program or program in ("zerofit", "torchrun", "deepspeed"):
            raise AssertionError(f"{request.node.nodeid} starts {program}: mark it @pytest.mark.e2e")
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse_python)


def bench_module(name: str):
    """bench/NAME.py as a module (the benches are scripts, not a package), imported by its name
    as the benches import each other, with bench/ on the path as each script puts it: one copy,
    shared with the benches that import it (cost_fit imports speed_bench, speed_bench imports
    speed_record); whichever test file asks first."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.append(str(ROOT / "bench"))
    return importlib.import_module(name)


def tiny_config(run_dir: Path, data_path: str | Path = "demo", **sections) -> dict:
    """The test model: preset `tiny` = LlamaConfig(num_hidden_layers=2, hidden_size=64)."""
    config = {
        "run_dir": str(run_dir),
        "model": {"config": "tiny", "gradient_checkpointing": False},
        "data": {"path": str(data_path), "eval_fraction": 0.05},
        "train": {"seq_len": 64, "micro_batch_size": 4, "max_steps": 6, "lr": 3e-3, "warmup_steps": 2, "seed": 7},
        "zero": {"stage": 3, "offload_optimizer": "cpu"},
        "eval": {"every_steps": 3, "max_sequences": 8},
        "checkpoint": {"every_steps": 3, "keep_last": 2},
        "log": {"progress": False},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            config.setdefault(section, {}).update(values)
        else:
            config[section] = values
    return config


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def zerofit_command(args: list[str], nproc: int = 1, torchrun_args: tuple[str, ...] = ()) -> list[str]:
    """`python -m zerofit ARGS`, or under torchrun with nproc ranks (gloo on CPU) and `torchrun_args`."""
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                "--master_port", str(free_port()), *torchrun_args, "-m", "zerofit", *args]
    return [sys.executable, "-m", "zerofit", *args]


def child_env(env: dict | None = None) -> dict:
    """The environment a zerofit under test runs in: unbuffered output, one OpenMP thread, `env`.
    DS_ACCELERATOR (which in-process tests set here) is left out: the child picks, as a user's would."""
    inherited = {key: value for key, value in os.environ.items() if key != "DS_ACCELERATOR"}
    return {**inherited, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}


def wait_for(path: Path, process: subprocess.Popen, poll_s: float = 0.05, timeout_s: float = 300) -> None:
    """Until `path` exists, `process` has ended or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(poll_s)


def run_zerofit(args: list[str], nproc: int = 1, env: dict | None = None, timeout: int = 600,
                check: bool = True, input_text: str | None = None,
                torchrun_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`zerofit_command(...)` run to its end in `child_env(env)`; `input_text` goes to its stdin."""
    cmd = zerofit_command(args, nproc, torchrun_args)
    done = subprocess.run(cmd, cwd=ROOT, env=child_env(env), capture_output=True, text=True, timeout=timeout,
                          input=input_text)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return done


def deepspeed_lines(done: subprocess.CompletedProcess) -> list[str]:
    """DeepSpeed's own log and op-builder lines ("[WARNING] ...", "[INFO] ...") in a finished
    process's stdout and stderr: the read-only verbs show only zerofit's."""
    return [line for line in (done.stdout + done.stderr).splitlines() if "[WARNING]" in line or "[INFO]" in line]


def trained_run(base: Path, config: dict) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """Write `config` under `base` and train it: (run dir, config file, the finished process)."""
    config_file = write_config(base / "c.yaml", config)
    done = run_zerofit(["train", "--config", str(config_file)])
    return Path(config["run_dir"]), config_file, done


def assert_resumes_exactly(run: Path, config_file: Path, copy: Path, drop: str, resumed_at: int,
                           nproc: int = 1) -> None:
    """Copy `run`, delete its checkpoint `drop`, resume on `nproc` ranks: it starts at step `resumed_at`,
    every later step has the uninterrupted run's loss and LR, the last eval loss is equal,
    and the optimizer state it saves again as `drop` is bit-equal to the uninterrupted run's."""
    import shutil

    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / drop)
    done = run_zerofit(["train", "--config", str(config_file), "--run-dir", str(copy), "--resume"], nproc=nproc)
    assert "resumed from" in done.stderr and f"step {resumed_at}" in done.stderr
    original = {m["step"]: m for m in read_jsonl(run / "metrics.jsonl")}
    resumed = {m["step"]: m for m in read_jsonl(copy / "metrics.jsonl")}
    assert sorted(resumed) == sorted(original)
    for step in range(resumed_at + 1, max(original) + 1):
        assert resumed[step]["loss"] == original[step]["loss"], step
        assert resumed[step]["lr"] == original[step]["lr"]
    assert resumed[max(original)]["eval_loss"] == original[max(original)]["eval_loss"]
    assert_same_optimizer_state(run / "checkpoints" / drop, copy / "checkpoints" / drop)


def assert_same_optimizer_state(a: Path, b: Path) -> None:
    """Every tensor of every rank's ZeRO optimizer file is bit-equal in two checkpoints."""
    import torch

    files = sorted(p.name for p in a.glob("*optim_states.pt"))
    assert files and files == sorted(p.name for p in b.glob("*optim_states.pt"))
    for name in files:
        left, right = (dict(_tensors(torch.load(d / name, weights_only=False))) for d in (a, b))
        assert left.keys() == right.keys()
        different = [k for k in left if not torch.equal(left[k], right[k])]
        assert not different, f"{name}: {different[:5]}"


def _tensors(obj, prefix=""):
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}.{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}[{i}]")


def exported_tensors(out_dir) -> dict:
    """Every tensor of a model directory's safetensors files."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(Path(out_dir).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def peak_rss_of(cmd: list[str], tmp_path) -> tuple[int, int, str]:
    """(exit code, peak RSS in bytes as the kernel counted it, stderr) of a child process."""
    err = tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    return child.returncode, usage.ru_maxrss * 1024, err.read_text()




def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def tokenizer():
    from zerofit.demo import build_tokenizer

    return build_tokenizer()


def decode_learned(tokenizer, ids, labels):
    return tokenizer.decode([t for t, l in zip(ids, labels) if l != IGNORE])


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# Six steps, a checkpoint every two: saves 1, 2, 3 are steps 2, 4, 6.
SHAPE = dict(eval={"every_steps": 0, "at_end": False})


def config_for(base: Path, name: str, max_steps: int = 6, **checkpoint_settings) -> Path:
    settings = {"every_steps": 2, "keep_last": 2, **checkpoint_settings}
    return write_config(base / f"{name}.yaml", tiny_config(base / name, train={"max_steps": max_steps},
                                                           checkpoint=settings, **SHAPE))


def valid_steps(run: Path) -> list[int]:
    return sorted(checkpoint.step_of(p) for p in checkpoint.published(run / "checkpoints")
                  if checkpoint.verify(p, hashes=True) is None)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted synchronous run every other run is compared with."""
    base = tmp_path_factory.mktemp("reference")
    run_zerofit(["train", "--config", str(config_for(base, "run"))])
    return base / "run"


TINY = 90_432  # preset tiny: embed 8192 + 2 x 36,992 per block + norm 64 + lm_head 8192


def cuda_box(gpu="24GiB", host="128GiB", cores=16, disk=10**13):
    """A GPU machine described by overrides, whatever this machine is."""
    hw = hardware.probe(gpu_mem=gpu, host_mem=host)
    return hardware.with_overrides(hw, cpu_cores=cores, disk_free_bytes=disk)


def cpu_box(host="16GiB"):
    return hardware.with_overrides(hardware.probe(host_mem=host, accelerator="cpu"), disk_free_bytes=10**13)


def config(**sections):
    raw = {"model": {"config": "llama-1.5b"}, "train": {"max_steps": 10, "seq_len": 1024},
           "checkpoint": {"save_final": False}}
    for key, values in sections.items():
        raw.setdefault(key, {}).update(values)
    return validate(raw)


WIDE = {"COLUMNS": "400"}  # rich wraps at 80 columns off a terminal; these tests read whole lines
OOM_AT_5 = {"ZEROFIT_FAULT": "oom@step:5", **WIDE}


def oom_config(base, **sections):
    return write_config(base / "c.yaml", tiny_config(base / "run", train={"max_steps": 8},
                                                     checkpoint={"every_steps": 3}, **sections))


def node_command(port: int, rdzv_id: str, config, *args: str, max_restarts: int = 0) -> list[str]:
    """One of two torchrun agents of one rank each (rendezvous c10d at 127.0.0.1:port): a node
    of two on one machine, running `zerofit train --config CONFIG ARGS`."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
            "--max-restarts", str(max_restarts), "-m", "zerofit", "train", "--config", str(config), *args]


def run_two_nodes(tmp_path, config, fault: str, *args: str) -> tuple[list[str], list[int]]:
    """`zerofit train` under two torchrun agents of one rank each (rendezvous c10d, --max-restarts 1):
    two nodes on one machine. Their outputs and exit codes."""
    port = ranks.free_port()
    env = child_env({"ZEROFIT_FAULT": fault, **WIDE})
    nodes = [subprocess.Popen(node_command(port, "two-nodes", config, *args, max_restarts=1),
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=400)[0] for node in nodes]
    finally:  # a hung run's workers live in sessions of their own (torchrun starts them so)
        for node in nodes:
            kill_tree(node.pid)
    return outputs, [node.returncode for node in nodes]


def kill_tree(pid: int) -> None:
    import psutil

    try:
        processes = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.Error:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            pass


def agent_store_env(monkeypatch, restart: int, max_restarts: int):
    """What torchrun gives a worker, with a TCP store of this test's as the agent's."""
    import torch.distributed as td

    port = ranks.free_port()
    server = td.TCPStore("127.0.0.1", port, 1, is_master=True)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(restart),
                        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}.items():
        monkeypatch.setenv(name, value)
    return server


def train(base, env=None, **sections):
    # one CPU thread on purpose (the test machine's cores are shared): not a finding on any machine
    config = write_config(base / "c.yaml", tiny_config(base / "run", train={"max_steps": 12, "cpu_threads": 1},
                                                         checkpoint={"every_steps": 3}, **sections))
    return base / "run", config, run_zerofit(["train", "--config", str(config)], env=env)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("clean"))
