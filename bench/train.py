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
    default             the trainer's on CUDA (dflash.attention_kernels.CUDA_KERNEL_OPTIONS): torch's tiles, the backward on 8 warps,
                        TMA loads; BlockMask tiles by head dim (attention_kernels.default_mask_tile: 64 at the drafters' 256)
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
  (`dflash.metrics.Meter`, one record per step); MFU counts trainable matmuls 3x, the frozen LM head 2x, a hidden
  teacher's head 1x and attention 3.5 x 4 x visible pairs x heads x head_dim, against 792 TFLOP/s (docs/training.md);
- peak memory: torch.cuda max_memory_allocated / max_memory_reserved from construction to the last step
  (warmup and capture included), in GB (1e9 bytes);
- memory spread: max - min of memory_allocated and of memory_reserved over the window's records, in bytes;
- recompiles (dynamo graphs compiled after warmup), data wait (share of the window spent waiting for rows);
- ungraphed: after the graphed steps, both graphs are released and `Trainer.train_step.step` (the same
  compiled step function, same buffers, no CUDA graph) is timed; its MFU is the graphed MFU x the step ratio.
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
import datetime
import gc
import json
import logging
import re
import shutil
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
from torch._inductor.runtime.triton_compat import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's dflash

from bench.step_profile import profile_step, profile_table
from bench.variants import METHOD_VARIANTS, parse_variants, split_variant
from dflash import features, graph, loss, store
from dflash.attention_kernels import CUDA_KERNEL_OPTIONS
from dflash.config import TrainConfig
from dflash.drafter import check_kernel_options
from dflash.errors import DflashError
from dflash.harvest import RowEncoder, store_bits
from dflash.manifest import FeatureSpec, Manifest, SubspaceSpec, TargetSpec, TokenizerSpec, teacher_spec
from dflash.metrics import MetricsLog
from dflash.target import default_layer_ids
from dflash.train import Trainer
from dflash.train_setup import Env, init_distributed

WINDOW = (10, 50)  # steps whose records the summary uses (the issue's "steps 10-50")

# Drafter shapes: the target's width, heads and FFN (the drafter copies them) and the document layout.
ROW = dict(doc_len=3072, docs_per_row=4, anchors_per_doc=512, vocab=248320)
DRAFTERS = {
    "a": dict(hidden=5120, heads=24, kv_heads=4, head_dim=256, ffn=17408, target_layers=64, **ROW),
    "b": dict(hidden=2560, heads=16, kv_heads=4, head_dim=256, ffn=9216, target_layers=32, **ROW),
}
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


def fake_target(folder: Path, s: dict, device: torch.device):
    """A target folder with only config.json and the embedding / LM head (all the trainer reads of a target)."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    folder.mkdir(parents=True, exist_ok=True)
    Qwen3Config(
        hidden_size=s["hidden"],
        intermediate_size=s["ffn"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        num_hidden_layers=s["target_layers"],
        vocab_size=s["vocab"],
        tie_word_embeddings=False,
    ).save_pretrained(folder)
    g = torch.Generator(device).manual_seed(0)

    def weight():
        w = torch.randn(s["vocab"], s["hidden"], device=device, generator=g, dtype=torch.bfloat16)
        return (w * 0.02).cpu()

    save_file({"model.embed_tokens.weight": weight(), "lm_head.weight": weight()}, folder / "model.safetensors")


# --encoding: name -> (precision, the stored width's share of the feature width: 1, or 1/D for a subspace of D)
ENCODINGS = {
    "bf16": ("bf16", 1),
    "fp8": ("fp8", 1),
    "sub1/4": ("bf16", 4),
    "sub1/8": ("bf16", 8),
    "sub1/4+fp8": ("fp8", 4),
}


def store_header(target: Path, s: dict, encoding: str, teacher: str | None = None) -> Manifest:
    """harvest.json as a harvest of the fake target would write it, in the store `encoding`, with `teacher`
    arrays (a --teacher value) when given."""
    layers = default_layer_ids(s["target_layers"])
    feature_dim = len(layers) * s["hidden"]
    precision, divisor = ENCODINGS[encoding]
    width = feature_dim // divisor
    fp8 = precision == "fp8"
    groups = features.default_scale_groups(width, len(layers), divisor > 1) if fp8 else 0
    subspace = SubspaceSpec(width, 1.0, 0, 0) if divisor > 1 else None
    return store.new_manifest(
        target=TargetSpec(
            name=str(target),
            model_type="qwen3",
            config_hash="synthetic",
            num_layers=s["target_layers"],
            hidden_size=s["hidden"],
            vocab_size=s["vocab"],
            intermediate_size=s["ffn"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"],
            head_dim=s["head_dim"],
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            max_position_embeddings=40960,
        ),
        layer_ids=layers,
        token_budget=s["doc_len"] * s["docs_per_row"],
        tokenizer=TokenizerSpec(str(target), s["vocab"], {"mask": s["vocab"] - 1}),
        fingerprint={"model": str(target), "layers": layers, "world_size": 1},
        features=FeatureSpec("fp8" if fp8 else "bf16", width, groups, subspace),
        teacher=teacher_of(teacher, s),
    )


def teacher_of(teacher: str | None, s: dict):
    if teacher is None:
        return None
    kind, _, k = teacher.partition(":")
    return teacher_spec(kind, int(k or 0), s["hidden"])


def teacher_row(spec, T: int, vocab: int, rng: np.random.Generator) -> dict:
    """Random teacher arrays of one row: a top-k distribution (distinct ids, probabilities falling) or a bf16
    final hidden state, as a harvest stores them."""
    if spec is None:
        return {}
    if spec.kind == "hidden":
        values = torch.randn(T, spec.width, dtype=torch.bfloat16)
        return {"teacher_hidden": values.view(torch.int16).numpy().view(np.uint16)}
    probs = np.sort(rng.dirichlet(np.ones(spec.k + 1), T)[:, : spec.k], axis=1)[:, ::-1]
    ids = np.stack([rng.choice(vocab - 1, spec.k, replace=False) for _ in range(T)]).astype(np.int32)
    tail = 1 - probs.sum(1)
    return {"teacher_ids": ids, "teacher_probs": probs.astype(np.float16), "teacher_tail": tail.astype(np.float16)}


def synthetic_store(
    out: Path, target: Path, s: dict, rows: int, device: torch.device, encoding: str, teacher: str | None = None
):
    """`rows` rows of `docs_per_row` whole documents each, random bf16 features encoded as a harvest would
    (a random orthonormal projection for a subspace), written through the real part writer."""
    header = store_header(target, s, encoding, teacher)
    T, F, L, D = header.token_budget, header.feature_dim, s["doc_len"], s["docs_per_row"]
    g = torch.Generator(device).manual_seed(1)
    rng = np.random.default_rng(1)
    projection = None
    if header.features.subspace is not None:
        basis = torch.randn(F, header.features.width, device=device, generator=g, dtype=torch.float32)
        projection = torch.linalg.qr(basis)[0].T.contiguous()
    encoder = RowEncoder(header.features, projection, (1, T), device)
    encoded = None if encoder.identity else encoder.buffers(device=device)

    def row(r: int):
        hidden = torch.randn(1, T, F, device=device, generator=g, dtype=torch.bfloat16)
        stored = {name: store_bits(t[0].cpu()) for name, t in encoder.encode(hidden, encoded).items()}
        tokens = {
            "input_ids": rng.integers(0, s["vocab"] - 1, T, dtype=np.int32),  # never the mask token
            "position_ids": (np.arange(T) % L).astype(np.int32),
            "doc_ids": (r * D + np.arange(T) // L).astype(np.int32),
            "loss_mask": np.ones(T, np.uint8),
        }
        return stored.pop("hidden"), {**stored, **tokens, **teacher_row(header.teacher, T, s["vocab"], rng)}

    documents = np.array([[r * D + d, 0, r, d * L, L] for r in range(rows) for d in range(D)], np.int64)
    counts = {"documents": rows * D, "tokens": rows * T, "loss_tokens": rows * T, "padding_tokens": 0}
    content = store.PartContent(rows, documents, counts, row)
    store.write_store(out, header, [content], None if projection is None else projection.cpu().numpy())


def prepare_data(root: Path, s: dict, rows: int, device: torch.device, encoding: str, teacher=None) -> float:
    """Fake target + store under `root`, reused when a previous run made them with the same shapes."""
    spec = {**s, "rows": rows, "encoding": encoding, "teacher": teacher, "format_version": store.FORMAT_VERSION}
    done = root / "spec.json"
    if done.exists() and json.loads(done.read_text()) == spec:
        return 0.0
    t0 = time.perf_counter()
    shutil.rmtree(root, ignore_errors=True)
    fake_target(root / "target", s, device)
    synthetic_store(root / "store", root / "target", s, rows, device, encoding, teacher)
    done.write_text(json.dumps(spec))  # last: marks both complete
    return time.perf_counter() - t0


def shared_data(root: Path, s: dict, rows: int, env: Env, encoding: str, teacher: str | None = None) -> float:
    """Rank 0 builds the data and empties the run folder while the other ranks wait. If rank 0 fails, the others
    stop with an error here rather than wait for collectives that never come."""
    built = [None]
    try:
        if env.main:
            built[0] = prepare_data(root, s, rows, env.device, encoding, teacher)
            shutil.rmtree(root / "run", ignore_errors=True)
            (root / "run").mkdir(parents=True)
    finally:
        if env.world_size > 1:
            dist.broadcast_object_list(built, src=0)  # also the barrier
    if built[0] is None:
        raise DflashError("rank 0 could not build the synthetic data (its error is in its output)")
    return built[0]


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


def replica_check(trainer: Trainer) -> dict:
    """This rank's trainable fp32 weights against rank 0's (broadcast one tensor at a time, so no flat copy of
    all of them is needed): the max abs difference, and a float64 checksum of the weights."""
    diff = torch.zeros((), dtype=torch.float32, device=trainer.device)
    for p in trainer.params:
        reference = p.detach().clone()
        if trainer.env.world_size > 1:
            dist.broadcast(reference, 0)
        diff = torch.maximum(diff, (p.detach() - reference).abs().max())
    checksum = sum(p.detach().sum(dtype=torch.float64) for p in trainer.params)
    return {"weights_max_abs_diff": diff.item(), "weights_checksum": checksum.item()}


RANK_KEYS = (
    "mfu",
    "step_ms",
    "data_wait",
    "peak_allocated_GB",
    "peak_reserved_GB",
    "allocated_spread",
    "reserved_spread",
)


def rank_summary(summary: dict, env: Env, weights: dict) -> dict:
    """This rank's numbers. The records' rates count the tokens of all ranks; every row of the store holds the
    same context tokens, so this rank's share is 1/world of them (over this rank's time)."""
    u = summary["ungraphed"]
    return {
        "rank": env.rank,
        "context_tok_s": summary["context_tok_s"] / env.world_size,
        **{key: summary.get(key) for key in RANK_KEYS},
        "recompiles": summary["recompiles"] + u.get("recompiles", 0),
        "ungraphed_step_ms": u.get("step_ms"),
        **weights,
    }


def gather_ranks(mine: dict, env: Env) -> list[dict]:
    if env.world_size == 1:
        return [mine]
    ranks = [None] * env.world_size
    dist.all_gather_object(ranks, mine)
    return ranks


WORST_KEYS = (
    "step_ms",
    "data_wait",
    "peak_allocated_GB",
    "peak_reserved_GB",
    "allocated_spread",
    "reserved_spread",
    "ungraphed_step_ms",
    "weights_max_abs_diff",
)


def worst(ranks: list[dict], key: str):
    values = [r[key] for r in ranks if r[key] is not None]
    return max(values) if values else None


def aggregate(ranks: list[dict]) -> dict:
    """All ranks together: the total context rate and the per-GPU means; the worst rank for everything else."""
    n, total = len(ranks), sum(r["context_tok_s"] for r in ranks)
    mfu = [r["mfu"] for r in ranks if r["mfu"] is not None]
    return {
        "world_size": n,
        "context_tok_s": total,
        "context_tok_s_per_gpu": total / n,
        "mfu": sum(mfu) / len(mfu) if mfu else None,
        "recompiles": sum(r["recompiles"] for r in ranks),
        **{key: worst(ranks, key) for key in WORST_KEYS},
        "weights_checksums_equal": len({r["weights_checksum"] for r in ranks}) == 1,
    }


def scaling(result: dict, baseline: dict, path: str) -> dict:
    """Per-GPU throughput and MFU at this run's ranks against the one-GPU run of the same drafter in `baseline`."""
    same = ("drafter", "shape", "row", "loss_chunk")
    matches = [r for r in baseline["results"] if "error" not in r and all(r[k] == result[k] for k in same)]
    if not matches:
        return {"error": f"{path} has no one-GPU result of drafter {result['drafter']} with these shapes"}
    one, agg = matches[0], result["aggregate"]
    has_mfu = agg["mfu"] is not None and one["mfu"] is not None
    return {
        "baseline": path,
        "world_size": agg["world_size"],
        "per_gpu_context_tok_s": agg["context_tok_s_per_gpu"],
        "one_gpu_context_tok_s": one["context_tok_s"],
        "efficiency": agg["context_tok_s_per_gpu"] / one["context_tok_s"],
        "mfu_per_gpu": agg["mfu"],
        "one_gpu_mfu": one["mfu"],
        "mfu_ratio": agg["mfu"] / one["mfu"] if has_mfu else None,
    }


