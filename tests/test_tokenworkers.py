"""data.num_workers and the tokenized rows kept (tokenworkers.py, datacache.py): forked workers, cache dirs."""
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import write_jsonl

from zerofit.config.data import DataConfig
from zerofit.config.load import validate
from zerofit.core.errors import ConfigError
from zerofit.data import tokenize
from zerofit.data import workers as tokenworkers
from zerofit.data.files import DataError


def test_the_next_start_reads_the_rows_it_tokenized_before(tmp_path, tokenizer, capsys):
    """A resume tokenized every row again (35 s for 100k rows on 2 cores, per start and per
    rank): the run directory keeps them, named by the files' size and time, the data keys
    tokenizing reads, the tokenizer and the code; anything of those changed tokenizes again."""
    import os

    from zerofit.core.console import Shown
    from zerofit.data import cache
    from zerofit.demo import build_tokenizer

    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": f"say {i}", "output": f"ok {i}"} for i in range(30)])
    cfg = DataConfig(path=str(path))
    first = cache.read([[path]], cfg, tokenizer, tmp_path / "run", "train", Shown(True, False))
    kept = list((tmp_path / "run" / "data-cache").glob("train-*.npz"))
    assert len(kept) == 1 and capsys.readouterr().err == ""
    # the same size and time, other rows: what the cache holds comes back (it is read, not tokenized)
    stat = path.stat()
    path.write_text(path.read_text().replace("say", "sag"))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again = cache.read([[path]], cfg, tokenizer, tmp_path / "run", "train", Shown(True, False))
    assert again == first and "train rows: tokenized by an earlier start of this run" in capsys.readouterr().err
    # the file's time, a data key tokenizing reads, the tokenizer's template: tokenized again, the old file gone
    os.utime(path)
    assert cache.read([[path]], cfg, tokenizer, tmp_path / "run", "train") != first
    changed = DataConfig(path=str(path), alpaca_template="alpaca")
    layouts = cache.read([[path]], changed, tokenizer, tmp_path / "run", "train")
    assert "### Instruction:\nsag 0" in tokenizer.decode(layouts.examples[0][0])
    assert len(list((tmp_path / "run" / "data-cache").glob("train-*.npz"))) == 1
    assert cache.cache_key([[path]], cfg, tokenizer) != cache.cache_key([[path]], changed, tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert cache.cache_key([[path]], cfg, tokenizer) != cache.cache_key([[path]], cfg, build_tokenizer())
    # a cache file cut short is tokenized again and replaced; the eval files' cache stays beside the train's
    kept = next((tmp_path / "run" / "data-cache").glob("train-*.npz"))
    kept.write_bytes(kept.read_bytes()[:100])
    assert cache.read([[path]], changed, tokenizer, tmp_path / "run", "train") == layouts
    cache.read([[path]], changed, tokenizer, tmp_path / "run", "eval")
    assert len(list((tmp_path / "run" / "data-cache").glob("*.npz"))) == 2


class Payload:
    """A poisoned cache file's content: unpickled, it writes `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('the data cache ran code')",)


def test_a_poisoned_or_damaged_cache_never_runs_and_is_tokenized_again(tmp_path, tokenizer, capsys):
    """The cache was a pickle: a file put in a shared data.cache_dir under the name a run reads
    ran its code. It is numpy arrays read with allow_pickle=False now; a pickle under the old
    name is never read, one under the new name (or a file cut short) is stale: said, tokenized again."""
    import pickle

    from zerofit.core.console import Shown
    from zerofit.data import cache

    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": f"say {i}", "output": f"ok {i}"} for i in range(30)])
    shared, marker = tmp_path / "shared", tmp_path / "pwned"
    shared.mkdir()
    cfg = DataConfig(path=str(path), cache_dir=str(shared))
    expected = cache.read([[path]], DataConfig(path=str(path)), tokenizer, None, "train")
    key = cache.cache_key([[path]], cfg, tokenizer)
    for name in (f"train-{key}.pkl", f"train-{key}.npz"):
        (shared / name).write_bytes(pickle.dumps(Payload(marker)))
    assert cache.read([[path]], cfg, tokenizer, tmp_path / "run", "train", Shown(True, False)) == expected
    assert not marker.exists() and "cannot be read" in capsys.readouterr().err
    kept = shared / f"train-{key}.npz"
    assert cache.read([[path]], cfg, tokenizer, tmp_path / "run", "train") == expected  # the rewritten file
    kept.write_bytes(kept.read_bytes()[:-200])
    assert cache.read([[path]], cfg, tokenizer, tmp_path / "run", "train", Shown(True, False)) == expected
    assert f"{kept}: the tokenized rows kept there cannot be read" in capsys.readouterr().err
    assert not marker.exists()


# --------------------------------------------------------------------- data.num_workers
def test_worker_processes_tokenize_the_same_rows_and_name_the_same_bad_row(tmp_path, tokenizer):
    """Two forked workers (data.num_workers: 2, chunks of 25 rows) give the examples, formats,
    rows skipped and their reasons of the training process alone, in the file's order; without
    skip_bad_rows the first bad row is the one named, though a later chunk holds another."""
    rows = []
    for i in range(200):
        rows.append([{"text": f"plain row {i}"}, {"instruction": f"say {i}", "output": f"{i}!"},
                     {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]},
                     {"conversations": [{"from": "human", "value": f"h{i}"}, {"from": "gpt", "value": f"g{i}"}]}][i % 4])
    rows[57], rows[140] = {"instruction": "says", "output": 5}, {"text": 5}
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    alone, forked = (tokenize.read_examples([path], DataConfig(path=str(path), skip_bad_rows=True, num_workers=n),
                                              tokenizer) for n in (1, 2))
    assert len(alone.examples) == 198 and alone.skipped == 2
    assert forked.examples == alone.examples and forked.reasons == alone.reasons
    assert forked.formats == alone.formats and forked.skipped == alone.skipped
    assert "line 58: field `output`: expected a string" in forked.reasons[0]
    assert "line 141: field `text`" in forked.reasons[1]
    with pytest.raises(DataError, match=r"mixed\.jsonl, line 58: field `output`: expected a string, got int "
                                        r"\(alpaca format\)"):
        tokenize.read_examples([path], DataConfig(path=str(path), num_workers=2), tokenizer)


def test_tokenizing_workers_are_forked_processes_and_keep_the_order():
    parent = os.getpid()

    def which(i):
        time.sleep(0.002)  # long enough that both workers take chunks
        return i, os.getpid()

    results = list(tokenworkers.tokenized(100, which, workers=2))
    assert [i for i, _ in results] == list(range(100))
    pids = {pid for _, pid in results}
    assert parent not in pids and len(pids) == 2


@pytest.mark.e2e
def test_closing_the_rows_early_leaves_the_later_chunks_undone():
    """A bad row ends the reading: the workers are stopped, the chunks not begun dropped, not
    tokenized for nothing (chunks of 64 rows)."""
    done = multiprocessing.get_context("fork").Value("i", 0)

    def slow(i):
        time.sleep(0.0005)
        with done.get_lock():
            done.value += 1
        return i

    results = tokenworkers.tokenized(4000, slow, workers=2)
    assert next(results) == 0
    results.close()
    assert 64 <= done.value < 4000


def test_a_killed_tokenizing_worker_is_said_with_the_fix_not_waited_on():
    parent = os.getpid()

    def dies_at_7(i):
        if i == 7 and os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return i

    with pytest.raises(tokenworkers.WorkerDied, match=r"a tokenizing worker process died .* set data.num_workers "
                                                      r"lower, 1 to tokenize in the training process alone"):
        list(tokenworkers.tokenized(100, dies_at_7, workers=2))


@pytest.mark.parametrize("setting, rows, cores, local_ranks, expected", [
    (None, 999, 16, 1, 1),  # a small file: the training process alone
    (None, 1_000, 16, 1, 16),
    (None, 1_000, 64, 1, 16),  # at most 16 by default
    (None, 100_000, 16, 4, 4),  # the node's cores shared by its ranks
    (None, 100_000, 2, 4, 1),  # fewer cores than ranks: one each
    (16, 100_000, 64, 1, 16),  # asked for: as many, up to this rank's share
    (16, 100_000, 64, 8, 8),
    (4, 3, 64, 1, 3),  # never more than the rows
], ids=["small", "auto", "auto-most", "shared", "starved", "asked", "asked-shared", "few-rows"])
def test_worker_count(setting, rows, cores, local_ranks, expected):
    assert tokenworkers.worker_count(setting, rows, cores, local_ranks) == expected


def test_a_shared_cache_dir_serves_another_run_and_keeps_every_tokenization(tmp_path, tokenizer, capsys):
    """data.cache_dir (LLaMA-Factory's tokenized_path): a second run directory reads the rows the
    first tokenized; another tokenization of the data is kept beside it, nothing removed (the
    run's own data-cache replaces its older one); an unwritable directory is said, the run goes on."""
    from zerofit.core.console import Shown
    from zerofit.data import cache

    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": f"say {i}", "output": f"ok {i}"} for i in range(30)])
    shared = tmp_path / "shared"
    cfg = DataConfig(path=str(path), cache_dir=str(shared))
    first = cache.read([[path]], cfg, tokenizer, tmp_path / "run-a", "train", Shown(True, False))
    assert [p.name for p in shared.iterdir()] == [f"train-{cache.cache_key([[path]], cfg, tokenizer)}.npz"]
    assert not (tmp_path / "run-a" / "data-cache").exists()
    capsys.readouterr()
    assert cache.read([[path]], cfg, tokenizer, tmp_path / "run-b", "train", Shown(True, False)) == first
    assert "train rows: data.cache_dir, tokenized before from the same files" in capsys.readouterr().err
    other = DataConfig(path=str(path), cache_dir=str(shared), alpaca_template="alpaca")
    cache.read([[path]], other, tokenizer, tmp_path / "run-b", "train")
    assert len(list(shared.glob("train-*.npz"))) == 2
    # a directory that cannot be made (a file stands where it would go: unwritable even to root)
    (tmp_path / "a-file").write_text("")
    blocked = DataConfig(path=str(path), cache_dir=str(tmp_path / "a-file" / "cache"), max_samples=5)
    assert len(cache.read([[path]], blocked, tokenizer, tmp_path / "run-c", "train", Shown(True, False)).examples) == 5
    assert "the tokenized rows could not be kept (Not a directory)" in capsys.readouterr().err
    # the run's own data-cache/ a file: said too (each start tokenized again without a word)
    (tmp_path / "run-d").mkdir()
    (tmp_path / "run-d" / "data-cache").write_text("")
    cache.read([[path]], DataConfig(path=str(path)), tokenizer, tmp_path / "run-d", "train", Shown(True, False))
    said = capsys.readouterr().err.replace("\n", "")
    assert f"{tmp_path / 'run-d' / 'data-cache'}: the tokenized rows could not be kept (" in said


def machine_of_two(tmp_path, tokenizer, cfg: DataConfig, path: Path, monkeypatch) -> dict[str, tuple]:
    """datacache.read on the two ranks of one machine (threads meeting at a real barrier): what
    each returned, and the ranks_tokenizing of each tokenization each made."""
    import threading

    from zerofit.data import cache

    calls, real = [], cache.read_examples
    monkeypatch.setattr(cache, "read_examples", lambda *args, **kwargs: (
        calls.append((threading.current_thread().name, kwargs.get("ranks_tokenizing"))), real(*args, **kwargs))[1])
    barrier, found = threading.Barrier(2, timeout=60), {}

    def rank(first: bool) -> None:
        node = cache.Node(first=first, ranks=2, wait=barrier.wait)
        found[threading.current_thread().name] = cache.read([[path]], cfg, tokenizer, tmp_path / "run", "train",
                                                                node=node)

    ranks = [threading.Thread(target=rank, args=(name == "first",), name=name) for name in ("second", "first")]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(timeout=120)
    return {name: (found[name], [made for who, made in calls if who == name]) for name in ("first", "second")}


def test_one_rank_of_a_machine_tokenizes_with_all_its_cores_and_the_others_read_its_rows(tmp_path, tokenizer,
                                                                                        monkeypatch):
    """LLaMA-Factory's main_process_first: the second rank waits (it starts first here) and reads
    what the first kept; where the first could not keep them, it tokenizes them itself."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": f"say {i}", "output": f"ok {i}"} for i in range(40)])
    cfg = DataConfig(path=str(path))
    ranks = machine_of_two(tmp_path, tokenizer, cfg, path, monkeypatch)
    assert ranks["first"][1] == [1]  # tokenized once, as the machine's only tokenizing rank: all its cores
    assert ranks["second"][1] == []
    assert ranks["second"][0] == ranks["first"][0] and len(ranks["first"][0].examples) == 40
    # the rows kept: both read them
    assert [made for _, (_, made) in machine_of_two(tmp_path, tokenizer, cfg, path, monkeypatch).items()] == [[], []]
    # a data.cache_dir that cannot take them (a file stands where it would go): each rank tokenizes
    (tmp_path / "a-file").write_text("")
    blocked = DataConfig(path=str(path), cache_dir=str(tmp_path / "a-file" / "cache"))
    ranks = machine_of_two(tmp_path, tokenizer, blocked, path, monkeypatch)
    assert ranks["first"][1] == [1] and ranks["second"][1] == [1]
    assert ranks["second"][0] == ranks["first"][0]


def test_cache_dir_is_a_path_and_llamafactorys_tokenized_path_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert DataConfig(cache_dir="~/tok").cache_dir == f"{tmp_path}/tok"
    with pytest.raises(ConfigError, match=r"data.tokenized_path; LLaMA-Factory's / HF Trainer's tokenized_path is "
                                          r"data.cache_dir"):
        validate({"model": {"config": "demo"}, "train": {"max_steps": 1}, "data": {"tokenized_path": "x"}})


@pytest.mark.e2e
def test_tokenizing_workers_die_with_a_parent_killed_outright(tmp_path):
    """They hold the parent's files (the run's lock, a pipe into tee): a parent SIGKILLed (the
    OOM killer) left them tokenizing on, the run refused as 'in use'."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys, time\n"
        "from zerofit.data import workers as tokenworkers\n"
        "def slow(i):\n"
        "    os.write(1, f'{os.getpid()}\\n'.encode())  # one write: two workers' lines never interleave\n"
        "    time.sleep(0.05)\n"
        "    return i\n"
        "for _ in tokenworkers.tokenized(100000, slow, workers=2):\n"
        "    pass\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(tokenworkers.__file__).parents[2])})
    workers = {int(parent.stdout.readline()) for _ in range(40)} - {parent.pid}
    assert len(workers) == 2
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while any(map(running, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(running, workers))


def running(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.mark.e2e
def test_rows_longer_than_the_tokenizers_maximum_warn_no_one_in_no_worker(tmp_path):
    """transformers warns "Token indices sequence length is longer than ..." once per process
    against model_max_length, which zerofit never uses (it cuts to train.seq_len and says how
    many it cut): each forked worker said it again. In a process of its own, as the run's."""
    path = write_jsonl(tmp_path / "long.jsonl", [{"text": f"a row of more than eight tokens, number {i}"}
                                                  for i in range(200)])
    script = ("from pathlib import Path\nfrom zerofit.data import tokenize\n"
              "from zerofit.config.data import DataConfig\n"
              "from zerofit.demo import build_tokenizer\n"
              "for workers in (2, 1):\n"
              "    tokenizer = build_tokenizer()\n"
              "    tokenizer.model_max_length = 8\n"
              f"    read = tokenize.read_examples([Path({str(path)!r})], DataConfig(path={str(path)!r}, num_workers=workers),"
              " tokenizer)\n"
              "    print(workers, len(read.examples), len(read.examples[0][0]),"
              " tokenizer.deprecation_warnings.get('sequence-length-is-longer-than-the-specified-maximum', False))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    said = [line.split() for line in done.stdout.splitlines()]
    assert [(w, rows, flag) for w, rows, _, flag in said] == [("2", "200", "False"), ("1", "200", "False")]  # as found
    assert all(int(tokens) > 8 for *_, tokens, _ in said)  # every row read whole
    assert "Token indices sequence length" not in done.stderr
