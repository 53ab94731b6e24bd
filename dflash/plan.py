"""`dflash plan`: what a harvest and a training run will take, before running the target.

From the target's config and tensor shapes (no weights loaded) and a tokenization of the data (all of it, or a
seeded sample of its lines, scaled up with the sampling error shown): documents, tokens, rows and padding at the
token budget; bytes per store mode and of the --teacher options; harvest and train GPU-hours estimated from the throughput bench/harvest.py and
bench/train.py measured on an H200 (docs/benchmarks.md), scaled by this target's and drafter's FLOPs per token;
and the free space at --out.
"""

import math
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dflash import methods
from dflash.config import HarvestConfig, TrainConfig
from dflash.data import load_documents
from dflash.drafter import DrafterConfig, flash_kv_repeat, loss, memory
from dflash.drafter.step_time import (
    ATTENTION_SPEEDUP,
    FLASH_SPEEDUP,
    Rates,
    nearest_bench_drafter,
    pairs_per_anchor,
    rates_at,
    row_flops,
)
from dflash.errors import DflashError
from dflash.errors import format_size as _size  # the plan's every size
from dflash.harvest import (
    BEST_CODEC_RATIO,
    check_options,
    data_config,
    feature_encoding,
    row_bytes,
    tapped_layers,
    teacher_encoding,
)
from dflash.manifest import FeatureSpec, TeacherSpec, teacher_spec
from dflash.packing import PartPlan
from dflash.parallel import check_split, checkpoint_bytes
from dflash.store import check_writable, nearest_existing
from dflash.target_files import checkpoint_file, load_config, tensor_files
from dflash.train.setup import anchors_per_row, check_shapes

H200_PEAK = 792e12
H200_MEMORY = 139 * 2**30  # what one H200 lends a process (docs/benchmarks.md)
# What the benchmarks measured on one H200 (docs/benchmarks.md): the harvest's dense MFU end to end at full depth
# of the 27B-like target (bf16 store; the compact one ran at 58.8 %), and the 4B-class drafter's train step MFU.
HARVEST_MFU = 0.563
# The head dim the train lines also price a wider-headed drafter at: flex_attention's measured faster one.
SMALLER_HEAD_DIM = 128
# The window the train line prices for a method that sees its whole context: DFlash 2's released configs'.
OTHER_WINDOW = 2048
# Store size over the raw stored bytes: the largest the H200 runs measured (docs/benchmarks.md), so that the
# estimate errs on the full side. bf16 values: 0.815 of raw on the quality target's trained activations, 0.848 for
# its projected ones (sub1/4, sub1/8), 0.80-0.81 on the 27B-like random target; fp8 bytes: 0.80 (fp8), 0.88
# (sub1/4 + fp8) on the quality target, 0.82 on the 27B-like one.
CODEC_FRACTION = {"bf16": 0.85, "fp8": 0.88}
# The teacher arrays on disk over their raw bytes: topk 0.64 on bench/teacher.py's synthetic distributions (ids and
# probabilities under zstd), rounded up; hidden is bf16 behind the features' codec.
TEACHER_CODEC_FRACTION = {"topk": 0.70, "hidden": 0.85}
# The table's store modes: name -> (--precision, --subspace).
MODES = {
    "bf16": ("bf16", "none"),
    "fp8": ("fp8", "none"),
    "sub1/2": ("bf16", "1/2"),
    "sub1/4": ("bf16", "1/4"),
    "sub1/8": ("bf16", "1/8"),
    "sub1/4+fp8": ("fp8", "1/4"),
    "sub1/8+fp8": ("fp8", "1/8"),
}


@dataclass
class DataEstimate:
    lines: int  # records of the data (after dedup, weights and --limit)
    sampled: int  # records tokenized
    documents: float
    tokens: float
    tokens_error: float  # standard error of the scaled-up token count (0 when every line was read)
    loss_tokens: float
    rows: float
    padding: float  # share of row slots
    truncated: float
    truncated_tokens: float
    split: float
    mean_document: float
    # contexts[c]: positions that can anchor a block (in the loss, a whole block before the document's end) with c
    # tokens of their document before them; train draws its anchors uniformly from such positions
    contexts: np.ndarray


