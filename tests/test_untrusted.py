"""Files in a run directory or a checkpoint that someone else may have planted: a symbolic link
where zerofit writes its state, a pickle where it loads tensors. None may make zerofit write
elsewhere or run code; each is refused with a clear error (or replaced) and the target is untouched."""
import os

import pytest
from conftest import run_zerofit, tiny_config, write_config

from zerofit.checkpoint import files as checkpoint
from zerofit.core import runlock
from zerofit.core.errors import ConfigError
from zerofit.core.files import LinkedFileError, write_atomic
from zerofit.core.timeline import Timeline

VICTIM_TEXT = "a file the trainer can write, and must not\n"


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


def test_a_lock_file_link_is_refused_and_its_target_kept(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    (run / runlock.LOCK_FILE).symlink_to(victim)
    with pytest.raises(ConfigError, match=r"\.zerofit\.lock is a symbolic link .*remove the link"):
        runlock.hold(run)
    assert victim.read_text() == VICTIM_TEXT and runlock.holder(run) is None


@pytest.mark.e2e
def test_train_refuses_a_lock_file_link(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    (run / runlock.LOCK_FILE).symlink_to(victim)
    config = write_config(tmp_path / "c.yaml", tiny_config(run, train={"max_steps": 1}))
    done = run_zerofit(["train", "--config", str(config)], check=False)
    assert done.returncode == 1 and "is a symbolic link" in done.stderr and "Traceback" not in done.stderr
    assert victim.read_text() == VICTIM_TEXT


def test_state_files_replace_a_planted_link_and_never_write_through(tmp_path, victim):
    """latest, loop_state.json, MANIFEST.json, config.yaml, plan.json go through write_atomic:
    a link at the file or at its temporary is replaced, never written through."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / checkpoint.LATEST).symlink_to(victim)
    (root / f"{checkpoint.TMP_PREFIX}{checkpoint.LATEST}").symlink_to(victim)
    write_atomic(root / checkpoint.LATEST, "step-000003")
    assert victim.read_text() == VICTIM_TEXT
    assert not (root / checkpoint.LATEST).is_symlink() and (root / checkpoint.LATEST).read_text() == "step-000003"


def test_appended_logs_refuse_a_planted_link(tmp_path, victim):
    """memory.jsonl and metrics.jsonl are appended to for the whole run: a link there is refused."""
    from zerofit.train.metrics import MetricsLog

    run = tmp_path / "run"
    run.mkdir()
    timeline = Timeline(run, 0, on_gpu=False)
    timeline.close()
    timeline.path.unlink()
    timeline.path.symlink_to(victim)
    with pytest.raises(LinkedFileError, match="is a symbolic link .*remove the link"):
        Timeline(run, 0, on_gpu=False)
    (run / "metrics.jsonl").symlink_to(victim)
    with MetricsLog(run, enabled=True, tensorboard=False, keep_upto=0) as metrics:
        metrics.write({"step": 1, "loss": 2.5})
    assert victim.read_text() == VICTIM_TEXT and not os.path.islink(run / "metrics.jsonl")


class Payload:
    """What a poisoned checkpoint file carries: unpickling it runs exec, which writes `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('the checkpoint ran code')",)


def poison(path, marker) -> None:
    """Add a Payload to a torch file's dict and record the new bytes in the checkpoint's
    manifest, as someone who replaced the file would: only the loader stands in the way."""
    import json

    import torch

    content = torch.load(path, weights_only=False)  # the test's own, trusted file
    content["extra"] = Payload(marker)
    torch.save(content, path)
    manifest_file = path.parent / checkpoint.MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest["files"][path.name] = {"bytes": path.stat().st_size, checkpoint.HASH: checkpoint.file_hash(path)}
    manifest_file.write_text(json.dumps(manifest))


def test_a_pickled_payload_is_refused_by_every_loader(tmp_path):
    import torch

    from zerofit.checkpoint.writer import ZerofitCheckpointEngine

    marker, path = tmp_path / "pwned", tmp_path / "rng_state_rank0.pt"
    torch.save({"torch": torch.get_rng_state(), "extra": Payload(marker)}, path)
    with pytest.raises(checkpoint.UnsafeFileError, match="holds a pickled object zerofit does not load .*exec"):
        checkpoint.load_torch_file(path)
    with pytest.raises(checkpoint.UnsafeFileError, match="builtins.exec"):
        checkpoint.refuse_unsafe([path])
    with pytest.raises(checkpoint.UnsafeFileError):
        ZerofitCheckpointEngine.__new__(ZerofitCheckpointEngine).load(str(path))  # DeepSpeed's reads during a resume
    assert not marker.exists()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A tiny run with its checkpoint at step 2."""
    base = tmp_path_factory.mktemp("saved")
    config = write_config(base / "c.yaml", tiny_config(base / "run", train={"max_steps": 2},
                                                       checkpoint={"every_steps": 2}, eval={"every_steps": 0}))
    run_zerofit(["train", "--config", str(config)])
    return base / "run"


@pytest.mark.e2e
@pytest.mark.parametrize("poisoned", ["rng_state_rank0.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"])
def test_a_resume_refuses_a_poisoned_checkpoint(saved_run, tmp_path, poisoned):
    import shutil

    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(saved_run, run)
    poison(run / "checkpoints" / "step-000002" / poisoned, marker)
    config = write_config(tmp_path / "c.yaml", tiny_config(run, train={"max_steps": 3}, checkpoint={"every_steps": 2},
                                                           eval={"every_steps": 0}))
    done = run_zerofit(["train", "--config", str(config)], check=False)
    assert done.returncode == 1 and "holds a pickled object zerofit does not load" in done.stderr, done.stderr[-3000:]
    assert not marker.exists()


@pytest.mark.e2e
def test_export_verify_refuses_a_poisoned_checkpoint(saved_run, tmp_path):
    import shutil

    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(saved_run, run)
    poison(run / "checkpoints" / "step-000002" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", marker)
    done = run_zerofit(["export", str(run), "--out", str(tmp_path / "model"), "--verify"], check=False)
    assert done.returncode == 1 and "holds pickled objects zerofit does not load" in done.stderr, done.stderr[-3000:]
    assert not marker.exists() and not (tmp_path / "model").exists()
