"""Files in a run directory or a checkpoint that someone else may have planted: a symbolic link
where zerofit writes its state, a pickle where it loads tensors. None may make zerofit write
elsewhere or run code; each is refused with a clear error (or replaced) and the target is untouched."""
import os

import pytest

from conftest import run_zerofit, tiny_config, write_config
from zerofit import checkpoint, runlock
from zerofit.config import ConfigError
from zerofit.memory import Timeline

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
    checkpoint.write_atomic(root / checkpoint.LATEST, "step-000003")
    assert victim.read_text() == VICTIM_TEXT
    assert not (root / checkpoint.LATEST).is_symlink() and (root / checkpoint.LATEST).read_text() == "step-000003"


def test_appended_logs_refuse_a_planted_link(tmp_path, victim):
    """memory.jsonl and metrics.jsonl are appended to for the whole run: a link there is refused."""
    from zerofit.train import MetricsLog

    run = tmp_path / "run"
    run.mkdir()
    timeline = Timeline(run, 0, on_gpu=False)
    timeline.close()
    timeline.path.unlink()
    timeline.path.symlink_to(victim)
    with pytest.raises(ConfigError, match="is a symbolic link .*remove the link"):
        Timeline(run, 0, on_gpu=False)
    (run / "metrics.jsonl").symlink_to(victim)
    with MetricsLog(run, enabled=True, tensorboard=False, keep_upto=0) as metrics:
        metrics.write({"step": 1, "loss": 2.5})
    assert victim.read_text() == VICTIM_TEXT and not os.path.islink(run / "metrics.jsonl")