def estimate_data(cfg: HarvestConfig, sample: int | None, span: int = 16) -> DataEstimate:
    """Tokenize the data (or `sample` of its lines, seeded) and pack it as the harvest would; `span`: the tokens a
    drafter's block covers from its anchor, which must fit before a document's end to anchor there."""
    data = data_config(cfg, max_length=cfg.max_length or cfg.token_budget, sample=sample)
    documents, stats = load_documents(data, cfg.model)
    scale = stats.lines / stats.lines_used
    rows = sum(
        len(PartPlan.build(documents, r, cfg.world_size or 1, cfg.token_budget).rows)
        for r in range(cfg.world_size or 1)
    )
    by_line: dict[int, int] = {}
    contexts = np.zeros(cfg.token_budget, np.int64)
    for doc in documents:
        by_line[doc.doc_id] = by_line.get(doc.doc_id, 0) + len(doc.input_ids)
        anchorable = max(0, len(doc.input_ids) - span + 1)  # a position's context is its offset in the document
        contexts[:anchorable] += doc.loss_mask[:anchorable] != 0
    per_line = np.array(list(by_line.values()) + [0] * (stats.lines_used - len(by_line)), np.float64)
    # Sampling without replacement: the standard error of N * mean, with the finite-population correction.
    error = 0.0
    if stats.lines_used < stats.lines and stats.lines_used > 1:
        error = (
            stats.lines
            * per_line.std(ddof=1)
            / math.sqrt(stats.lines_used)
            * math.sqrt(1 - stats.lines_used / stats.lines)
        )
    return DataEstimate(
        lines=stats.lines,
        sampled=stats.lines_used,
        documents=stats.documents * scale,
        tokens=stats.tokens * scale,
        tokens_error=error,
        loss_tokens=stats.loss_tokens * scale,
        rows=rows * scale,
        padding=1 - stats.tokens / max(1, rows * cfg.token_budget),
        truncated=stats.truncated * scale,
        truncated_tokens=stats.truncated_tokens * scale,
        split=stats.split * scale,
        mean_document=stats.tokens / max(1, stats.documents),
        contexts=contexts,
    )


