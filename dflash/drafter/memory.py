"""The peak memory of a training step, estimated from the shapes before anything is built, and the refusal of a
run that would not fit the device (a CPU run past the machine's memory is otherwise killed by the OS without a
word; a GPU run fails with an out-of-memory error after minutes of compile).

The formula and its measured error are in docs/training.md ("Memory"); `step_memory` is its only home.
"""

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.drafter.model import DrafterConfig
from dflash.errors import DflashError


@dataclass(frozen=True)
class Coefficients:
    """What a step keeps, in copies of a width per token (fitted: docs/training.md, "Memory")."""

    block: float  # per drafter layer and block token: copies of (hidden + FFN + q width)
    context: float  # per context token: copies of the hidden width (its fused and normed context)
    context_kv: float  # per context token and drafter layer: copies of the key / value width
    loss: float  # copies of one loss chunk's fp32 logits [chunk, V]
    mask: float  # bytes per (query, key) pair of the dense mask (the CPU's; the GPU's BlockMask is tiny)


# GPU: the compiled bf16 step, fitted to bench/train.py's peaks on one H200 (docs/benchmarks.md, issue 24).
GPU = Coefficients(block=3.45, context=7.4, context_kv=2.9, loss=1.0, mask=0.0)
# CPU: the eager fp32 step, fitted to peak resident memory on a 2-core CPU box (docs/training.md, "Memory"); the
# context's copies are the GPU's (not measured apart: small on the CPU).
CPU = Coefficients(block=7.0, context=7.4, context_kv=2.9, loss=4.1, mask=4.3)
# On the CPU a step past the memory is killed by the OS without a word, and the estimate runs up to 12 % low there
# (docs/training.md): only this share of the available memory counts.
CPU_USABLE = 0.9
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")  # v2: memory.max and memory.current of this process's group


@dataclass(frozen=True)
class StepShape:
    """What a step holds, from the options and the store alone."""

    rows: int  # rows per micro-step
    micro_batches: int
    token_budget: int
    anchors: int
    loss_chunk: int
    stored_bytes_per_row: int  # one row of the store's arrays as they sit in the static buffers
    parameters: int
    lifted_width: int  # k of a subspace store's lift (0 without one)
    cuda: bool
    teacher: str | None = None  # the teacher kind the method trains from (`hidden`, `topk`), None without
    recompute: str = "none"  # TrainConfig.recompute
    layer_parameters: int = 0  # those of the drafter layers (--recompute pointwise recomputes their bf16 copies)
    embedding_on_host: bool = False  # TrainConfig.embedding resolved (`embedding_on_host`)
    kv_repeat: int = 1  # K / V heads repeated for BACKEND=FLASH (dflash.drafter.model.flash_kv_repeat)


def embedding_on_host(choice: str, cuda: bool, step_tokens: int, vocab_size: int) -> bool:
    """Whether the reader looks the step's token embeddings up on the host (TrainConfig.embedding). auto: on a GPU
    when the embeddings of a step's tokens, in the step's buffers and their staging copy, take less room than the
    table: 2 x tokens < vocabulary (a 12288-token row of a 248 K vocabulary: 0.1 of the table)."""
    if choice == "auto":
        return cuda and 2 * step_tokens < vocab_size
    return choice == "host"


def parameter_count(model_cls, dcfg: DrafterConfig, layers_only: bool = False) -> int:
    """The drafter's trainable parameters (or those of its layers), counted on the meta device (nothing
    allocated)."""
    with torch.device("meta"):
        model = model_cls(dcfg)
        return sum(p.numel() for p in (model.layers if layers_only else model).parameters())


