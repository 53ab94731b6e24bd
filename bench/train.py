"""Train throughput on the GPU: the real trainer (compiled, whole step in one CUDA graph) fed through the real
reader from a synthetic store, and the same step without the CUDA graph, timed in the same process.

Two drafters of issue 3, both 5 layers, block size 16, vocabulary 248320, one row per step of 4 documents of
3072 tokens (token budget 12288), 512 anchors per document (2048 per row, 32768 block tokens):
    a: 27B-class target of shared/DEVICE.md: hidden 5120, 24 / 4 heads of 256, FFN 17408
    b: 4B-class target: hidden 2560, 16 / 4 heads of 256, FFN 9216

On the H200 (from the repository root; `.device-wheels/` carried along, see bench/device_setup.sh):

    source bench/device_setup.sh && python3 bench/train.py --drafter both --json $OUT/train.json
    python bench/train.py --tiny            # toy shapes: checks the script on the CPU in well under a minute

Multi-GPU scaling: one process per GPU under torchrun (NCCL; gloo on the CPU), next to a one-GPU run:

    python3 bench/train.py --drafter b --json $OUT/train1.json
    python3 -m torch.distributed.run --standalone --nproc-per-node N bench/train.py --drafter b \
        --json $OUT/train2.json --compare-to $OUT/train1.json
    python bench/train.py --tiny --json /tmp/t1.json     # the same on the CPU with toy shapes: one process,
    torchrun --nproc-per-node 2 bench/train.py --tiny --json /tmp/t2.json --compare-to /tmp/t1.json  # 2 gloo ranks

Attention kernels (issue 24): --flex-options times each drafter once per set of flex_attention kernel options
(TrainConfig.attention_kernel_options; the key "mask_tile_size" sets TrainConfig.mask_tile_size instead), one table
row each. `sweep` is FLEX_SWEEP below, candidates for head_dim 256 on the H200 from torch 2.13's sm90 tables; a set
replaces the trainer's default whole, so each candidate past `torch` is the default with one thing changed:
    default             the trainer's on CUDA (dflash.drafter.attention.CUDA_KERNEL_OPTIONS): torch's tiles, the backward on 8 warps,
                        TMA loads; BlockMask tiles by head dim (attention.default_mask_tile: 64 at the drafters' 256)
    torch               torch's choice: forward 64 x 32, 3 stages, 4 warps; backward 64 x 64 x 64 x 64, 2 stages, 4 warps
    bwd-1stage-8warps   the backward in 1 stage (what torch takes on sm100 past head_dim 192)
    bwd-32x64-3stages   backward BLOCK_M1 32, N1 64, M2 64, N2 32, 3 stages (torch's max-autotune pattern (M, N, N, M))
    fwd-8warps          the forward on 8 warps too
    no-tma              without USE_TMA (Hopper's tensor memory accelerator for the loads): the default until 2026-12-03
    tile128             BlockMask tiles of 128 (torch's) instead of 64 at head_dim 256 (less of the sparse mask skipped)
Each set compiles the step anew; keep a call under the 10-minute limit with fewer steps:

    python3 bench/train.py --drafter b --flex-options sweep --steps 30 --ungraphed-steps 3 --json $OUT/flex.json
    python3 bench/train.py --drafter b --row-shapes 1x32768:2048 --flex-options '{};{"bwd_num_warps": 4}'
    python3 bench/train.py --drafter b --row-shapes 1x32768:2048 --methods dflash,dflash-window2048,dflash2,dflash2-full
    python3 bench/train.py --drafter a --methods dflash,dflash-recompute    # --recompute mlp: its peak and its cost
    python bench/train.py --tiny --flex-options sweep --steps 3      # the same on the CPU (options have no effect)

The data is written through the real store writer (`PartWriter`, random bf16 features, random token ids,
documents of 3072 tokens, loss mask on everywhere) into --work, with a fake target folder next to it holding
only config.json and the embedding / LM head; both are reused by a later run with the same shapes. The store
holds --rows rows (default 16), so the steps cycle through it in epochs (rows come from the page cache).

Per drafter, the table reports the steady window of the issue (steps 10-50, clipped to --steps):
- context / drafted tok/s, MFU and step time: time-weighted over the window, from the trainer's own metrics
  (`dflash.train.metrics.Meter`, one record per step); MFU counts trainable matmuls 3x, the frozen LM head 2x, a hidden
  teacher's head 1x and attention 3.5 x 4 x visible pairs x heads x head_dim, against 792 TFLOP/s (docs/training.md);
- peak memory: torch.cuda max_memory_allocated / max_memory_reserved from construction to the last step
  (warmup and capture included), in GB (1e9 bytes);
- memory spread: max - min of memory_allocated and of memory_reserved over the window's records, in bytes;
- recompiles (dynamo graphs compiled after warmup), data wait (share of the window spent waiting for rows);
- ungraphed: after the graphed steps, both graphs are released and `Trainer.train_step.step` (the same
  compiled step function, same buffers, no CUDA graph) is timed; its MFU is the graphed MFU x the step ratio. An
  out-of-memory or a recompile there shows in its column; the graphed numbers stand.
The trainer's final checkpoint is skipped (for drafter a it would write 22 GB of weights and optimizer state).

Under torchrun, rank 0 builds the data while the other ranks wait; then every rank trains on its own rows (the
reader gives each rank rows // N of them per epoch, so --rows must be at least N), and only rank 0 prints and
writes files. The table above then holds rank 0's view of the trainer's records (rates over all ranks, MFU per
GPU). A second table has a row per rank and one for all ranks together:
- ctx tok/s: the rank's own rate; every row holds the same context tokens, so its share of the records' all-rank
  rate is 1/N (timed on its own clock). All ranks: the sum, and the per-GPU mean;
- MFU (all ranks: the mean), step time, peak memory, memory spread, recompiles, data wait and ungraphed step of
  each rank (all ranks: the worst rank); the ungraphed step runs on every rank, all-reduce included;
- weights: after the run each rank compares its trainable fp32 weights with rank 0's, broadcast tensor by
  tensor; the max abs difference must be exactly 0. Each rank's float64 checksum of its weights is shown too.
--compare-to ONE.json (the --json of a one-GPU run of the same drafter and shapes) adds the scaling efficiency,
per-GPU ctx tok/s at N ranks / ctx tok/s on one GPU (the issue's bar: at least 90 %), and the per-GPU MFU next
to the one-GPU MFU, to the report and the JSON.
"""