def rank_view(summary: dict, trainer: Trainer, baseline: dict | None, path: str | None) -> dict:
    """Every rank's row, their aggregate and, given a one-GPU baseline, the scaling (collectives: all ranks)."""
    env = trainer.env
    ranks = gather_ranks(rank_summary(summary, env, replica_check(trainer)), env)
    view = {"ranks": ranks, "aggregate": aggregate(ranks)}
    if baseline is not None:
        view["scaling"] = scaling({**summary, **view}, baseline, path)
    return view


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
    if summary["mfu"] is not None and "step_ms" in summary["ungraphed"]:
        summary["ungraphed"]["mfu"] = summary["mfu"] * summary["step_ms"] / summary["ungraphed"]["step_ms"]
    if args.profile and "step_ms" in summary["ungraphed"]:  # the ungraphed step is warm: profile it
        summary["profile"] = profile_step(trainer.train_step.step, args.profile, s["vocab"], device)
    summary.update(rank_view(summary, trainer, baseline, args.compare_to))
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
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "zarr": zarr.__version__,
        "numcodecs": numcodecs.__version__,
        "gpu": gpu,
    }


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


RANK_HEADER = (
    "| rank | ctx tok/s | MFU | step ms | peak alloc / reserved GB | alloc / reserved spread (B) | recompiles "
    "| data wait | ungraphed step ms | weights max abs diff vs rank 0 | weights checksum |"
)


