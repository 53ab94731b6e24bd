"""Tokenization throughput of `dflash.data.load_documents` against its worker count.

Writes `--docs` synthetic conversations (default 1 M) to a JSONL file: 1 to 3 user / assistant turns whose
contents are drawn from the bundled corpus's messages, about 2 KB and ~500 tokens a conversation. Trains a
byte-level BPE tokenizer of `--vocab` tokens with the Qwen-style chat template (`dflash.tiny.build_tokenizer`),
then times `load_documents(DataConfig(path, workers=W), tokenizer)` (read, validate, render the template,
tokenize, mask the assistant turns) for each W and prints documents/s and tokens/s, and the seconds of the
same call on W documents (starting the pool): the part of the time that does not grow with the data.

    PYTHONPATH=. .venv/bin/python bench/tokenization.py [--docs 1000000] [--workers 1 2]

(Not bench/tokenize.py: a script's folder comes first on sys.path, and that name would shadow the standard
library's `tokenize` for every script in bench/.)
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def write_conversations(path: Path, docs: int, seed: int = 0) -> None:
    from dflash.tiny import corpus_texts

    texts = corpus_texts()
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for n in range(docs):
            turns = int(rng.integers(1, 4))
            picks = rng.integers(0, len(texts), 2 * turns).tolist()
            messages = [
                {"role": "user" if i % 2 == 0 else "assistant", "content": texts[pick]} for i, pick in enumerate(picks)
            ]
            messages[0]["content"] += f" (request {n})"  # no two alike: a deduplicating reader keeps every one
            f.write(json.dumps({"messages": messages}) + "\n")


def save_tokenizer(folder: Path, vocab: int) -> Path:
    from dflash.tiny import build_tokenizer

    if not (folder / "tokenizer.json").exists():
        build_tokenizer(vocab).save_pretrained(folder)
    return folder


def measure(data: Path, tokenizer: Path, workers: int) -> dict:
    """Seconds, documents/s and tokens/s of one load_documents call; `startup`: the seconds of a call on as many
    documents as workers (starting the pool, each worker loading the tokenizer), a cost that does not grow."""
    from dflash.data import DataConfig, load_documents

    few = data.with_name(f"{data.stem}-first{workers}.jsonl")
    with open(data) as f:
        few.write_text("".join(next(f) for _ in range(workers)))
    times = []
    for path in (few, data):
        start = time.perf_counter()
        documents, _ = load_documents(DataConfig(path, workers=workers), str(tokenizer))
        times.append(time.perf_counter() - start)
    startup, seconds = times
    tokens = sum(len(d.input_ids) for d in documents)
    return {"startup": startup, "seconds": seconds, "docs/s": len(documents) / seconds, "tokens/s": tokens / seconds}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--workers", type=int, nargs="+", help="worker counts to time (default: 1 .. cores)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dflash-tokenize")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / f"conversations-{args.docs}.jsonl"
    if not data.exists():
        start = time.perf_counter()
        write_conversations(data, args.docs)
        print(f"wrote {data} ({data.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - start:.0f} s", flush=True)
    tokenizer = save_tokenizer(args.work / f"tokenizer-{args.vocab}", args.vocab)
    print(f"{args.docs} conversations, vocab {args.vocab}, {os.cpu_count()} cores")
    print(f"{'workers':>7} {'startup s':>9} {'seconds':>9} {'docs/s':>9} {'tokens/s':>10} {'speedup':>8}", flush=True)
    first = None
    for workers in args.workers or range(1, (os.cpu_count() or 1) + 1):
        r = measure(data, tokenizer, workers)
        first = first or r["docs/s"]
        print(
            f"{workers:7d} {r['startup']:9.1f} {r['seconds']:9.1f} {r['docs/s']:9.0f} {r['tokens/s']:10.0f} "
            f"{r['docs/s'] / first:8.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
