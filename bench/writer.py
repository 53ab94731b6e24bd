"""How much the store writer slows the thread that launches the target's kernels (CPU only, no GPU needed).

A harvest writes rows from a writer thread while the main thread launches the forward's kernels; whatever the
writer does while holding the GIL delays those launches. This measures the rate of tiny torch ops (a stand-in
for kernel launches) on the main thread alone and while a writer thread writes rows of bf16 features, once
through zarr's own write path and once through the store's chunk writer (`store.HiddenChunkWriter`), and the
writer's throughput in each case.

    python bench/writer.py --rows 8 --token-budget 2048 --feature-dim 25600 --threads 1

`--threads` caps both writers' worker threads (zarr's `threading.max_workers`, the chunk writer's pool); with
one, a 2-core machine keeps a core for each side, so the comparison measures the GIL, not core contention.
"""

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import zarr

from dflash import store
from dflash.manifest import TargetSpec, TokenizerSpec


def op_rate(seconds: float, until=None) -> float:
    """Tiny in-place torch ops per second on this thread, for `seconds` or while `until()` is true."""
    x, n, start = torch.zeros(4), 0, time.perf_counter()
    while until() if until else time.perf_counter() - start < seconds:
        for _ in range(100):
            x.add_(1)
        n += 100
    return n / (time.perf_counter() - start)


def part_writer(out: Path, rows: int, T: int, F: int) -> store.PartWriter:
    header = store.new_manifest(
        target=TargetSpec("bench", "bench", "bench", num_layers=1, hidden_size=F, vocab_size=1),
        layer_ids=[0],
        token_budget=T,
        tokenizer=TokenizerSpec("bench", 1, {}),
        fingerprint={"model": "bench", "world_size": 1},
    )
    store.create_store(out, header)
    counts = {"documents": 0, "tokens": 0, "loss_tokens": 0, "padding_tokens": 0}
    return store.PartWriter(out, store.PartSpec(0, rows, T, header.features, np.zeros((0, 5), np.int64), counts))


def measure(write, hidden: np.ndarray) -> tuple[float, float]:
    """(main-thread op rate while `write(hidden)` runs on a thread, writer GB/s)."""
    seconds = []
    thread = threading.Thread(target=lambda: seconds.append(_timed(write, hidden)))
    thread.start()
    rate = op_rate(0, until=thread.is_alive)
    thread.join()
    return rate, hidden.nbytes / seconds[0] / 1e9


def _timed(write, hidden) -> float:
    start = time.perf_counter()
    write(hidden)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--feature-dim", type=int, default=25600, help="n layers x hidden (5 x 5120 for 27B)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="worker threads of each writer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    activations = rng.standard_normal((args.rows, args.token_budget, args.feature_dim), dtype=np.float32)
    hidden = torch.from_numpy(activations * 0.1).bfloat16().view(torch.int16).numpy().view(np.uint16)
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-writer-"))
    part = part_writer(work / "store", args.rows, args.token_budget, args.feature_dim)
    features = store.FeatureSpec("bf16", args.feature_dim, 0, None)
    chunk_writer = store.HiddenChunkWriter(
        part.arrays["hidden"], part.chunk_writers["hidden"].folder, features, threads=args.threads
    )
    writers = {
        "zarr write path": lambda h: part.arrays["hidden"].__setitem__(slice(0, len(h)), h),
        "store.HiddenChunkWriter": lambda h: chunk_writer.write_rows(0, h),
    }
    alone = op_rate(2.0)
    print(f"{hidden.nbytes / 1e9:.2f} GB of bf16 features per write, main-thread op rate alone {alone:,.0f}/s\n")
    print("| writer | main-thread op rate while writing | writer GB/s |")
    print("|---|---|---|")
    for name, write in writers.items():
        with zarr.config.set({"threading.max_workers": args.threads}):
            results = [measure(write, hidden) for _ in range(args.repeats)]
        rate, gbs = np.median([r for r, _ in results]), np.median([g for _, g in results])
        print(f"| {name} | {100 * rate / alone:.0f} % | {gbs:.2f} |")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
