"""Read throughput of the trainer's row path against zarr's own reads, on the same store.

The store is bench/train.py's synthetic one, rewritten in --work each run (random bf16 features compress about
as real activations do, ratio ~1.3 with blosc-lz4 + bit shuffle), here with the quality run's row shape by
default: 4096 tokens x 5 layers x hidden 512, one 21 MB chunk per row. Rows come from the page cache (one
untimed pass first), so this measures decoding and copies, not the disk. Per method and thread count: rows/s
and GB/s of hidden features, each thread reading whole rows into its own destination row as the trainer's
reader threads do:
    zarr:   plain zarr reads of the row's five arrays, then a copy into the destination (what any reader
            written with zarr alone does);
    direct: `Store.read_row_into` (the trainer's path now: chunk file, CRC32C, blosc / zstd into place,
            for the hidden states and the token arrays alike).
With --row-reader, also the trainer's own `RowReader` at one row a step (long rows: issue 24), each batch held
until the next one arrives as the trainer's device feed holds it, with --prefetch steps read ahead:
    rows whole:  each row read by one thread (the reader before 2026-12-03);
    rows pieces: each row read by all threads, each an interleaved set of its chunks (the reader now).

    .venv/bin/python bench/reader.py --rows 4 --token-budget 65536 --row-reader --prefetch 1   # rows of 335 MB

    .venv/bin/python bench/reader.py                                   # CPU
    source bench/device_setup.sh && python3 bench/reader.py --threads 1,2,4,8 --json $OUT/reader.json
"""

import argparse
import json
import os
import platform
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's dflash

from bench.synthetic import synthetic_store  # noqa: E402
from bench.train_report import versions  # noqa: E402  (after the path insert)
from dflash import store  # noqa: E402
from dflash.train import reader  # noqa: E402


def destinations(opened: store.Store) -> dict[str, np.ndarray]:
    T, F = opened.token_budget, opened.feature_dim
    return {"hidden": np.empty((T, F), np.int16), **{n: np.empty(T, d) for n, d in store.TOKEN_ARRAYS.items()}}


def zarr_read_into(opened: store.Store, i: int, out: dict[str, np.ndarray]) -> None:
    part, row = opened.locate(i)
    for name, target in out.items():
        value = opened.parts[part][name][row]
        np.copyto(target, value.view(target.dtype) if name == "hidden" else value, casting="unsafe")


def rows_per_second(read, opened: store.Store, threads: int, passes: int) -> float:
    local = threading.local()

    def one(i: int):
        if not hasattr(local, "out"):
            local.out = destinations(opened)
        read(opened, i, local.out)

    rows = list(range(opened.num_rows))
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, rows))  # warm: page cache, zarr's metadata, each thread's buffers
        start = time.perf_counter()
        for _ in range(passes):
            list(pool.map(one, rows))
        return passes * len(rows) / (time.perf_counter() - start)


def row_reader_rows_per_second(opened: store.Store, threads: int, passes: int, prefetch: int, pieces) -> float:
    """Rows a second through the trainer's RowReader, one row a step; each batch is released when the next one
    is taken (the device feed's order: a batch's buffers return once the next one is staged)."""
    shape = reader.BatchShape(1, 1, reader.row_fields(opened.row_layout))
    steps = [(np.array([i % opened.num_rows]), np.zeros(1, np.int64)) for i in range((passes + 1) * opened.num_rows)]
    rows = reader.RowReader(opened, steps, shape, depth=prefetch, workers=threads, pieces=pieces)
    try:
        held = None
        for k in range(len(steps)):
            if k == opened.num_rows:  # the first pass warms the page cache and the threads
                start = time.perf_counter()
            batch = rows.next()
            if held is not None:
                held.release()
            held = batch
        held.release()
        return passes * opened.num_rows / (time.perf_counter() - start)
    finally:
        rows.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="comma-separated reader thread counts")
    parser.add_argument("--rows", type=int, default=32, help="rows in the synthetic store")
    parser.add_argument("--passes", type=int, default=4, help="timed passes over all rows")
    parser.add_argument("--hidden", type=int, default=512, help="target hidden size (5 tapped layers)")
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--row-reader", action="store_true", help="also time the trainer's RowReader, one row a step")
    parser.add_argument("--prefetch", type=int, default=2, help="the RowReader's steps read ahead (TrainConfig's)")
    parser.add_argument("--work", default="/tmp/dflash-bench-reader", help="where the synthetic store goes")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    # The store's rows only; the drafter fields are recorded in the manifest, never used here.
    shape = dict(
        hidden=args.hidden,
        target_layers=8,
        vocab=8192,
        doc_len=args.token_budget // 4,
        docs_per_row=4,
        heads=8,
        kv_heads=2,
        head_dim=args.hidden // 8,
        ffn=3 * args.hidden,
    )
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    start = time.perf_counter()
    synthetic_store(work / "store", work / "no-target", shape, args.rows, torch.device("cpu"), "bf16")
    write_s = time.perf_counter() - start
    opened = store.Store.open(work / "store")
    row_gb = opened.token_budget * opened.feature_dim * 2 / 1e9
    hidden_on_disk = sum(store.disk_bytes(p) for p in (work / "store" / "parts").glob("*/hidden"))
    info = {
        **versions(torch.device("cpu")),
        "machine": platform.node(),
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "rows": opened.num_rows,
        "row": f"{opened.token_budget} x {opened.feature_dim}",
        "row_MB": round(row_gb * 1e3, 1),
        "hidden_ratio": round(opened.num_rows * row_gb * 1e9 / hidden_on_disk, 3),
        "store_write_s": round(write_s, 1),
        "prefetch": args.prefetch,
    }
    print(", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    print(f"{'method':<12} {'threads':>7} {'rows/s':>8} {'GB/s':>6}")
    results = []

    def report(method: str, threads: int, rate: float):
        results.append({"method": method, "threads": threads, "rows_s": rate, "GB_s": rate * row_gb})
        print(f"{method:<12} {threads:>7} {rate:>8.1f} {rate * row_gb:>6.2f}", flush=True)

    for threads in [int(t) for t in args.threads.split(",")]:
        for method, read in [("zarr", zarr_read_into), ("direct", store.Store.read_row_into)]:
            report(method, threads, rows_per_second(read, opened, threads, args.passes))
        for method, pieces in [("rows whole", 1), ("rows pieces", None)] if args.row_reader else []:
            report(method, threads, row_reader_rows_per_second(opened, threads, args.passes, args.prefetch, pieces))
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "results": results}, indent=1))


if __name__ == "__main__":
    main()
