"""Train throughput on the GPU: the real trainer (compiled, whole step in one CUDA graph) fed through the real
reader from a synthetic store, and the same step without the CUDA graph, timed in the same process.

Two drafters of issue 3, both 5 layers, block size 16, vocabulary 248320, one row per step of 4 documents of
3072 tokens (token budget 12288), 512 anchors per document (2048 per row, 32768 block tokens):
    a: 27B-class target of shared/DEVICE.md: hidden 5120, 24 / 4 heads of 256, FFN 17408
    b: 4B-class target: hidden 2560, 16 / 4 heads of 256, FFN 9216

On the H200 (from the repository root; `.device-wheels/` carried along, see bench/device_setup.sh):

    source bench/device_setup.sh && python3 bench/train.py --drafter both --json $OUT/train.json
    python bench/train.py --tiny            # toy shapes: checks the script on the CPU in well under a minute

The data is written through the real store writer (`PartWriter`, random bf16 features, random token ids,
documents of 3072 tokens, loss mask on everywhere) into --work, with a fake target folder next to it holding
only config.json and the embedding / LM head; both are reused by a later run with the same shapes. The store
holds --rows rows (default 16), so the steps cycle through it in epochs (rows come from the page cache).

Per drafter, the table reports the steady window of the issue (steps 10-50, clipped to --steps):
- context / drafted tok/s, MFU and step time: time-weighted over the window, from the trainer's own metrics
  (`dflash.train.Meter`, one record per step); MFU counts trainable matmuls 3x, the frozen LM head 2x and
  attention 3.5 x 4 x visible pairs x heads x head_dim, against 792 TFLOP/s (docs/training.md);
- peak memory: torch.cuda max_memory_allocated / max_memory_reserved from construction to the last step
  (warmup and capture included), in GB (1e9 bytes);
- memory spread: max - min of memory_allocated and of memory_reserved over the window's records, in bytes;
- recompiles (dynamo graphs compiled after warmup), data wait (share of the window spent waiting for rows);
- ungraphed: after the graphed steps, both graphs are released and `Trainer.train_step.step` (the same
  compiled step function, same buffers, no CUDA graph) is timed; its MFU is the graphed MFU x the step ratio.
The trainer's final checkpoint is skipped (for drafter a it would write 22 GB of weights and optimizer state).
"""

import argparse
import datetime
import gc
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's dflash

from dflash import graph, loss, store
from dflash import train as trainer_module
from dflash.errors import DflashError
from dflash.target import default_layer_ids
from dflash.train import MetricsLog, TrainConfig, Trainer, init_distributed

WINDOW = (10, 50)  # steps whose records the summary uses (the issue's "steps 10-50")

# Drafter shapes: the target's width, heads and FFN (the drafter copies them) and the document layout.
ROW = dict(doc_len=3072, docs_per_row=4, anchors_per_doc=512, vocab=248320)
DRAFTERS = {
    "a": dict(hidden=5120, heads=24, kv_heads=4, head_dim=256, ffn=17408, target_layers=64, **ROW),
    "b": dict(hidden=2560, heads=16, kv_heads=4, head_dim=256, ffn=9216, target_layers=32, **ROW),
}
TINY_ROW = dict(doc_len=64, docs_per_row=4, anchors_per_doc=8, vocab=512)
TINY = {
    "a": dict(hidden=128, heads=4, kv_heads=2, head_dim=32, ffn=256, target_layers=8, **TINY_ROW),
    "b": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, target_layers=8, **TINY_ROW),
}


# ---------------------------------------------------------------------------------------------- synthetic data