def rank_row(label: str, context: str, r: dict, checksum: str) -> str:
    """A row of the rank table; `r` is one rank's summary or the aggregate (same keys)."""
    peak = "-" if r["peak_allocated_GB"] is None else f"{r['peak_allocated_GB']:.1f} / {r['peak_reserved_GB']:.1f}"
    spread = "-" if r["allocated_spread"] is None else f"{r['allocated_spread']} / {r['reserved_spread']}"
    return (
        f"| {label} | {context} | {fmt(r['mfu'], '.1f', 100, ' %')} | {r['step_ms']:.1f} | {peak} | {spread} "
        f"| {r['recompiles']} | {fmt(r['data_wait'], '.2f', 100, ' %')} | {fmt(r['ungraphed_step_ms'], '.1f')} "
        f"| {r['weights_max_abs_diff']:g} | {checksum} |"
    )


def rank_table(r: dict):
    agg = r["aggregate"]
    print(f"\nPer rank, drafter {r['drafter']}, window steps {r['window'][0]}-{r['window'][1]}:")
    print("\n" + RANK_HEADER)
    print("|" + "---|" * RANK_HEADER.count(" |"))
    for rank in r["ranks"]:
        print(rank_row(str(rank["rank"]), fmt(rank["context_tok_s"], ",.0f"), rank, f"{rank['weights_checksum']:.17g}"))
    context = f"{agg['context_tok_s']:,.0f} ({agg['context_tok_s_per_gpu']:,.0f} per GPU)"
    checksums = "all equal" if agg["weights_checksums_equal"] else "DIFFER"
    print(rank_row(f"all {agg['world_size']}", context, agg, checksums))


