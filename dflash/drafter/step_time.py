"""A train step's time on one H200, estimated from measured steps: how `dflash plan` prices long rows and windows.

A step spends its time in two kinds of kernels whose speed differs by more than 2x: the matmuls (projections, MLPs,
the LM head) and flex_attention. Long rows change the mix, not just the amount: the matmuls grow with the tokens,
the attention with the tokens times the context each block sees. So a step's time is modelled as

    seconds = matmul FLOPs / matmul rate + attention FLOPs / attention rate

(both counted by dflash.drafter.flops.step_flops_by_kind), and the two rates of a drafter are the ones that reproduce
two of its measured steps, a short row and a long one (bench/train.py on one H200, `MEASURED`). On the measured rows not
used to fit them it came within about 5 % (131072 tokens, a 2048-token window), short of the measured step each time,
and 13 % short at 262144 tokens: an estimate, a lower bound past 131072 (docs/benchmarks.md, "Step time model").

The rates are those of flex_attention at head_dim 256 (the bench drafters copy Qwen3.5's). At head_dim 128 with the
same widths its kernels run faster (`ATTENTION_SPEEDUP`, measured), and so does its FLASH backend at 256
(`FLASH_SPEEDUP`, measured); other head dims are priced at 256's rate.
"""

from dataclasses import dataclass

import numpy as np
import torch

from dflash.drafter.flops import block_pairs, step_flops_by_kind
from dflash.drafter.model import DrafterConfig
from dflash.target import default_layer_ids

# bench/train.py's drafters: the target's width, heads and FFN, which the drafter copies (a: Qwen3.5-27B-class,
# b: 4B-class), and the vocabulary of both.
BENCH_DRAFTERS = {
    "a": dict(hidden=5120, heads=24, kv_heads=4, head_dim=256, ffn=17408, target_layers=64, vocab=248320),
    "b": dict(hidden=2560, heads=16, kv_heads=4, head_dim=256, ffn=9216, target_layers=32, vocab=248320),
}


@dataclass(frozen=True)
class MeasuredStep:
    """One row shape's measured step (bench/train.py, DFlash, one row a step, every document's positions in the
    loss), with where docs/benchmarks.md has it."""

    drafter: str
    docs_per_row: int
    doc_len: int
    anchors_per_doc: int
    seconds: float
    measured: str
    window: int | None = None
    head_dim: int = 256  # the drafter's, its widths kept (train's --drafter-option head_dim)


# The fitting pair of each drafter: the trainer's CUDA defaults (8-warp backward, TMA loads, BlockMask tiles of 64),
# except drafter a's long row, measured on tiles of 128 (its only 32768-token run; tiles of 64 were 1.8 % faster on
# drafter b there).
MEASURED = {
    "a": (
        MeasuredStep("a", 4, 3072, 512, 0.9108, "2026-12-03 18:45, Long rows"),
        MeasuredStep("a", 1, 32768, 2048, 1.885, "2026-12-03 09:31 (1874-1896 ms), Long rows, tiles of 128"),
    ),
    "b": (
        MeasuredStep("b", 4, 3072, 512, 0.3861, "2026-12-03 16:53, Drafter methods"),
        MeasuredStep("b", 1, 32768, 2048, 0.9897, "2026-12-03 14:48, Long rows"),
    ),
}


# How much faster flex_attention runs the step's attention at a head dim than at 256, the widths kept (drafter b's 16 / 4
# heads of 256 as 32 / 8 of 128), each at the trainer's kernel defaults for its head dim: forward + backward with the
# step's BlockMask at 1 x 32768 tokens and 2048 anchors, 133.40 ms at 256 against 81.49 at 128 (bench/
# attention_ceiling.py, one H200, 2026-12-05 10:35 UTC; docs/benchmarks.md, "Long rows").
ATTENTION_SPEEDUP = {256: 1.0, 128: 133.40 / 81.49}
# How much faster flex_attention's FLASH backend (flash-attn-4's CuTe kernels, --attention-kernel-option
# BACKEND=FLASH) runs the same attention than its Triton default, at head_dim 256 with drafter b's heads (a
# power-of-two group, which the trainer's K / V repeat leaves every drafter): 127.45 ms against 85.71 (bench/
# attention_ceiling.py --flex-options, one H100, 2026-12-05 19:01 UTC; docs/benchmarks.md, "Long rows").
FLASH_SPEEDUP = {256: 127.45 / 85.71}