def fake_target(folder: Path, s: dict, device: torch.device):
    """A target folder with only config.json and the embedding / LM head (all the trainer reads of a target)."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    folder.mkdir(parents=True, exist_ok=True)
    Qwen3Config(
        hidden_size=s["hidden"], intermediate_size=s["ffn"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], num_hidden_layers=s["target_layers"],
        vocab_size=s["vocab"], tie_word_embeddings=False,
    ).save_pretrained(folder)  # fmt: skip
    g = torch.Generator(device).manual_seed(0)

    def weight():
        w = torch.randn(s["vocab"], s["hidden"], device=device, generator=g, dtype=torch.bfloat16)
        return (w * 0.02).cpu()

    save_file({"model.embed_tokens.weight": weight(), "lm_head.weight": weight()}, folder / "model.safetensors")


def store_header(target: Path, s: dict) -> dict:
    """harvest.json as a harvest of the fake target would write it (the fields the trainer reads)."""
    layers = default_layer_ids(s["target_layers"])
    return {
        "format": "dflash-harvest",
        "format_version": store.FORMAT_VERSION,
        "fingerprint": {"model": str(target), "layers": layers, "world_size": 1},
        "target": {
            "name": str(target), "model_type": "qwen3", "config_hash": "synthetic", "hidden_size": s["hidden"],
            "num_layers": s["target_layers"], "vocab_size": s["vocab"],
        },  # fmt: skip
        "layer_ids": layers,
        "feature_dim": len(layers) * s["hidden"],
        "dtype": "bfloat16",
        "token_budget": s["doc_len"] * s["docs_per_row"],
        "tokenizer": {"special_ids": {"mask": s["vocab"] - 1}},
    }


def synthetic_store(out: Path, target: Path, s: dict, rows: int, device: torch.device):
    """`rows` rows of `docs_per_row` whole documents each, written through the real part writer."""
    header = store_header(target, s)
    T, F, L, D = header["token_budget"], header["feature_dim"], s["doc_len"], s["docs_per_row"]
    documents = np.array([[r * D + d, 0, r, d * L, L] for r in range(rows) for d in range(D)], np.int64)
    counts = {"documents": rows * D, "tokens": rows * T, "loss_tokens": rows * T, "padding_tokens": 0}
    store.create_store(out, header)
    part = store.PartWriter(out, store.PartSpec(0, rows, T, F, documents, counts))
    g = torch.Generator(device).manual_seed(1)
    rng = np.random.default_rng(1)
    for r in range(rows):
        hidden = torch.randn(T, F, device=device, generator=g, dtype=torch.bfloat16)
        tokens = {
            "input_ids": rng.integers(0, s["vocab"] - 1, (1, T), dtype=np.int32),  # never the mask token
            "position_ids": (np.arange(T) % L)[None].astype(np.int32),
            "doc_ids": (r * D + np.arange(T) // L)[None].astype(np.int32),
            "loss_mask": np.ones((1, T), np.uint8),
        }
        part.write_rows(r, hidden.view(torch.int16).cpu().numpy().view(np.uint16)[None], tokens)
    part.commit(rows)
    if not store.finalize(out, 1, header):
        raise RuntimeError(f"the synthetic store at {out} did not complete")


def prepare_data(root: Path, s: dict, rows: int, device: torch.device) -> float:
    """Fake target + store under `root`, reused when a previous run made them with the same shapes."""
    spec = {**s, "rows": rows}
    done = root / "spec.json"
    if done.exists() and json.loads(done.read_text()) == spec:
        return 0.0
    t0 = time.perf_counter()
    shutil.rmtree(root, ignore_errors=True)
    fake_target(root / "target", s, device)
    synthetic_store(root / "store", root / "target", s, rows, device)
    done.write_text(json.dumps(spec))  # last: marks both complete
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- measurement


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weighted(records: list[dict], key: str) -> float | None:
    """Mean of a per-record rate weighted by the record's time (= total over total time)."""
    if not records or records[0].get(key) is None:
        return None
    return sum(r[key] * r["step_ms"] for r in records) / sum(r["step_ms"] for r in records)


def release_graphs(trainer: Trainer):
    """Drop the captured graphs (and their memory pool), so that the ungraphed step runs in their place."""
    for step in (trainer.train_step, trainer.val_step):
        if step.graph is not None:
            step.graph.reset()
            step.graph = None
    gc.collect()
    if trainer.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(trainer.device)