import argparse
import gc
import json
import logging
import re
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch._inductor.runtime.triton_compat import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's dflash

from bench.ranks import rank_view
from bench.step_profile import profile_step
from bench.synthetic import ENCODINGS, shared_data
from bench.train_report import report, table_row, versions
from bench.variants import VARIANT_CHOICES, parse_variants, split_variant
from dflash.config import TrainConfig
from dflash.drafter import graph, loss
from dflash.drafter.attention import CUDA_KERNEL_OPTIONS, check_kernel_options
from dflash.drafter.step_time import BENCH_DRAFTERS, nearest_bench_drafter, rates_at
from dflash.errors import DflashError
from dflash.train import Trainer
from dflash.train.metrics import MetricsLog
from dflash.train.setup import Env, init_distributed

WINDOW = (10, 50)  # steps whose records the summary uses (the "steps 10-50")

# Drafter shapes: the target's width, heads, FFN (the drafter copies them) and vocabulary (dflash.drafter.step_time
# prices plan's train estimate at their measured steps), and the document layout.
ROW = dict(doc_len=3072, docs_per_row=4, anchors_per_doc=512)
DRAFTERS = {name: {**shape, **ROW} for name, shape in BENCH_DRAFTERS.items()}
TINY_ROW = dict(doc_len=64, docs_per_row=4, anchors_per_doc=8, vocab=512)


def parse_row_shapes(text: str) -> list[dict]:
    """`4x3072:512,1x32768:2048` -> [{docs_per_row, doc_len, anchors_per_doc}, ...] (ValueError otherwise)."""
    shapes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        match = re.fullmatch(r"(\d+)x(\d+):(\d+)", part)
        if not match or min(int(g) for g in match.groups()) < 1:
            raise ValueError(f"{part!r} is not DOCSxLENGTH:ANCHORS_PER_DOC with positive numbers, e.g. 1x32768:2048")
        docs, length, anchors = (int(g) for g in match.groups())
        shapes.append(dict(docs_per_row=docs, doc_len=length, anchors_per_doc=anchors))
    if not shapes:
        raise ValueError("give at least one row shape")
    return shapes


