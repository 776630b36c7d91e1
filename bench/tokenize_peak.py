"""The host peak of loading and tokenizing the data, measured against loadpeak's prediction.

Writes alpaca and sharegpt datasets of varying row lengths (jsonl and parquet, 2k..100k rows)
and a 32k-id BPE tokenizer trained on them (the demo's character tokenizer has 100 ids, all
CPython cached ints, which no real tokenizer is), then loads each case in a fresh process as
`zerofit train` does (process group up, tokenizer loaded, VmHWM reset, data.load_splits) and
records VmHWM, the process tree's PSS peak (parent RSS + forked workers' private pages), and
loadpeak.load_facts + load_peak's prediction made before the load.
  python bench/tokenize_peak.py [--quick] [OUT.json]     # bench/results/tokenize_peak-cpu2.json
  python bench/tokenize_peak.py --workers 8 OUT.json     # forked workers on a many-core machine
  python bench/tokenize_peak.py --again OUT.json         # its predictions again, after a refit"""
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORK = Path(os.environ.get("TOKENIZE_PEAK_DIR", "/tmp/tokenize_peak"))
SEQ_LEN = 1024
GIB = 2**30


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


VOCAB = [f"{a}{b}{c}" for a in ("re", "con", "pro", "ex", "in", "de", "trans", "sub") for b in
         ("form", "duct", "tain", "port", "mit", "ject", "press", "scribe", "vert", "pose") for c in
         ("", "ed", "ing", "ion", "s", "able", "ive")] + ["the", "a", "of", "to", "and", "is", "in", "that", "42"]


def alpaca_row(rng: random.Random) -> dict:
    return {"instruction": words(rng, rng.randint(5, 40)), "input": words(rng, rng.randint(0, 60)),
            "output": words(rng, int(rng.paretovariate(1.2) * 20) % 600 + 5)}


def sharegpt_row(rng: random.Random) -> dict:
    turns = []
    for _ in range(rng.randint(1, 4)):
        turns += [{"from": "human", "value": words(rng, rng.randint(5, 80))},
                  {"from": "gpt", "value": words(rng, int(rng.paretovariate(1.2) * 20) % 400 + 5)}]
    return {"conversations": turns}


def write_dataset(kind: str, rows: int, fmt: str) -> Path:
    path = WORK / f"{kind}-{rows}.{fmt}"
    if path.exists():
        return path
    rng = random.Random(rows)
    make = alpaca_row if kind == "alpaca" else sharegpt_row
    data = [make(rng) for _ in range(rows)]
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in data))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(data), path)
    return path