def time_ungraphed(trainer: Trainer, steps: int) -> dict:
    """The same step function the graph captured, called directly on the same static buffers."""
    release_graphs(trainer)
    before = graph.compiled_graphs()
    with graph.no_recompiles():
        for _ in range(2):  # allocator warm-up outside the graph pool
            trainer.train_step.step()
        sync(trainer.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step.step()
        sync(trainer.device)
    out = {"step_ms": 1000 * (time.perf_counter() - t0) / steps, "recompiles": graph.compiled_graphs() - before}
    if trainer.cuda:
        out["peak_allocated_GB"] = torch.cuda.max_memory_allocated(trainer.device) / 1e9
        out["peak_reserved_GB"] = torch.cuda.max_memory_reserved(trainer.device) / 1e9
    return out


def summarise(name: str, s: dict, trainer: Trainer, records: list[dict], steps: int) -> dict:
    lo, hi = WINDOW[0], min(WINDOW[1], steps)
    window = [r for r in records if lo <= r["step"] <= hi] or records[-1:]
    T, A = s["doc_len"] * s["docs_per_row"], trainer.num_anchors
    result = {
        "drafter": name,
        "shape": dict(s),
        "row": {"context": T, "anchors": A, "block_tokens": A * trainer.cfg.block_size},
        "params_M": sum(p.numel() for p in trainer.params) / 1e6,
        "loss_chunk": trainer.cfg.loss_chunk or loss.default_chunk_size(s["vocab"]),
        "window": [window[0]["step"], window[-1]["step"]],
        "context_tok_s": weighted(window, "context_tok_s"),
        "drafted_tok_s": weighted(window, "drafted_tok_s"),
        "mfu": weighted(window, "mfu"),
        "step_ms": sum(r["step_ms"] for r in window) / len(window),
        "data_wait": weighted(window, "data_wait"),
        "recompiles": records[-1]["recompiles"],
        "loss_first_last": [records[0]["loss"], records[-1]["loss"]],
    }
    if trainer.cuda:
        allocated = [r["mem_allocated"] for r in window]
        reserved = [r["mem_reserved"] for r in window]
        result.update(
            peak_allocated_GB=torch.cuda.max_memory_allocated(trainer.device) / 1e9,
            peak_reserved_GB=torch.cuda.max_memory_reserved(trainer.device) / 1e9,
            allocated_spread=max(allocated) - min(allocated),
            reserved_spread=max(reserved) - min(reserved),
        )
    return result


def bench_one(name: str, s: dict, args, device: torch.device) -> dict:
    root = Path(args.work) / (f"tiny-{name}" if args.tiny else name)
    build_s = prepare_data(root, s, args.rows, device)
    run = root / "run"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    cfg = TrainConfig(
        shards=str(root / "store"), out=str(run), target=str(root / "target"),
        anchors=s["anchors_per_doc"] * s["docs_per_row"], loss_chunk=args.loss_chunk,
        max_steps=args.steps, val_fraction=0.0, log_every=1, ckpt_every=10**9, export=False, tensorboard=False,
        device=str(device), cuda_graph=True,
    )  # fmt: skip
    if device.type == "cuda":  # the peaks below count the trainer alone, not the data generation
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = Trainer(cfg, init_distributed(cfg.device))
    prep = trainer.prepare(None)
    log = MetricsLog(run, True, False)
    try:
        with mock.patch.object(trainer_module, "save_checkpoint", lambda trainer, step: None):
            result = trainer.fit(0, log)
    finally:
        log.close()
    summary = summarise(name, s, trainer, result["records"], args.steps)
    summary.update(data_build_s=build_s, warmup_capture_s=prep["total_s"], warmup_parts_s=prep)
    try:
        summary["ungraphed"] = time_ungraphed(trainer, args.ungraphed_steps)
    except torch.OutOfMemoryError:  # keep the graphed numbers
        summary["ungraphed"] = {"error": "out of memory"}
    if summary["mfu"] is not None and "step_ms" in summary["ungraphed"]:
        summary["ungraphed"]["mfu"] = summary["mfu"] * summary["step_ms"] / summary["ungraphed"]["step_ms"]
    summary["records"] = result["records"]
    return summary


def free_device(device: torch.device):
    """Between drafters: drop compiled code and cached blocks so that the next one starts from a clean device."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- report


def versions(device: torch.device) -> dict:
    import numcodecs
    import transformers
    import zarr

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU)"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "zarr": zarr.__version__, "numcodecs": numcodecs.__version__, "gpu": gpu,
    }  # fmt: skip


def fmt(value, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{unit}"


HEADER = (
    "| drafter | context / anchors / block tokens | ctx tok/s | drafted tok/s | MFU | step ms "
    "| peak alloc / reserved GB | alloc / reserved spread (B) | recompiles | data wait "
    "| ungraphed step ms | ungraphed MFU | ungraphed peak alloc GB |"
)


def table_row(r: dict) -> str:
    if "error" in r:
        return f"| {r['drafter']} | failed: {r['error']} |"
    u, row = r["ungraphed"], r["row"]
    spread = "-" if "allocated_spread" not in r else f"{r['allocated_spread']} / {r['reserved_spread']}"
    peak = "-" if "peak_allocated_GB" not in r else f"{r['peak_allocated_GB']:.1f} / {r['peak_reserved_GB']:.1f}"
    return (
        f"| {r['drafter']} | {row['context']} / {row['anchors']} / {row['block_tokens']} "
        f"| {fmt(r['context_tok_s'], ',.0f')} | {fmt(r['drafted_tok_s'], ',.0f')} | {fmt(r['mfu'], '.1f', 100, ' %')} "
        f"| {r['step_ms']:.1f} | {peak} | {spread} | {r['recompiles'] + u.get('recompiles', 0)} "
        f"| {fmt(r['data_wait'], '.2f', 100, ' %')} "
        f"| {fmt(u.get('step_ms'), '.1f')} | {fmt(u.get('mfu'), '.1f', 100, ' %')} "
        f"| {fmt(u.get('peak_allocated_GB'), '.1f')} |"
    )


def report(info: dict, results: list[dict], args):
    print(f"\n## bench/train.py {'--tiny ' if args.tiny else ''}--drafter {args.drafter} --steps {args.steps}")
    print(", ".join(f"{k} {v}" for k, v in info.items()))
    for r in results:
        if "error" not in r:
            print(
                f"{r['drafter']}: {r['params_M']:.1f} M trainable parameters, loss chunk {r['loss_chunk']}, "
                f"window steps {r['window'][0]}-{r['window'][1]}, data built in {r['data_build_s']:.1f} s, "
                f"warmup + capture {r['warmup_capture_s']:.1f} s, "
                f"loss {r['loss_first_last'][0]:.3f} -> {r['loss_first_last'][1]:.3f}"
            )
    print("\n" + HEADER)
    print("|" + "---|" * HEADER.count(" |"))
    for r in results:
        print(table_row(r))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", choices=["a", "b", "both"], default="both")
    parser.add_argument("--steps", type=int, help="train steps per drafter (window: 10-50)  [default: 60, tiny 20]")
    parser.add_argument("--ungraphed-steps", type=int, help="timed steps without the graph  [default: 10, tiny 3]")
    parser.add_argument("--tiny", action="store_true", help="toy shapes (runs on the CPU in well under a minute)")
    parser.add_argument("--rows", type=int, default=16, help="rows in the synthetic store (steps cycle through it)")
    parser.add_argument("--loss-chunk", type=int, help="LM-head rows per loss chunk  [default: the trainer's]")
    parser.add_argument("--work", default="/tmp/dflash-bench-train", help="where the fake target, store and runs go")
    parser.add_argument("--json", help="also write the results (with every step's record) here")
    args = parser.parse_args()
    if min(args.steps or 1, args.ungraphed_steps or 1, args.rows) < 1:
        parser.error("--steps, --ungraphed-steps and --rows must be at least 1")
    args.steps = args.steps or (20 if args.tiny else 60)
    args.ungraphed_steps = args.ungraphed_steps or (3 if args.tiny else 10)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("dflash").setLevel(logging.INFO)  # the trainer's line per step

    device = init_distributed(None).device
    if args.tiny and device.type == "cpu":
        torch.set_num_threads(1)  # toy matmuls gain nothing from threads, and a busy machine makes them spin
    info = versions(device)
    print(", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    shapes = TINY if args.tiny else DRAFTERS
    results = []
    for name in ["a", "b"] if args.drafter == "both" else [args.drafter]:
        try:
            results.append(bench_one(name, shapes[name], args, device))
        except (DflashError, torch.OutOfMemoryError) as exc:  # report it and go on with the other drafter
            logging.exception("drafter %s failed", name)
            results.append({"drafter": name, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"})
        free_device(device)  # here, after the except block has dropped the failed trainer's frames
        # After each drafter, so that a run stopped at a time limit keeps the drafters that finished.
        print(f"RESULT {table_row(results[-1])}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"versions": info, "args": vars(args), "results": results}, indent=1))
    report(info, results, args)
    if any("error" in r for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