# Candidates of `--flex-options sweep`: flex_attention kernel options for the drafters' attention (head_dim 256,
# bf16) on the H200 (sm90). torch 2.13's own choices there (torch/_inductor/template_heuristics/triton.py, the CUDA
# get_flex_attn_fwd_configs / get_flex_attn_bwd_configs): forward BLOCK_M 64 x BLOCK_N 32, 3 stages, 4 warps;
# backward BLOCK_M1 = N1 = M2 = N2 = 64, 2 stages, 4 warps. Its max-autotune list pairs (M1, N1, M2, N2) =
# (M, N, N, M) with M in 32, 64, N in 32, 64, 128 and 1, 3, 4, 5 stages; on sm100 it takes 1 stage past head_dim 192.
# At head_dim 256 the backward keeps dK and dV tiles of BLOCK_N1 x 256 fp32 in registers: 8 warps halve them per
# thread. "mask_tile_size" sets the BlockMask's tiles (TrainConfig.mask_tile_size) rather than a kernel option.
FLEX_SWEEP = {
    "default": {},
    "torch": {"bwd_num_warps": 4},
    "bwd-1stage-8warps": {**CUDA_KERNEL_OPTIONS, "bwd_num_stages": 1},
    "bwd-32x64-3stages": {
        **CUDA_KERNEL_OPTIONS,
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 3,
    },
    "fwd-8warps": {**CUDA_KERNEL_OPTIONS, "fwd_num_warps": 8},
    "no-tma": {**CUDA_KERNEL_OPTIONS, "USE_TMA": False},
    "tile128": {"mask_tile_size": 128},
}


# A kernel-option set the GPU cannot run (more shared memory than it has, tiles that do not divide the mask's) fails
# at compile or at the first launch: the set gets an error row and the sweep goes on.
KERNEL_FAILURES = (torch._dynamo.exc.TorchDynamoException, OutOfResources)


def parse_flex_options(text: str) -> list[tuple[str, dict]]:
    """`sweep` (FLEX_SWEEP) or `JSON;JSON...`, each a JSON object of kernel options -> [(name, options), ...]
    (ValueError otherwise)."""
    if text.strip() == "sweep":
        return list(FLEX_SWEEP.items())
    sets = []
    for part in (p.strip() for p in text.split(";") if p.strip()):
        try:
            options = json.loads(part)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{part!r} is not JSON: {exc}") from None
        if not isinstance(options, dict):
            raise ValueError(f'{part!r} is not a JSON object, e.g. {{"bwd_num_warps": 8}}')
        try:
            check_kernel_options({k: v for k, v in options.items() if k != "mask_tile_size"})
        except DflashError as exc:
            raise ValueError(str(exc)) from None
        sets.append((json.dumps(options, separators=(",", ":")), options))
    if not sets:
        raise ValueError("give `sweep` or at least one JSON object")
    return sets


def flex_train_options(options: dict) -> dict:
    """A --flex-options set as TrainConfig fields."""
    kernel = {k: v for k, v in options.items() if k != "mask_tile_size"}
    tile = {"mask_tile_size": options["mask_tile_size"]} if "mask_tile_size" in options else {}
    return {"attention_kernel_options": kernel, **tile}


TINY = {
    "a": dict(hidden=128, heads=4, kv_heads=2, head_dim=32, ffn=256, target_layers=8, **TINY_ROW),
    "b": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, target_layers=8, **TINY_ROW),
}


# ---------------------------------------------------------------------------------------------- synthetic data


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
        "row": {"context": T, "anchors": A, "block_tokens": A * trainer.block_size},
        "params_M": sum(p.numel() for p in trainer.params) / 1e6,
        "loss_chunk": trainer.cfg.loss_chunk or loss.default_chunk_size(s["vocab"]),
        "window": [window[0]["step"], window[-1]["step"]],
        "context_tok_s": weighted(window, "context_tok_s"),
        "drafted_tok_s": weighted(window, "drafted_tok_s"),
        "mfu": weighted(window, "mfu"),
        "step_ms": sum(r["step_ms"] for r in window) / len(window),
        "data_wait": weighted(window, "data_wait"),
        "step_tflop": {
            kind: sum(r["step_tflop"][kind] for r in window) / len(window) for kind in window[0]["step_tflop"]
        },
        "recompiles": records[-1]["recompiles"],
        "loss_first_last": [records[0]["loss"], records[-1]["loss"]],
    }
    # What dflash.drafter.step_time (dflash plan's estimate) says this step takes, from its counted FLOPs: each run
    # checks it.
    bench = nearest_bench_drafter(s["hidden"])
    flops = {kind: tflop * 1e12 for kind, tflop in result["step_tflop"].items()}
    rates = rates_at(bench, trainer.dcfg.head_dim)
    result["model_step_ms"] = {"rates_of": bench, "head_dim": trainer.dcfg.head_dim, "ms": 1000 * rates.seconds(flops)}
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