def params_through(model: str, last_layer: int) -> int:
    """Parameters of the text model up to and including layer `last_layer`, embeddings and heads excluded, read
    from the checkpoint's tensor headers."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name, file in tensor_files(model).items():
        by_file.setdefault(file, []).append(name)
    total = 0
    for file, names in by_file.items():
        with safe_open(checkpoint_file(model, file), framework="pt") as shard:
            for name in names:
                layer = re.search(r"\.layers\.(\d+)\.", name)
                skip = any(part in name for part in ("visual", "vision", "mtp"))
                if layer and int(layer.group(1)) <= last_layer and not skip:
                    total += math.prod(shard.get_slice(name).get_shape())
    return total


def mode_bytes(features: FeatureSpec, token_budget: int, teacher: TeacherSpec | None = None) -> tuple[int, float]:
    """(raw bytes per row, expected fraction on disk) of a store encoding, with its teacher arrays."""
    raw = row_bytes(token_budget, features, teacher)
    if teacher is None:
        return raw, CODEC_FRACTION[features.precision]
    teacher_raw = token_budget * teacher.bytes_per_token
    on_disk = (raw - teacher_raw) * CODEC_FRACTION[features.precision] + teacher_raw * TEACHER_CODEC_FRACTION[
        teacher.kind
    ]
    return raw, on_disk / raw


def plan_report(cfg: HarvestConfig, sample: int | None, train: TrainConfig) -> str:
    """The report of `dflash plan`: the harvest of `cfg` and the training run `train` on its store."""
    cfg = check_options(cfg)  # harvest's checks, in harvest's words
    check_writable(Path(cfg.out))  # the tokens spill beside it, and the harvest would refuse it
    check_split(cfg.model, cfg.tensor_parallel, cfg.expert_parallel)  # a split the harvest would refuse
    config = load_config(cfg.model)
    text = config.get_text_config()
    layers = tapped_layers(cfg, text.num_hidden_layers)
    feature_dim = len(layers) * text.hidden_size
    chosen_encoding = feature_encoding(cfg, len(layers), feature_dim)  # refuses invalid options
    method = methods.get(train.method)
    block = {"block_size": train.block_size} if train.block_size is not None else {}  # 0 is refused, not the default
    dcfg = method.config_cls.from_target_config(config, layers, 0, num_layers=train.draft_layers, **block)
    anchors = anchors_per_row(train, cfg.token_budget)
    check_shapes(cfg.token_budget, anchors, feature_dim, dcfg)  # the store's width, as train checks it
    data = estimate_data(cfg, sample, dcfg.span)
    lines = []
    sampled = (
        f"a seeded sample of {data.sampled} of {data.lines} records, scaled up"
        if data.sampled < data.lines
        else f"all {data.lines} records"
    )
    error = f" +- {1.96 * data.tokens_error:,.0f} (95 %)" if data.tokens_error else ""
    lines += [
        f"data       {', '.join(cfg.data)}: {sampled}",
        f"documents  {data.documents:,.0f} ({data.truncated:,.0f} truncated, dropping {data.truncated_tokens:,.0f} "
        f"tokens; {data.split:,.0f} split), mean {data.mean_document:,.0f} tokens",
        f"tokens     {data.tokens:,.0f}{error}, {data.loss_tokens:,.0f} with loss",
        f"rows       {data.rows:,.0f} of {cfg.token_budget} tokens, {data.padding:.1%} padding",
        f"features   layers {layers} of {text.num_hidden_layers}: {feature_dim} per token",
        "",
        "| store mode | bytes per row slot (raw) | of a bf16 row | store, raw | store, expected on disk |",
        "|---|---|---|---|---|",
    ]
    encodings = {
        name: feature_encoding(
            replace(cfg, precision=precision, subspace=subspace, scale_groups=None), len(layers), feature_dim
        )
        for name, (precision, subspace) in MODES.items()
    }
    bf16_row = mode_bytes(encodings["bf16"], cfg.token_budget)[0]
    # Padding slots are zeros, which the codec stores in next to nothing: only the filled share counts on disk.
    filled = 1 - data.padding
    for mode, encoding in encodings.items():
        raw, fraction = mode_bytes(encoding, cfg.token_budget)
        size = raw * data.rows
        lines.append(
            f"| {mode} | {raw / cfg.token_budget:,.0f} | {raw / bf16_row:.3f} | {_size(size)} | "
            f"~{_size(size * fraction * filled)} |"
        )
    lines.append(
        "What a mode costs in acceptance length: README, 'Store modes'. On the quality run each measured mode's drafter "
        "came within 2.3 % of the bf16 store's tau (sub1/8+fp8 is not measured); sub1/8 is the compact mode (about an "
        "eighth of raw bf16), fp8 halves the store at no measured cost."
    )
    teacher = teacher_encoding(cfg)
    lines.append(_teacher_line(teacher, text.hidden_size, data.tokens))
    chosen = cfg.precision + (f", subspace {cfg.subspace}" if chosen_encoding.subspace is not None else "")
    chosen += f", --teacher {teacher.name}" if teacher else ""
    raw, fraction = mode_bytes(chosen_encoding, cfg.token_budget, teacher)
    need = raw * data.rows
    existing = nearest_existing(Path(cfg.out))
    free = shutil.disk_usage(existing).free
    fits = (
        "DOES NOT FIT (harvest refuses a store whose raw size, padding included, exceeds the free space by the codec's "
        "best ratio)"
        if need / BEST_CODEC_RATIO > free
        else "fits"
        if need * fraction * filled <= free
        else "fits only if the codec does well"
    )
    lines += [
        "",
        f"disk       the chosen mode ({chosen}) needs {_size(need)} raw, ~{_size(need * fraction * filled)} on disk "
        f"(its {data.padding:.1%} padding as the zeros it compresses to); {existing} has {_size(free)} free: {fits}",
    ]
    params = params_through(cfg.model, max(layers))
    harvest_tok_s = HARVEST_MFU * H200_PEAK / (2 * params)
    weights, split = checkpoint_bytes(cfg.model), cfg.tensor_parallel
    per_gpu = (
        f"{_size(weights / split)} per GPU split over --tensor-parallel {split}" if split > 1 else "whole on each GPU"
    )
    hours = data.tokens / harvest_tok_s / 3600
    step = _step_memory(method, dcfg, cfg.token_budget, anchors, raw, chosen_encoding)
    # Train refuses a step over the GPU's memory, naming the anchors that fit: price those when the default is over.
    priced = step.fitting if train.anchors is None and 0 < step.fitting < anchors else anchors
    groups = f"; ~{hours / split:,.2f} hours on each group of {split} (the split's communication not counted)"
    lines += [
        f"target     {_size(weights)} of weights (the checkpoint's files): {per_gpu}",
        f"harvest    ~{hours:,.2f} H200-hours: {params / 1e9:.2f} B parameters run up to layer {max(layers)}, at the "
        f"{HARVEST_MFU:.1%} dense MFU bench/harvest.py measured ({harvest_tok_s:,.0f} tok/s)"
        + (groups if split > 1 else ""),
        *_train_lines(
            dcfg,
            _train_options(method.name, priced, anchors, cfg.token_budget, train),
            data,
            cfg.token_budget,
            priced,
            train.epochs,
        ),
        *_memory_lines(_train_options(method.name, anchors, anchors, cfg.token_budget, train), step, anchors),
        "These are estimates: the rates are one H200's on the benchmarks' shapes; the codec fractions are the "
        "largest the benchmarks measured (a small trained target, random-weight large ones).",
    ]
    return "\n".join(lines)


def _train_options(method: str, anchors: int, asked: int, token_budget: int, train: TrainConfig) -> str:
    """The drafter and anchors a train or memory line prices, each marked as train's default where it is;
    `asked`: the anchors train would take (priced at fewer where those do not fit an H200)."""
    method_note = " (train's default method)" if train.method == TrainConfig.method else ""
    anchors_note = f" (train's default for {token_budget} tokens)" if train.anchors is None else ""
    if anchors != asked:
        anchors_note = f" (the most that fit an H200: train's default for {token_budget} tokens, {asked}, does not)"
    return f"{train.draft_layers}-layer {method} drafter{method_note}, {anchors} anchors a row{anchors_note}"


def _train_lines(
    dcfg: DrafterConfig, options: str, data: DataEstimate, token_budget: int, anchors: int, epochs: int
) -> list[str]:
    """The method's train time on one H200 (dflash.drafter.step_time), and the same with the other choice of context:
    full where the method slides a window, DFlash 2's 2048-token window where it sees it all."""
    if not data.contexts.any():
        return [
            f"train      nothing to train on: no position here can anchor a block of {dcfg.span} tokens (one in "
            f"the loss with {dcfg.span - 1} more tokens of its document after it; documents here: mean "
            f"{data.mean_document:,.0f} tokens); give longer answers or a smaller --block-size"
        ]
    bench = nearest_bench_drafter(dcfg.hidden_size)
    rates = rates_at(bench, dcfg.head_dim)

    def cost(window: int | None, at: Rates = rates) -> str:
        pairs = pairs_per_anchor(data.contexts, dcfg.block_size, window)
        flops = row_flops(dcfg, token_budget, anchors, pairs)
        seconds = at.seconds(flops)
        hours = epochs * data.rows * seconds / 3600
        share = flops["attention"] / sum(flops.values())
        return f"~{hours:,.2f} H200-hours, ~{seconds:.3g} s a row (attention {share:.0%} of its FLOPs)"

    window = dcfg.sliding_window
    other = None if window is not None else OTHER_WINDOW
    name = f"its {window}-token window" if window is not None else "full context"
    other_name = (
        f"a {other}-token window (--drafter-option sliding_window={other})"
        if other is not None
        else "full context (--drafter-option sliding_window=none)"
    )
    limit = window or other  # the one of the two that is a window
    reaches = limit <= int(np.flatnonzero(data.contexts).max(initial=0))
    lines = [
        f"train      {epochs} epochs of a {options}, {name}: {cost(window)}",
        f"           with {other_name}: {cost(other)}"
        + ("" if reaches else f" (no block's context here reaches {limit} tokens)"),
    ]
    if dcfg.head_dim in ATTENTION_SPEEDUP and dcfg.head_dim > SMALLER_HEAD_DIM:  # measured faster: the long-row lever
        lines.append(
            f"           {name} at head_dim {SMALLER_HEAD_DIM}, its widths kept (--drafter-option head_dim="
            f"{SMALLER_HEAD_DIM}; narrower heads cost tau: half the head dim lost 3.9 and 8.7 % of held-out tau at "
            "equal steps in two quality runs, docs/benchmarks.md 'Long rows'): "
            f"{cost(window, rates_at(bench, SMALLER_HEAD_DIM))}"
        )
    if dcfg.head_dim in FLASH_SPEEDUP:  # measured faster at this head dim, and no tau cost: the other lever
        lines.append(
            f"           {name} with --attention-kernel-option BACKEND=FLASH (flash-attn-4's kernels, pip install "
            "-e '.[flash]'; the same model, measured on an H100): "
            f"{cost(window, rates_at(bench, dcfg.head_dim, flash=True))}"
        )
    measured = "" if dcfg.head_dim in ATTENTION_SPEEDUP else f"; head_dim {dcfg.head_dim} priced at 256's"
    lines.append(
        f"           (dflash.drafter.step_time: a row's matmul and attention FLOPs at the two rates that reproduce two "
        f"measured steps of bench/train.py's drafter {bench} on one H200, {rates.matmul / 1e12:.0f} and "
        f"{rates.attention / 1e12:.0f} TFLOP/s at head_dim {dcfg.head_dim}{measured}; docs/benchmarks.md, "
        "'Step time model')"
    )
    return lines