def row_bytes(fields: dict) -> int:
    """Bytes of one row in the step's buffers, from `reader.row_fields` (name -> (shape, torch dtype))."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in fields.values())


def step_memory(dcfg: DrafterConfig, shape: StepShape) -> dict[str, int]:
    """The estimated peak bytes of a training step by part (their sum is the estimate)."""
    e = 2 if shape.cuda else 4  # bytes of a matmul value: bf16 under autocast, fp32 on the CPU
    c = GPU if shape.cuda else CPU
    H, V, L = dcfg.hidden_size, dcfg.vocab_size, dcfg.num_layers
    T, R = shape.token_budget, shape.rows
    Q = shape.anchors * dcfg.block_size  # block tokens of a row
    q_width, kv_width = dcfg.num_attention_heads * dcfg.head_dim, dcfg.num_key_value_heads * dcfg.head_dim
    # A method's own copies are measured on the GPU; the eager CPU step keeps more of everything, in proportion
    method_copies = dcfg.method_activation_copies() * c.block / GPU.block
    F = dcfg.intermediate_size
    block_copies = c.block * (H + F + q_width) + method_copies * H
    rebuilt_width = 0  # what one layer's backward rebuilds at a time
    # bf16 copies of the weights under autocast; --recompute pointwise keeps those of one layer at a time only
    weight_copies = shape.parameters if shape.cuda else 0
    context_kv = c.context_kv
    pointwise = shape.recompute == "pointwise" and shape.cuda
    if shape.recompute == "mlp":  # the MLP keeps its input only: off go what the step keeps of it (docs/training.md)
        block_copies -= 3 * F + H if shape.cuda else 4 * F
        rebuilt_width = 3 * F  # gate, up and their product
    elif pointwise:
        # Each layer keeps its input and its matmuls' and attention's outputs, counted in the compiled graph
        # (tests/test_memory.py): q and the block's k, v; the attention's output, o_proj's; gate and up. What the
        # compiled layer no longer keeps (the normed inputs, q after its norm and RoPE twice, the SwiGLU product,
        # the block's k before RoPE) is rebuilt one layer at a time in its backward.
        block_copies = 2 * H + 2 * q_width + 2 * kv_width + 2 * F + dcfg.method_activation_copies("pointwise") * H
        rebuilt_width = 2 * H + 2 * q_width + F + kv_width
        context_kv = 2.0  # k and v of the context
        weight_copies -= shape.layer_parameters * (L - 1) // L
    # --embedding host: each row's token embeddings, in the step's buffers and (on a GPU) their staging copy
    embedding_copies = (2 if shape.cuda else 1) if shape.embedding_on_host else 0
    parts = {
        # fp32 weights, the flat fp32 gradient, AdamW's two moments; the bf16 weight copies of autocast
        "weights and optimizer": shape.parameters * 16 + weight_copies * 2,
        "frozen embedding and LM head": (1 if shape.embedding_on_host else 2) * V * H * e
        + shape.lifted_width * dcfg.feature_dim * e,
        "token embeddings": embedding_copies * shape.micro_batches * R * T * H * e,
        "step buffers": shape.micro_batches * R * shape.stored_bytes_per_row,
        "block activations": round(R * Q * L * block_copies * e),
        "context activations": round(R * T * (c.context * H + context_kv * L * kv_width) * e),
        # a chunk holds at most the drafted labels of a micro-step (slot 0 of a span is never computed)
        "loss chunk logits": round(
            min(shape.loss_chunk, R * shape.anchors * (dcfg.span - 1))
            * V
            * 4
            * c.loss
            * dcfg.loss_logit_copies(shape.teacher)
        ),
        "dense attention mask": round(R * Q * (T + Q) * c.mask),
        "recomputed in a layer's backward": round(R * Q * rebuilt_width * e),
        # the extra copies of K and V, context and block keys, that flex_attention keeps: every layer's, or under
        # --recompute pointwise one layer's at a time (the repeat is rebuilt in its backward from the kept K and V)
        "repeated K / V heads": round(R * (T + Q) * (1 if pointwise else L) * 2 * (shape.kv_repeat - 1) * kv_width * e),
    }
    return parts


def available_memory(device: torch.device) -> int | None:
    """Bytes the step may use: free GPU memory, or the host's MemAvailable (within a cgroup's limit); None where
    unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        meminfo = dict(line.split(":", 1) for line in MEMINFO.read_text().splitlines() if ":" in line)
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:  # a container's limit may be far below the host's memory
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int((CGROUP / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return available


def host_share() -> int | None:
    """This rank's share of the host's available memory (available_memory of the CPU), split evenly between the
    LOCAL_WORLD_SIZE ranks that start on one host together; None where unknown."""
    available = available_memory(torch.device("cpu"))
    return None if available is None else available // int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def format_bytes(n: float) -> str:
    """Bytes as GB (or MB below one GB), one decimal."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def check_memory(dcfg: DrafterConfig, shape: StepShape, available: int | None, device: torch.device) -> int:
    """Refuse a step whose estimated peak exceeds `available` (on the CPU: its usable share), naming the estimate, its largest parts and what to
    change (the --anchors that would fit). Returns the estimate."""
    parts = step_memory(dcfg, shape)
    need = sum(parts.values())
    usable = None if available is None else available if device.type == "cuda" else int(available * CPU_USABLE)
    if usable is None or need <= usable:
        return need
    fitting = fitting_anchors(dcfg, shape, usable)
    largest = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    detail = ", ".join(f"{name} {format_bytes(n)}" for name, n in largest)
    where = (
        "free on the GPU"
        if device.type == "cuda"
        else f"available to this process (MemAvailable; {CPU_USABLE:.0%} of it counts)"
    )
    fix = f"--anchors {fitting} fits" if fitting else "not even --anchors 1 fits"
    fix += f" ({shape.anchors} now)"
    if shape.cuda and shape.recompute == "none":
        lighter = sum(step_memory(dcfg, dataclasses.replace(shape, recompute="pointwise")).values())
        fits = "fits" if lighter <= usable else "does not fit either"
        fix += f"; --recompute pointwise (no matmul repeated) needs about {format_bytes(lighter)} and {fits}"
    raise DflashError(
        f"a training step needs about {format_bytes(need)} ({detail}) but {format_bytes(available)} is {where}: {fix}; "
        "fewer --rows-per-step, a smaller --loss-chunk, fewer --draft-layers or a store of a shorter --token-budget "
        "also lower it; --ignore-memory-estimate runs it anyway (docs/training.md, 'Memory')"
    )


def fitting_anchors(dcfg: DrafterConfig, shape: StepShape, usable: int) -> int | None:
    """The most anchors per row, up to `shape.anchors`, whose step is estimated within `usable` bytes (None: not
    even one)."""
    total = lambda anchors: sum(step_memory(dcfg, dataclasses.replace(shape, anchors=anchors)).values())  # noqa: E731
    low, high = 0, shape.anchors  # the estimate grows with the anchors: bisect for the last that fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if total(mid) <= usable else (low, mid - 1)
    return low or None
