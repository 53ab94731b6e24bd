"""Time to the first training step against the store's size, and the size of the store's bookkeeping.

Builds, with the real writer (`store.PartWriter`, `store.finalize`), a store of 1 K rows and one of 1 M rows of a
tiny random-weight Qwen3 target (features 16 wide, 64-token rows, one document per row), then in a fresh process
per store measures: `Store.open`, the data plan (held-out split, epoch order, the first step's rows), and a tiny
drafter's `Trainer` construction, warmup (`prepare`) and first step (`fit` with max_steps 1, which reads that
step's rows and saves its checkpoint).

The store format keeps one chunk file per row and array (5 files and 6 folders per row): a complete 1 M-row store
needs ~11 M inodes and ~45 GB of 4 KiB blocks, more than this CPU box has to spare. So a store of over 10 K rows
gets every array, its full documents table, progress and manifest, but row chunks only for the rows the run reads
(those of the first step, from the same plan the trainer computes); every other row is a missing chunk, which
the reader refuses. A run that read any other row at startup would therefore fail instead of looking fast.
`--full` writes every row of every store instead.

    PYTHONPATH=. .venv/bin/python bench/startup.py [--sizes 1000 1000000] [--work /tmp/dflash-startup]

Also measures the resume-path bookkeeping of a harvest at `--resume-docs` documents (default 1 M): the data
file's fingerprint, the packing plan (first-fit decreasing, offsets, documents table, counts) and re-opening a
part, on synthetic documents (a full harvest resume needs the target's forward over every row: not on a CPU).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

T, LAYERS, HIDDEN, TAP = 64, 2, 16, [1]  # token budget, tiny target's layers and width, the tapped layer
DOC_TOKENS = 48  # one document of 48 tokens per row; the rest is padding
FULL_ROWS = 10_000  # stores up to this size get every row written


def build_target(work: Path) -> Path:
    from dflash.tiny import make_tiny_target

    return make_tiny_target(work / f"target-qwen3-{LAYERS}x{HIDDEN}", "qwen3", num_layers=LAYERS, hidden_size=HIDDEN)


def header(target: Path):
    from dflash import store
    from dflash.data import load_tokenizer
    from dflash.drafter import rope_theta_of
    from dflash.manifest import TargetSpec, TokenizerSpec
    from dflash.target_files import load_config

    text = load_config(str(target)).get_text_config()
    tokenizer = load_tokenizer(str(target))
    spec = TargetSpec(
        name=str(target), model_type="qwen3", config_hash="bench", num_layers=LAYERS, hidden_size=HIDDEN,
        vocab_size=len(tokenizer), intermediate_size=text.intermediate_size,
        num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
        head_dim=text.head_dim, rms_norm_eps=text.rms_norm_eps, rope_theta=rope_theta_of(text),
        max_position_embeddings=text.max_position_embeddings,
    )  # fmt: skip
    mask = tokenizer.get_vocab()["<|MASK|>"]
    return store.new_manifest(
        target=spec,
        layer_ids=TAP,
        token_budget=T,
        tokenizer=TokenizerSpec(str(target), len(tokenizer), {"mask": mask}),
        fingerprint={"model": str(target), "token_budget": T, "world_size": 1},
    )


def train_config(path: Path, target: Path, out: Path):
    from dflash.config import TrainConfig

    return TrainConfig(
        store=str(path), out=str(out), target=str(target), draft_layers=1, block_size=4, anchors=8,
        rows_per_step=2, max_steps=1, val_fraction=0.01, tensorboard=False, export=False, reader_workers=2,
        device="cpu", compile=False,
    )  # fmt: skip


def first_step_rows(num_rows: int, cfg) -> list[int]:
    """The rows the trainer's first step (and its read-ahead) reads: the trainer's own plan."""
    from dflash.train import reader

    train, val = reader.split_rows(num_rows, cfg.val_fraction)
    plan = reader.DataPlan(train, val, cfg.rows_per_step * cfg.grad_accum, cfg.seed, 0, 1)
    rows, _ = next(plan.steps(0, cfg.max_steps))
    return sorted(int(r) for r in rows)


def build_store(path: Path, target: Path, rows: int, full: bool) -> float:
    """Write a store of `rows` rows; returns the seconds it took."""
    from dflash import store

    start = time.perf_counter()
    head = header(target)
    documents = np.zeros((rows, 5), np.int64)
    documents[:, 0] = documents[:, 2] = np.arange(rows)
    documents[:, 4] = DOC_TOKENS
    counts = {"documents": rows, "tokens": rows * DOC_TOKENS, "loss_tokens": rows * DOC_TOKENS}
    counts["padding_tokens"] = rows * T - counts["tokens"]
    store.create_store(path, head)
    writer = store.PartWriter(path, store.PartSpec(0, rows, T, head.features, documents, counts))
    wanted = range(rows) if full else first_step_rows(rows, train_config(path, target, path))
    rng = np.random.default_rng(0)
    for r in wanted:
        hidden, tokens = synthetic_row(rng, r, head.tokenizer.vocab_size)
        writer.write_rows(r, hidden[None], {name: value[None] for name, value in tokens.items()})
    writer.commit(rows)
    writer.chunk_writers["hidden"].pool.shutdown()
    assert store.finalize(path, head, check_chunks=full)  # a sparse store misses the chunks of unread rows
    return time.perf_counter() - start


def synthetic_row(rng, row: int, vocab: int) -> tuple[np.ndarray, dict]:
    import torch

    hidden = np.zeros((T, HIDDEN * len(TAP)), np.uint16)
    hidden[:DOC_TOKENS] = torch.randn(DOC_TOKENS, hidden.shape[1]).to(torch.bfloat16).view(torch.int16).numpy()
    tokens = {
        "input_ids": np.zeros(T, np.int32),
        "position_ids": np.zeros(T, np.int32),
        "doc_ids": np.full(T, -1, np.int32),
        "loss_mask": np.zeros(T, np.uint8),
    }
    tokens["input_ids"][:DOC_TOKENS] = rng.integers(0, vocab, DOC_TOKENS)
    tokens["position_ids"][:DOC_TOKENS] = np.arange(DOC_TOKENS)
    tokens["doc_ids"][:DOC_TOKENS] = row
    tokens["loss_mask"][:DOC_TOKENS] = 1
    return hidden, tokens


def measure(path: Path, target: Path) -> dict:
    """Run in a fresh process: milliseconds of each startup stage."""
    import torch

    from dflash.store import Store
    from dflash.train import Trainer, reader
    from dflash.train.metrics import MetricsLog
    from dflash.train.setup import init_distributed

    torch.set_num_threads(1)
    out = Path(tempfile.mkdtemp(prefix="dflash-startup-run-"))
    cfg = train_config(path, target, out)
    ms = {}
    t0 = time.perf_counter()
    s = Store.open(path)
    ms["open"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    train, val = reader.split_rows(s.num_rows, cfg.val_fraction)
    plan = reader.DataPlan(train, val, cfg.rows_per_step, cfg.seed, 0, 1)
    next(plan.steps(0, 1))
    ms["plan"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer = Trainer(cfg, init_distributed("cpu"))  # opens and plans again, and builds the drafter
    ms["trainer"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.prepare(None)
    ms["warmup"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.fit(0, MetricsLog(out, True, False))
    ms["first_step"] = time.perf_counter() - t0
    ms = {key: 1000 * value for key, value in ms.items()}
    ms["total"] = ms["trainer"] + ms["warmup"] + ms["first_step"]
    return ms


def bookkeeping_bytes(path: Path) -> dict:
    part = path / "parts" / "rank00000"
    documents = sum(f.stat().st_size for f in (part / "documents").rglob("*") if f.is_file())
    return {
        "manifest.json": (path / "manifest.json").stat().st_size,
        "harvest.json": (path / "harvest.json").stat().st_size,
        "progress.json": (part / "progress.json").stat().st_size,
        "documents (zarr)": documents,
    }


def resume_pieces(docs: int, work: Path) -> dict:
    """Seconds of the harvest's resume path at `docs` documents, without the target: what grows with the data."""
    from dflash import manifest, packing, store
    from dflash.data import Document, sources

    lengths = np.random.default_rng(0).integers(16, 3000, docs)  # a 4096-token budget: a few documents per row
    ids, mask = np.ones(3000, np.int32), np.ones(3000, np.uint8)  # views of these: no 10 GB of documents
    documents = [Document(i, 0, ids[:n], mask[:n]) for i, n in enumerate(lengths.tolist())]
    data = work / "resume-data.jsonl"
    if not data.exists():  # ~1 KB per line, as a short chat
        line = json.dumps(
            {"messages": [{"role": "user", "content": "x" * 400}, {"role": "assistant", "content": "y" * 600}]}
        )
        data.write_text((line + "\n") * docs)
    seconds = {}
    t0 = time.perf_counter()
    sources.identity(str(data))
    seconds["data sha256"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    packing.first_fit_decreasing(lengths.tolist(), 4096)
    seconds["first-fit decreasing"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = packing.PartPlan.build(documents, 0, 1, 4096)
    seconds["PartPlan.build"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    table = plan.documents_table()
    seconds["documents table"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    counts = plan.counts()
    seconds["counts"] = time.perf_counter() - t0
    out = work / "resume-store"
    head = store.new_manifest(
        target=manifest.TargetSpec("bench", "qwen3", "bench", 1, 8, 16),
        layer_ids=[0],
        token_budget=4096,
        tokenizer=manifest.TokenizerSpec("bench", 16, {}),
        fingerprint={"model": "bench", "world_size": 1},
    )
    if not out.exists():
        store.create_store(out, head)
        store.PartWriter(out, store.PartSpec(0, len(plan.rows), 4096, head.features, table, counts))
    t0 = time.perf_counter()
    store.PartWriter(out, store.PartSpec(0, len(plan.rows), 4096, head.features, table, counts))
    seconds["PartWriter (resume)"] = time.perf_counter() - t0
    seconds["rows"] = len(plan.rows)
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 1_000_000])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dflash-startup")
    parser.add_argument("--full", action="store_true", help="write every row of every size (~11 inodes per row)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per store; the best is shown")
    parser.add_argument("--resume-docs", type=int, default=1_000_000, help="0: skip the harvest resume pieces")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # internal: one fresh-process measurement
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    target = build_target(args.work)
    if args.measure:
        print(json.dumps(measure(args.measure, target)))
        return
    results = {}
    for rows in args.sizes:
        path = args.work / f"store-{rows}{'-full' if args.full else ''}"
        if not (path / "manifest.json").exists():
            print(f"writing {path} ({rows} rows) ...", flush=True)
            print(f"  {build_store(path, target, rows, args.full or rows <= FULL_ROWS):.1f} s", flush=True)
        runs = [fresh_measure(path, args.work) for _ in range(args.repeats)]
        results[rows] = {key: min(run[key] for run in runs) for key in runs[0]}
        results[rows]["bytes"] = bookkeeping_bytes(path)
    print_table(results)
    if args.resume_docs:
        print(f"\nharvest resume path at {args.resume_docs} documents (seconds):")
        for key, value in resume_pieces(args.resume_docs, args.work).items():
            print(f"  {key:24s} {value:10.3f}" if isinstance(value, float) else f"  {key:24s} {value:10d}")


def fresh_measure(path: Path, work: Path) -> dict:
    command = [sys.executable, __file__, "--work", str(work), "--measure", str(path)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(results: dict):
    stages = ["open", "plan", "trainer", "warmup", "first_step", "total"]
    print(f"\n{'rows':>9} " + " ".join(f"{s + ' ms':>14}" for s in stages))
    for rows, ms in results.items():
        print(f"{rows:>9} " + " ".join(f"{ms[s]:14.1f}" for s in stages))
    sizes = list(results)
    if len(sizes) > 1:
        small, large = results[sizes[0]], results[sizes[-1]]
        print(f"{'ratio':>9} " + " ".join(f"{large[s] / small[s]:14.2f}" for s in stages))
    for rows, ms in results.items():
        print(f"bookkeeping at {rows} rows/documents: " + ", ".join(f"{k} {v:,} B" for k, v in ms["bytes"].items()))


if __name__ == "__main__":
    main()