@dataclass(frozen=True)
class Rates:
    """FLOP/s of each kind of kernel: what the counted FLOPs of that kind run at."""

    matmul: float
    attention: float

    def seconds(self, flops: dict[str, float]) -> float:
        return flops["matmul"] / self.matmul + flops["attention"] / self.attention


def bench_target_config(s: dict):
    """The Qwen3 config of a bench drafter's target, `s` a BENCH_DRAFTERS entry (or a dict holding its keys): what
    bench/train.py's fake target saves, and the trainer shapes the drafter from."""
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=s["hidden"],
        intermediate_size=s["ffn"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        num_hidden_layers=s["target_layers"],
        vocab_size=s["vocab"],
        tie_word_embeddings=False,
    )


def bench_config(name: str, window: int | None = None) -> DrafterConfig:
    """bench/train.py's DFlash drafter `name`, shaped from its target as the trainer shapes it."""
    s = BENCH_DRAFTERS[name]
    layers = default_layer_ids(s["target_layers"])
    return DrafterConfig.from_target_config(bench_target_config(s), layers, 0, sliding_window=window)


def pairs_per_anchor(contexts: np.ndarray, block_size: int, window: int | None) -> float:
    """The mean pairs a block lets attend, over anchors drawn uniformly from positions whose context lengths (tokens
    of their document before them) have the histogram `contexts` (contexts[c]: positions with context c)."""
    counts = torch.from_numpy(np.asarray(contexts, np.float64))
    pairs = block_pairs(torch.arange(len(counts), dtype=torch.float64), block_size, window)
    return float((pairs * counts).sum() / counts.sum())


def uniform_contexts(doc_len: int, block_size: int) -> np.ndarray:
    """The context histogram of a document whose every position is in the loss: a block fits after positions
    0 .. doc_len - block_size, each once."""
    return np.ones(doc_len - block_size + 1)


def row_flops(dcfg: DrafterConfig, tokens: int, anchors: int, pairs_per_block: float) -> dict[str, float]:
    """step_flops_by_kind of one row of `tokens` with `anchors` blocks, each seeing `pairs_per_block` pairs."""
    drafted, labelled = anchors * dcfg.block_size, anchors * dcfg.drafts_per_block
    return step_flops_by_kind(dcfg, tokens, drafted, labelled, anchors * pairs_per_block)


def measured_flops(step: MeasuredStep) -> dict[str, float]:
    dcfg = bench_config(step.drafter, step.window)
    pairs = pairs_per_anchor(uniform_contexts(step.doc_len, dcfg.block_size), dcfg.block_size, step.window)
    anchors = step.docs_per_row * step.anchors_per_doc
    return row_flops(dcfg, step.docs_per_row * step.doc_len, anchors, pairs)


def fitted_rates(name: str) -> Rates:
    """The two rates with which drafter `name`'s fitting pair of measured steps take exactly their measured time."""
    steps = MEASURED[name]
    flops = [measured_flops(step) for step in steps]
    kinds = np.array([[f["matmul"], f["attention"]] for f in flops])
    inverse = np.linalg.solve(kinds, np.array([step.seconds for step in steps]))
    if not (inverse > 0).all():
        raise ValueError(f"drafter {name}'s measured steps give no positive rates: {inverse}")
    return Rates(matmul=1 / inverse[0], attention=1 / inverse[1])


def rates_at(name: str, head_dim: int, flash: bool = False) -> Rates:
    """Drafter `name`'s rates with its attention at `head_dim` (widths kept), on the FLASH backend's kernels with
    `flash`: 256's rate on Triton where not measured."""
    rates = fitted_rates(name)
    speedup = ATTENTION_SPEEDUP.get(head_dim, 1.0) * (FLASH_SPEEDUP.get(head_dim, 1.0) if flash else 1.0)
    return Rates(rates.matmul, rates.attention * speedup)


def nearest_bench_drafter(hidden_size: int) -> str:
    """The bench drafter closest in width (by ratio) to a drafter of `hidden_size`: whose rates to price it at."""
    return min(BENCH_DRAFTERS, key=lambda name: abs(np.log(BENCH_DRAFTERS[name]["hidden"] / hidden_size)))