def bench_one(
    name: str, s: dict, args, env: Env, baseline: dict | None, method: str = "dflash", flex: tuple | None = None
) -> dict:
    """One drafter, row shape and method (and --flex-options set `flex`, (name, options)) through the trainer."""
    device = env.device
    options, teacher = split_variant(method)
    options.update(flex_train_options(flex[1]) if flex else {})
    loss_chunk = options.pop("loss_chunk", args.loss_chunk)  # a variant's own, else --loss-chunk
    shape = f"{s['docs_per_row']}x{s['doc_len']}"
    root = Path(args.work) / (f"tiny-{name}-{shape}" if args.tiny else f"{name}-{shape}")
    if teacher:  # a store of its own, with the teacher arrays
        root = root.with_name(f"{root.name}-{teacher.replace(':', '')}")
    build_s = shared_data(root, s, args.rows, env, args.encoding, teacher)
    run = root / "run"
    cfg = TrainConfig(
        **options,
        store=str(root / "store"),
        out=str(run),
        target=str(root / "target"),
        anchors=s["anchors_per_doc"] * s["docs_per_row"],
        loss_chunk=loss_chunk,
        max_steps=args.steps,
        val_fraction=0.0,
        log_every=1,
        ckpt_every=10**9,
        export=False,
        tensorboard=False,
        device=str(device),
        cuda_graph=True,
    )
    if device.type == "cuda":  # the peaks below count the trainer alone, not the data generation
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = Trainer(cfg, env)
    prep = trainer.prepare(None)
    log = MetricsLog(run, env.main, False)  # rank 0 writes the records: they describe all ranks
    try:
        with mock.patch.object(trainer.checkpoints, "save", lambda trainer, step: None):
            result = trainer.fit(0, log)
    finally:
        log.close()
    label = f"{name} {shape}:{s['anchors_per_doc']}" + ("" if method == "dflash" else f" {method}")
    label += f" flex {flex[0]}" if flex else ""
    summary = summarise(label, s, trainer, result["records"], args.steps)
    summary["method"] = method
    summary["embedding"] = "host" if trainer.host_embedding else "device"
    summary["memory_estimate_GB"] = trainer.memory_estimate / 1e9
    summary["flex"] = dict(zip(("name", "options"), flex)) if flex else None
    summary.update(data_build_s=build_s, warmup_capture_s=prep["total_s"], warmup_parts_s=prep)
    try:
        summary["ungraphed"] = time_ungraphed(trainer, args.ungraphed_steps)
    except torch.OutOfMemoryError:  # keep the graphed numbers
        summary["ungraphed"] = {"error": "out of memory"}
    except DflashError as exc:  # a recompile (graph.no_recompiles): the graphed numbers stand, the error is shown
        logging.error("drafter %s: the ungraphed steps stopped: %s", label, exc)
        summary["ungraphed"] = {"error": f"recompiled: {' '.join(str(exc).split())[:300]}"}
    if summary["mfu"] is not None and "step_ms" in summary["ungraphed"]:
        summary["ungraphed"]["mfu"] = summary["mfu"] * summary["step_ms"] / summary["ungraphed"]["step_ms"]
    if args.profile and "step_ms" in summary["ungraphed"]:  # the ungraphed step is warm: profile it
        summary["profile"] = profile_step(trainer.train_step.step, args.profile, s["vocab"], device)
    summary.update(rank_view(summary, trainer, baseline, args.compare_to))
    summary["records"] = result["records"]
    return summary