def bpe_tokenizer() -> Path:
    """A byte-level BPE of 32000 ids trained on the generated words, with a chat template."""
    where = WORK / "bpe"
    if (where / "tokenizer.json").exists():
        return where
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from zerofit.demo import CHAT_TEMPLATE

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    text = [words(rng, 50) + f" {rng.randint(0, 10**6)}" for _ in range(20_000)]
    core.train_from_iterator(text, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<pad>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(where)
    return where


# ------------------------------------------------------------- one case, in a child
def tree_rss() -> int:
    """This process's RSS and its children's (forked workers') private pages: what the host
    holds for the load, pages a child shares with the parent counted once."""
    import psutil

    total = psutil.Process().memory_info().rss
    for child in psutil.Process().children(recursive=True):
        try:
            with open(f"/proc/{child.pid}/smaps_rollup") as rollup:
                total += sum(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Private_"))
        except OSError:
            pass
    return total


def measure(case: dict) -> dict:
    from zerofit import models  # noqa: F401 - train's imports, its base
    from zerofit.config.data import DataConfig
    from zerofit.config.schema import ModelConfig
    from zerofit.core import timeline
    from zerofit.data import pipeline as data
    from zerofit.plan import loadpeak
    from zerofit.train import engine, ranks  # noqa: F401
    from zerofit.train import loop as train  # noqa: F401

    ranks.init_distributed()
    if case["tokenizer"] == "demo":
        from zerofit.demo import build_tokenizer

        tokenizer = build_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(case["tokenizer"])
    cfg = DataConfig(path=case["path"], num_workers=case["workers"], cache_dir=case.get("cache_dir"))
    run_dir = Path(case["run_dir"]) if case.get("run_dir") else None
    models.hf_config(ModelConfig(config="tiny"))  # train reads the model's config before its data
    started = time.perf_counter()
    shape = loadpeak.load_facts(cfg, tokenizer, run_dir, timeline.host_rss_bytes())  # as train predicts it
    facts_s = time.perf_counter() - started
    predicted = loadpeak.load_peak(shape)
    timeline.reset_host_peak()
    base = timeline.proc_status()["VmRSS"]
    peak_pss, done = [0], threading.Event()

    def sample():
        while not done.wait(0.02):
            peak_pss[0] = max(peak_pss[0], tree_rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    train_set, eval_set = data.load_splits(cfg, tokenizer, SEQ_LEN, 0, len(tokenizer), run_dir=run_dir)
    load_s = time.perf_counter() - started
    done.set()
    sampler.join()
    hwm = timeline.proc_status()["VmHWM"]
    packed = train_set.input_ids.size + eval_set.input_ids.size
    total = sum(predicted.values())
    measured = max(hwm, peak_pss[0])  # the tree's, where workers forked
    return {**{k: v for k, v in case.items() if k != "run_dir"}, "file_bytes": sum(
        p.stat().st_size for p in [Path(case["path"])]), "rows_predicted": shape.rows,
        "examples": train_set.examples + eval_set.examples, "tokens_predicted": shape.tokens,
        "vocab_size": len(tokenizer),
        "packed_tokens": int(packed), "base_rss": base, "vm_hwm": hwm, "tree_peak": peak_pss[0],
        "predicted": total, "predicted_components": predicted,
        "error_vs_measured": round(total / measured - 1, 3), "facts_seconds": round(facts_s, 2),
        "load_seconds": round(load_s, 1)}


def run_case(case: dict) -> dict:
    env = {**os.environ, "HF_DATASETS_CACHE": tempfile.mkdtemp(dir=WORK, prefix="hf-")}  # a first load, converted
    out = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def worker_cases(workers: int) -> list[dict]:
    """`workers` forked tokenizers against one, on the files where their count shows: each worker
    holds its own copy of the tokenizer and its shard's token lists until they are gathered."""
    bpe = str(bpe_tokenizer())
    alpaca, sharegpt = (str(write_dataset(kind, 20_000, "jsonl")) for kind in ("alpaca", "sharegpt"))
    return [{"path": alpaca, "tokenizer": bpe, "workers": 1}, {"path": alpaca, "tokenizer": bpe, "workers": workers},
            {"path": sharegpt, "tokenizer": bpe, "workers": workers},
            {"path": str(write_dataset("sharegpt", 2_000, "jsonl")), "tokenizer": bpe, "workers": workers},
            {"path": str(write_dataset("alpaca", 100_000, "jsonl")), "tokenizer": bpe, "workers": workers}]


def cases(quick: bool) -> list[dict]:
    bpe = str(bpe_tokenizer())
    sizes = (2_000, 20_000) if quick else (2_000, 20_000, 100_000)
    found = []
    for kind in ("alpaca", "sharegpt"):
        for rows in sizes:
            for fmt in ("jsonl", "parquet"):
                if rows == 100_000 and kind == "sharegpt":
                    continue  # 20k took 140-165 s on 2 cores; alpaca's 100k cover the size
                found.append({"path": str(write_dataset(kind, rows, fmt)), "tokenizer": bpe, "workers": 1})
    big = str(write_dataset("alpaca", sizes[-1], "jsonl"))
    found.append({"path": str(write_dataset("alpaca", 20_000, "jsonl")), "tokenizer": "demo", "workers": 1})
    found.append({"path": str(write_dataset("sharegpt", 20_000, "jsonl")), "tokenizer": bpe, "workers": 2})
    found.append({"path": big, "tokenizer": bpe, "workers": 2})
    cache = str(WORK / "cache")
    small = str(write_dataset("alpaca", 20_000, "jsonl"))
    found.append({"path": small, "tokenizer": bpe, "workers": 1, "run_dir": str(WORK / "run"), "cache_dir": cache,
                  "note": "writes the tokenized cache"})
    found.append({"path": small, "tokenizer": bpe, "workers": 1, "run_dir": str(WORK / "run"), "cache_dir": cache,
                  "note": "reads the tokenized cache"})
    return found


def recorded_shape(case: dict):
    """The LoadShape a case's prediction was made from (one file a case), read back off its record."""
    from zerofit.plan import loadpeak

    parts = case["predicted_components"]
    files = (loadpeak.DataFile("parquet" if case["path"].endswith(".parquet") else "json",
                               parts.get("arrow_table", 0), case["rows_predicted"], case["tokens_predicted"]),)
    vocab = case.get("vocab_size", 100 if case["tokenizer"] == "demo" else 32000)  # recorded since the first run
    return loadpeak.LoadShape(files, workers=case["workers"] or 1, vocab_size=vocab,
                              cached="arrow_table" not in parts, process_bytes=parts["process"])


def predicted_again(result: dict) -> dict:
    """`result`'s predictions made again from its recorded shapes with loadpeak's constants as they
    are now (the measurements stand; the constants were fitted to them)."""
    from zerofit.plan import loadpeak

    for case in result["cases"]:
        parts = loadpeak.load_peak(recorded_shape(case))
        measured = max(case["vm_hwm"], case["tree_peak"])
        case.update(predicted=sum(parts.values()), predicted_components=parts,
                    error_vs_measured=round(sum(parts.values()) / measured - 1, 3))
    errors = [c["error_vs_measured"] for c in result["cases"]]
    result["error_range"] = [min(errors), max(errors)]
    return result


def main() -> None:
    if sys.argv[1:2] == ["--case"]:
        print(json.dumps(measure(json.loads(sys.argv[2]))), flush=True)
        os._exit(0)  # the process group of init_distributed: nothing to wind down for a measurement
    if sys.argv[1:2] == ["--again"]:  # after a refit of loadpeak's constants
        path = Path(sys.argv[2])
        result = predicted_again(json.loads(path.read_text()))
        result["predicted_again"] = "python bench/tokenize_peak.py --again " + sys.argv[2]
        path.write_text(json.dumps(result, indent=2) + "\n")
        for case in result["cases"]:
            print(f"{Path(case['path']).name:24} w{case['workers']} {case.get('note', ''):26} "
                  f"measured {max(case['vm_hwm'], case['tree_peak']) / GIB:.2f} predicted {case['predicted'] / GIB:.2f}"
                  f" ({case['error_vs_measured']:+.1%})")
        print(json.dumps({"error_range": result["error_range"]}))
        return
    quick = "--quick" in sys.argv
    workers = int(sys.argv[sys.argv.index("--workers") + 1]) if "--workers" in sys.argv else 0
    out = next((Path(a) for a in sys.argv[1:] if not a.startswith("--") and not a.isdigit()), None)
    WORK.mkdir(parents=True, exist_ok=True)
    results = []
    for case in worker_cases(workers) if workers else cases(quick):
        results.append(run_case(case))
        r = results[-1]
        print(f"{Path(r['path']).name:24} {r['tokenizer'][-4:]:5} w{r['workers']} {r.get('note', ''):26} "
              f"base {r['base_rss'] / GIB:.2f} hwm {r['vm_hwm'] / GIB:.2f} tree {r['tree_peak'] / GIB:.2f} "
              f"pred {r['predicted'] / GIB:.2f} ({r['error_vs_measured']:+.1%}) tokens {r['tokens_predicted']}/"
              f"{r['packed_tokens']} {r['load_seconds']}s", flush=True)
        errors = [r["error_vs_measured"] for r in results]
        summary = {"cores": os.cpu_count(), "seq_len": SEQ_LEN, "error_range": [min(errors), max(errors)],
                   "command": "python bench/tokenize_peak.py " + " ".join(sys.argv[1:]), "cases": results}
        if out:  # after every case: a timed-out run keeps what it measured
            out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "cases"}))


if __name__ == "__main__":
    main()