def scaling_line(r: dict) -> str:
    s = r["scaling"]
    if "error" in s:
        return f"scaling of {r['drafter']}: {s['error']}"
    return (
        f"scaling of {r['drafter']} against {s['baseline']}: {s['per_gpu_context_tok_s']:,.0f} ctx tok/s per GPU "
        f"at {s['world_size']} ranks / {s['one_gpu_context_tok_s']:,.0f} on one GPU = efficiency "
        f"{100 * s['efficiency']:.1f} % (bar >= 90 %); MFU per GPU {fmt(s['mfu_per_gpu'], '.1f', 100, ' %')} vs "
        f"{fmt(s['one_gpu_mfu'], '.1f', 100, ' %')} on one GPU ({fmt(s['mfu_ratio'], '.1f', 100, ' %')})"
    )


def report(info: dict, results: list[dict], args, world: int):
    script = "bench/train.py" if world == 1 else f"torchrun --nproc-per-node {world} bench/train.py"
    print(
        f"\n## {script} {'--tiny ' if args.tiny else ''}--drafter {args.drafter} --encoding {args.encoding} "
        f"--methods {','.join(args.methods)} --steps {args.steps}"
        + (f" --row-shapes {args.row_shapes}" if args.row_shapes else "")
        + (f" --profile {args.profile}" if args.profile else "")
        + (f" --flex-options '{args.flex_options}'" if args.flex_options else "")
    )
    print(", ".join(f"{k} {v}" for k, v in info.items()))
    for r in results:
        if "error" not in r:
            print(
                f"{r['drafter']}: {r['params_M']:.1f} M trainable parameters, loss chunk {r['loss_chunk']}, "
                f"token embeddings on the {r['embedding']}, memory estimate {r['memory_estimate_GB']:.1f} GB, "
                f"window steps {r['window'][0]}-{r['window'][1]}, data built in {r['data_build_s']:.1f} s, "
                f"warmup + capture {r['warmup_capture_s']:.1f} s, "
                f"loss {r['loss_first_last'][0]:.3f} -> {r['loss_first_last'][1]:.3f}"
            )
    print("\n" + HEADER)
    print("|" + "---|" * HEADER.count(" |"))
    for r in results:
        print(table_row(r))
    for r in results:
        if "profile" in r:
            print(profile_table(r["drafter"], r["profile"], r["step_tflop"]))
    for r in results:
        if "error" not in r and world > 1:
            rank_table(r)
        if "scaling" in r:
            print("\n" + scaling_line(r))


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
        help=f"drafter methods to time, comma-separated, each on every drafter: {', '.join(METHOD_VARIANTS)}",
    )
    parser.add_argument(
        "--row-shapes",
        help="row shapes to time, comma-separated DOCSxLENGTH:ANCHORS_PER_DOC (documents per row, tokens per document, "
        "anchors per document), e.g. 4x3072:512,1x32768:2048  [default: 4x3072:512, tiny 4x64:8]",
    )
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="also profile N ungraphed steps: time per part of the step"
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