def free_device(device: torch.device):
    """Between drafters: drop compiled code and cached blocks so that the next one starts from a clean device (the
    trainer drops compiled code too, but only once the next drafter is built: here it goes before empty_cache)."""
    gc.collect()
    graph.forget_compiled_code()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def load_baseline(path: str) -> dict:
    """The JSON of a one-GPU run of this script (files from before world_size was recorded are one-GPU runs)."""
    baseline = json.loads(Path(path).read_text())
    if baseline.get("world_size", 1) != 1:
        raise DflashError(f"it is a run on {baseline['world_size']} ranks, not on one GPU")
    return baseline


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", choices=["a", "b", "both"], default="both")
    parser.add_argument("--steps", type=int, help="train steps per drafter (window: 10-50)  [default: 60, tiny 20]")
    parser.add_argument("--ungraphed-steps", type=int, help="timed steps without the graph  [default: 10, tiny 3]")
    parser.add_argument("--tiny", action="store_true", help="toy shapes (runs on the CPU in well under a minute)")
    parser.add_argument("--rows", type=int, default=16, help="rows in the synthetic store (steps cycle through it)")
    parser.add_argument(
        "--encoding", choices=list(ENCODINGS), default="bf16", help="the synthetic store's feature encoding"
    )
    parser.add_argument("--loss-chunk", type=int, help="LM-head rows per loss chunk  [default: the trainer's]")
    parser.add_argument(
        "--methods",
        default="dflash",
        help=f"drafter methods to time, comma-separated, each on every drafter: {VARIANT_CHOICES}",
    )
    parser.add_argument(
        "--row-shapes",
        help="row shapes to time, comma-separated DOCSxLENGTH:ANCHORS_PER_DOC (documents per row, tokens per document, "
        "anchors per document), e.g. 4x3072:512,1x32768:2048  [default: 4x3072:512, tiny 4x64:8]",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also profile N ungraphed steps: time per part of the step, and the counted FLOPs and TFLOP/s of the "
        "parts that run them (matmul, attention)",
    )
    parser.add_argument(
        "--flex-options",
        metavar="sweep|JSON[;JSON...]",
        help="time each drafter with each set of flex_attention kernel options: `sweep` (the docstring's candidates) "
        'or JSON objects separated by ";", e.g. \'{"bwd_num_warps": 4};{"mask_tile_size": 128}\' ({}: the trainer\'s '
        "CUDA default, bwd_num_warps=8 with USE_TMA on tiles of 64; bwd_num_warps=4 is torch's own)",
    )
    parser.add_argument("--work", default="/tmp/dflash-bench-train", help="where the fake target, store and runs go")
    parser.add_argument("--json", help="also write the results (with every step's record) here")
    parser.add_argument("--compare-to", metavar="ONE.json", help="the --json of a one-GPU run: report the scaling")
    args = parser.parse_args()
    try:
        args.methods = parse_variants(args.methods)
    except ValueError as exc:
        parser.error(f"--methods {exc}")
    try:
        row_shapes = parse_row_shapes(args.row_shapes) if args.row_shapes else [None]
    except ValueError as exc:
        parser.error(f"--row-shapes: {exc}")
    try:
        flex_sets = parse_flex_options(args.flex_options) if args.flex_options else [None]
    except ValueError as exc:
        parser.error(f"--flex-options: {exc}")
    if min(args.steps or 1, args.ungraphed_steps or 1, args.rows) < 1 or args.profile < 0:
        parser.error("--steps, --ungraphed-steps and --rows must be at least 1, --profile at least 0")
    args.steps = args.steps or (20 if args.tiny else 60)
    args.ungraphed_steps = args.ungraphed_steps or (3 if args.tiny else 10)
    try:
        baseline = load_baseline(args.compare_to) if args.compare_to else None
    except (OSError, ValueError, KeyError, DflashError) as exc:
        parser.error(f"--compare-to {args.compare_to}: {exc}")

    env = init_distributed(None)
    if args.rows < env.world_size:  # the reader gives each rank rows // world_size rows per epoch, and a step takes one
        parser.error(
            f"--rows {args.rows} leaves some of the {env.world_size} ranks without a row; use at least {env.world_size}"
        )
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("dflash").setLevel(logging.INFO)  # the trainer's line per step (rank 0 writes them)
    if args.tiny and env.device.type == "cpu":
        torch.set_num_threads(1)  # toy matmuls gain nothing from threads, and a busy machine makes them spin
    info = versions(env.device)
    if env.main:
        print(", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    shapes = TINY if args.tiny else DRAFTERS
    results = []
    drafters = ["a", "b"] if args.drafter == "both" else [args.drafter]
    runs = (
        (name, row, method, flex)
        for row in row_shapes
        for name in drafters
        for method in args.methods
        for flex in flex_sets
    )
    for name, row, method, flex in runs:
        try:
            results.append(bench_one(name, {**shapes[name], **(row or {})}, args, env, baseline, method, flex))
        except (DflashError, torch.OutOfMemoryError, *KERNEL_FAILURES) as exc:  # report it, go on with the others
            logging.exception("drafter %s (%s) failed on rank %d", name, method, env.rank)
            error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            flex_name = f" flex {flex[0]}" if flex else ""
            results.append({"drafter": f"{name} {row or 'default row'} {method}{flex_name}", "error": error})
        free_device(env.device)  # here, after the except block has dropped the failed trainer's frames
        # After each drafter, so that a run stopped at a time limit keeps the drafters that finished.
        if env.main:
            print(f"RESULT {table_row(results[-1])}", flush=True)
            if args.json:
                out = {"versions": info, "world_size": env.world_size, "args": vars(args), "results": results}
                Path(args.json).write_text(json.dumps(out, indent=1))
    if env.main:
        report(info, results, args, env.world_size)
    if env.world_size > 1:
        dist.destroy_process_group()
    if any("error" in r for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
