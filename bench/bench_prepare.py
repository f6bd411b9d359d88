"""Tokenisation throughput and memory: ``plait data prepare`` vs ``datasets.map(batched=True)``.

Both sides read the same Parquet file (~200 MB of real text: the built-in Shakespeare and King
James corpora, repeated, one document per row) and encode it with the same ``tokenizers``
tokenizer (a 8192-token byte-level BPE trained once on the corpora), at equal worker counts:
plait with ``workers=W`` (spawned processes, batches written in order), datasets with
``load_dataset("parquet") + map(batched=True, num_proc=W)`` writing its Arrow cache. Each run is
a fresh subprocess; the runs alternate and repeat; the table prints the median seconds, MB/s of
text, the peak RSS of the main process (VmHWM; worker processes not included) and the ratio
(datasets time / plait time: > 1 means plait is faster).

    python bench/bench_prepare.py               # ~200 MB, workers 1 and 2, 2 repeats
    python bench/bench_prepare.py --mb 20 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the child's own peak RSS: VmHWM starts anew at exec (ru_maxrss would keep the forking parent's)
PEAK = "int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"

PLAIT_SIDE = """
import sys, time
from plait.data.prepare import prepare_dataset
t = time.perf_counter()
prepare_dataset(sys.argv[1], tokenizer=sys.argv[2], out_dir=sys.argv[3], progress=False, workers=int(sys.argv[4]),
                cache_dir=sys.argv[5])
print(time.perf_counter() - t, PEAK)
""".replace("PEAK", PEAK)

DATASETS_SIDE = """
import sys, time
import datasets
from tokenizers import Tokenizer
datasets.disable_progress_bars()
t = time.perf_counter()
tok = Tokenizer.from_file(sys.argv[2])
ds = datasets.load_dataset("parquet", data_files=sys.argv[1], split="train", cache_dir=sys.argv[3])

def encode(batch):
    return {"ids": [e.ids for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}

out = ds.map(encode, batched=True, batch_size=256, num_proc=int(sys.argv[4]) if int(sys.argv[4]) > 1 else None,
             remove_columns=["text"])
assert len(out) == len(ds)
print(time.perf_counter() - t, PEAK)
""".replace("PEAK", PEAK)


def _corpus(root: Path, megabytes: float) -> tuple[Path, Path]:
    """A Parquet file of ~``megabytes`` of text and a BPE trained on the corpora."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from plait.data.corpora import corpus_documents
    from plait.data.tokenizer import train_bpe

    docs = [d for name in ("shakespeare", "bible") for d in corpus_documents(name) if d.strip()]
    tok_path = root / "tokenizer.json"
    train_bpe(docs, 8192, cache_key="bench-prepare", cache_root=root).save(str(tok_path))
    # one row per paragraph-sized piece (about 2 kB), as web corpora look
    pieces = [d[i:i + 2000] for d in docs for i in range(0, len(d), 2000)]
    size, rows = 0, []
    while size < megabytes * 1e6:
        for p in pieces:
            rows.append(p)
            size += len(p)
            if size >= megabytes * 1e6:
                break
    path = root / "corpus.parquet"
    pq.write_table(pa.table({"text": rows}), path, row_group_size=4096)
    return path, tok_path


def _run(code: str, *args: str) -> tuple[float, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    seconds, rss_kb = out.stdout.strip().splitlines()[-1].split()
    return float(seconds), float(rss_kb) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="megabytes of text (default 200)")
    parser.add_argument("--workers", default="1,2", help="worker counts (default 1,2)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus, tok = _corpus(root, args.mb)
        print(f"corpus: {corpus.stat().st_size / 1e6:.0f} MB Parquet ({args.mb:.0f} MB of text), BPE 8192", flush=True)
        rows = []
        for workers in (int(w) for w in args.workers.split(",")):
            times: dict[str, list[float]] = {"plait": [], "datasets": []}
            rss: dict[str, list[float]] = {"plait": [], "datasets": []}
            for r in range(args.repeats):
                for side in ("plait", "datasets") if r % 2 == 0 else ("datasets", "plait"):
                    out = root / f"{side}-{workers}-{r}"
                    if side == "plait":
                        s, m = _run(PLAIT_SIDE, str(corpus), str(tok), str(out), str(workers), str(root / "c"))
                    else:
                        s, m = _run(DATASETS_SIDE, str(corpus), str(tok), str(out), str(workers))
                    times[side].append(s)
                    rss[side].append(m)
                    print(f"  workers {workers} {side:<8} {s:7.1f} s  peak RSS {m:7.0f} MiB", flush=True)
            p, d = statistics.median(times["plait"]), statistics.median(times["datasets"])
            rows.append((workers, p, d, max(rss["plait"]), max(rss["datasets"])))
        print("\n| workers | plait s | datasets s | plait MB/s | datasets MB/s | ratio (datasets/plait) | "
              "plait peak RSS MiB | datasets peak RSS MiB |")
        print("|---|---|---|---|---|---|---|---|")
        for workers, p, d, pm, dm in rows:
            print(f"| {workers} | {p:.1f} | {d:.1f} | {args.mb / p:.1f} | {args.mb / d:.1f} | {d / p:.2f} | "
                  f"{pm:.0f} | {dm:.0f} |")
        print(json.dumps({"rows": rows, "mb": args.mb, "time": time.time(),
                          "maxrss_parent_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