@dataclass(frozen=True)
class StepMemory:
    need: float  # bytes of a train step on one GPU (dflash.drafter.memory)
    pointwise: float  # the same with --recompute pointwise
    fitting: int  # the most anchors up to the asked ones that fit an H200 (0: not even one)
    kv_repeat: int = 1  # each K / V head's copies under BACKEND=FLASH where plan prices it (1: none, or not priced)
    flash: tuple[float, float] = (0.0, 0.0)  # need and pointwise with those copies


def _step_memory(method, dcfg: DrafterConfig, token_budget: int, anchors: int, row_raw: int, encoding) -> StepMemory:
    """The method's train step memory at these anchors (train's default grows with the row), and the anchors that
    fit one H200."""
    shape = memory.StepShape(
        rows=1,
        micro_batches=1,
        token_budget=token_budget,
        anchors=anchors,
        loss_chunk=loss.default_chunk_size(dcfg.vocab_size),
        stored_bytes_per_row=row_raw,
        parameters=memory.parameter_count(method.model_cls, dcfg),
        lifted_width=encoding.width if encoding.subspace is not None else 0,
        cuda=True,
        embedding_on_host=memory.embedding_on_host(TrainConfig.embedding, True, token_budget, dcfg.vocab_size),
    )
    layer_parameters = memory.parameter_count(method.model_cls, dcfg, layers_only=True)
    pointwise = replace(shape, recompute="pointwise", layer_parameters=layer_parameters)
    total = lambda shape: sum(memory.step_memory(dcfg, shape).values())  # noqa: E731
    # Under FLASH the K / V copies cost memory; priced where plan prices FLASH's time (its measured head dims).
    flash = {"BACKEND": "FLASH"} if dcfg.head_dim in FLASH_SPEEDUP else None
    repeat = flash_kv_repeat(dcfg.num_attention_heads, dcfg.num_key_value_heads, flash)
    return StepMemory(
        need=total(shape),
        pointwise=total(pointwise),
        fitting=memory.fitting_anchors(dcfg, shape, H200_MEMORY),
        kv_repeat=repeat,
        flash=(total(replace(shape, kv_repeat=repeat)), total(replace(pointwise, kv_repeat=repeat))),
    )


def _memory_lines(options: str, step: StepMemory, anchors: int) -> list[str]:
    verdict = (
        "fits"
        if step.fitting == anchors
        else f"does not fit: --anchors {step.fitting} does"
        if step.fitting
        else "does not fit even at --anchors 1"
    )
    lines = [
        f"memory     a train step of a {options}, on one row: ~{_size(step.need)} on a GPU, "
        f"~{_size(step.pointwise)} with --recompute pointwise (dflash.drafter.memory, docs/training.md 'Memory'); an H200's "
        f"139 GiB: {verdict}"
    ]
    if step.kv_repeat > 1:
        lines.append(
            f"           with BACKEND=FLASH each K / V head is repeated {step.kv_repeat}x (a power-of-two group of "
            f"query heads, docs/training.md 'Attention kernels'): ~{_size(step.flash[0])}, "
            f"~{_size(step.flash[1])} with --recompute pointwise"
        )
    return lines


def _teacher_line(teacher: TeacherSpec | None, hidden_size: int, tokens: float) -> str:
    """What --teacher adds per token (raw) to any mode: the chosen option's, or those on offer."""
    if teacher is not None:
        return (
            f"teacher    --teacher {teacher.name} adds {teacher.bytes_per_token:,} bytes per token raw "
            f"({_size(teacher.bytes_per_token * tokens)} for the data), included in the disk line below"
        )
    topk, hidden = (teacher_spec(kind, 32, hidden_size).bytes_per_token for kind in ("topk", "hidden"))
    return (
        f"teacher    none: the drafter learns the target's argmax, what serving at temperature 0 verifies. For sampled "
        f"serving (temperature > 0) harvest with --teacher topk:32 ({topk} bytes per token raw; topk:K adds 6K + 2, "
        f"--teacher hidden adds 2H = {hidden:,}, {_size(hidden * tokens)} for the data) and train --method dspark, which "
        "learns the target's distribution; for both temperatures train --method dflash2 from such a store with "
        "--drafter-option selector_top_k=64 (README, 'Which to use')"
    )


def check_plan_options(sample: int | None) -> None:
    if sample is not None and sample < 2:
        raise DflashError(f"--sample {sample}: give at least 2 lines (the sampling error needs two), or leave it out")
