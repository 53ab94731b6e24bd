"""The harvest driver: run the frozen target once over the data and write its tapped features to the store.

Before any forward, every input is validated and a deterministic packing plan fixes which document goes to
which rank, row and offset; the store's arrays are preallocated from it, so a rerun resumes after the committed
rows. Per row group, the main thread runs forward batches (documents sorted by length, one per batch row,
right-padded to a multiple of 64, no attention mask), scatters the real tokens into a device row buffer and
starts one copy into pinned host memory on a side stream; a writer thread (compression and disk only, no GPU
work) writes finished groups behind a bounded queue, so in steady state the GPU never waits for I/O. The run
ends with a log line of how long the forward thread was blocked and on what (`PipelineStalls`): a harvest
slower than the bare forward either shows the wait there or loses its time elsewhere (the GIL, the CPU).
"""

import contextlib
import errno
import hashlib
import json
import logging
import os
import queue
import shutil
import signal
import threading
import time
import uuid
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dflash import __version__, features, manifest, selfcheck, sources, store, verify
from dflash.config import HarvestConfig
from dflash.data import DataConfig, Document, load_documents, load_tokenizer
from dflash.device import DTYPES, local_device
from dflash.drafter import rope_theta_of
from dflash.errors import DflashError
from dflash.packing import PAD_MULTIPLE, PartPlan, forward_batches, round_up
from dflash.target import TappedTarget, check_layer_ids, default_layer_ids
from dflash.target_files import MASK_TOKEN, config_hash, load_config, weights_sha256

logger = logging.getLogger("dflash")

BLOCK_SIZE = 16  # a row must hold at least one DFlash block
HOST_BUFFERS = 3  # pinned row-group buffers: one being filled, up to two queued or being written


# ---------------------------------------------------------------------------------------------- validation


def _resolve(cfg: HarvestConfig) -> HarvestConfig:
    """Fill the defaults that depend on the environment and check the options that need no file."""
    rank = cfg.rank if cfg.rank is not None else int(os.environ.get("RANK", 0))
    world_size = cfg.world_size if cfg.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    device = str(local_device(cfg.device))
    cfg = check_options(HarvestConfig(**{**asdict(cfg), "rank": rank, "world_size": world_size, "device": device}))
    if not 0 <= cfg.rank < cfg.world_size:
        raise DflashError(f"rank {cfg.rank} must be in 0..{cfg.world_size - 1} for world size {cfg.world_size}")
    return cfg


def check_options(cfg: HarvestConfig) -> HarvestConfig:
    """The checks of the options that need no file, shared by `dflash plan`; fills in the max length."""
    cfg = replace(cfg, max_length=cfg.max_length or cfg.token_budget)
    if cfg.token_budget < BLOCK_SIZE:
        raise DflashError(
            f"token budget {cfg.token_budget} is too small to hold a block of {BLOCK_SIZE} tokens; use at least "
            f"{BLOCK_SIZE} (the default, 12288, suits a GPU)"
        )
    if not 1 <= cfg.max_length <= cfg.token_budget:
        raise DflashError(
            f"--max-length {cfg.max_length} must be between 1 and the token budget {cfg.token_budget} (a document "
            "is packed whole into a row); lower --max-length or raise --token-budget"
        )
    if cfg.forward_tokens < 1:
        raise DflashError(f"forward tokens must be positive, got {cfg.forward_tokens}")
    if cfg.dtype not in DTYPES:
        raise DflashError(f"dtype {cfg.dtype!r} is not one of {', '.join(DTYPES)}")
    if cfg.precision not in manifest.PRECISIONS:
        raise DflashError(f"--precision {cfg.precision!r} is not one of {', '.join(manifest.PRECISIONS)}")
    if cfg.scale_groups is not None and (cfg.precision != "fp8" or cfg.scale_groups < 1):
        raise DflashError("--scale-groups takes a positive number, and only with --precision fp8")
    if cfg.calibration_tokens < 1:
        raise DflashError(f"--calibration-tokens must be positive, got {cfg.calibration_tokens}")
    if cfg.projection_from is not None and subspace_width(cfg.subspace, None) is None:
        raise DflashError("--projection-from takes the projection of a subspace store: give --subspace too")
    return cfg


def tapped_layers(cfg: HarvestConfig, num_layers: int) -> list[int]:
    """The layers to tap: --layers, checked, or the DFlash rule's (harvest and plan alike)."""
    return default_layer_ids(num_layers) if cfg.layers is None else check_layer_ids(cfg.layers, num_layers)


def subspace_width(value: str | int | None, feature_dim: int | None) -> int | None:
    """`--subspace`: K, a fraction of the feature width ("1/4"), or none; `feature_dim` None checks the form only."""
    text = str(value).strip().lower() if value is not None else "none"
    if text in ("none", ""):
        return None
    width = -1
    try:
        numerator, _, denominator = text.partition("/")
        if not denominator:
            width = int(numerator)
        elif int(denominator) > 0 and 0 < int(numerator) <= int(denominator):
            width = round((feature_dim or int(denominator)) * int(numerator) / int(denominator))
    except ValueError:
        pass
    if not 1 <= width <= (feature_dim or width):
        within = f"between 1 and the feature width {feature_dim}" if feature_dim else "of at least 1"
        raise DflashError(
            f"--subspace {value} is not a width {within}; give K (e.g. {(feature_dim or 2048) // 4}), a fraction such "
            "as 1/4, or none (the full width)"
        )
    return width


def feature_encoding(cfg: HarvestConfig, num_layers: int, feature_dim: int) -> manifest.FeatureSpec:
    """The stored encoding the options ask for (the subspace's calibration record is filled in once it is done)."""
    width = subspace_width(cfg.subspace, feature_dim)
    stored = width or feature_dim
    groups = 0
    if cfg.precision == "fp8":
        groups = cfg.scale_groups or features.default_scale_groups(stored, num_layers, width is not None)
        if stored % groups:
            raise DflashError(f"--scale-groups {groups} does not divide the stored width {stored}; pick a divisor")
    subspace = manifest.SubspaceSpec(width, 0.0, 0, 0) if width else None
    return manifest.FeatureSpec(cfg.precision, stored, groups, subspace)


def teacher_encoding(cfg: HarvestConfig) -> manifest.TeacherSpec | None:
    """`--teacher`: none, hidden, or topk:K with K from 1 to the target's vocabulary size."""
    value = str(cfg.teacher).strip().lower()
    if value == "none":
        return None
    text = load_config(cfg.model).get_text_config()
    kind, _, k = value.partition(":")
    if value == "hidden":
        return manifest.teacher_spec("hidden", 0, text.hidden_size)
    if kind != "topk":
        raise DflashError(
            f"--teacher {cfg.teacher} is not one of none, hidden or topk:K; give e.g. topk:32 (the 32 most probable "
            "next tokens per position), hidden (the final hidden state) or none"
        )
    if not k.isdigit() or not 1 <= int(k) <= text.vocab_size:
        raise DflashError(
            f"--teacher {cfg.teacher}: K must be an integer from 1 to the vocabulary size {text.vocab_size}; give "
            "e.g. topk:32"
        )
    return manifest.teacher_spec("topk", int(k), text.hidden_size)


def data_config(cfg: HarvestConfig, **overrides) -> DataConfig:
    """How the harvest (and `dflash plan`) reads cfg.data."""
    options = dict(
        max_length=cfg.max_length,
        overflow=cfg.overflow,
        workers=cfg.workers,
        seed=cfg.data_seed,
        dedup=cfg.dedup,
        limit=cfg.limit,
        spill_dir=store.nearest_existing(Path(cfg.out)),  # the output's disk has room; /tmp may be small
    )
    return DataConfig(cfg.data, **{**options, **overrides})


def _data_identity(cfg: HarvestConfig) -> dict:
    """Size and sha256 of the data (and of the mixing options that are not the defaults): a resumed harvest must
    read the very same documents."""
    mixing = [f for f in fields(HarvestConfig) if f.name in ("dedup", "limit", "data_seed")]
    options = {f.name: getattr(cfg, f.name) for f in mixing if getattr(cfg, f.name) != f.default}
    return sources.identity(cfg.data, **options)


def _fingerprint(cfg: HarvestConfig) -> dict:
    """What decides the store's content: a store is only ever resumed by a run with the same fingerprint."""
    text = load_config(cfg.model).get_text_config()
    num_layers = text.num_hidden_layers
    layers = tapped_layers(cfg, num_layers)
    model = str(Path(cfg.model).resolve()) if Path(cfg.model).exists() else cfg.model
    encoding = feature_encoding(cfg, len(layers), len(layers) * text.hidden_size)
    teacher = teacher_encoding(cfg)
    fingerprint = {
        "precision": encoding.precision,
        "stored_width": encoding.width,
        "scale_groups": encoding.scale_groups,
        "subspace": encoding.subspace is not None,
        "calibration_tokens": cfg.calibration_tokens
        if encoding.subspace is not None and not cfg.projection_from
        else None,
        "projection_sha256": _borrowed_projection(cfg, encoding, len(layers) * text.hidden_size)[2],
        "model": model,
        "weights_sha256": weights_sha256(cfg.model),  # weights rewritten in place under the same config.json
        "layers": layers,
        **_data_identity(cfg),
        "dedup": cfg.dedup,
        "token_budget": cfg.token_budget,
        "max_length": cfg.max_length,
        "overflow": cfg.overflow,
        "world_size": cfg.world_size,
        "dtype": cfg.dtype,
        "format_version": store.FORMAT_VERSION,
        **({"teacher": teacher.name} if teacher else {}),  # absent without one: those stores are as before
    }
    if cfg.projection_from is not None:
        verify.check_projection_source(Path(cfg.projection_from), fingerprint, config_hash(cfg.model))
    return fingerprint


def _borrowed_projection(cfg: HarvestConfig, encoding: manifest.FeatureSpec, feature_dim: int):
    """(P, calibration record, sha256 of P) of --projection-from's store; (None, None, None) without it."""
    if cfg.projection_from is None:
        return None, None, None
    if not (Path(cfg.projection_from) / store.HARVEST_FILE).exists():
        raise DflashError(
            f"--projection-from {cfg.projection_from} is not a dflash store (no {store.HARVEST_FILE} there); give the "
            "folder of the finished subspace store whose projection to use"
        )
    stored = store.read_projection(Path(cfg.projection_from))
    if stored is None:
        raise DflashError(f"--projection-from {cfg.projection_from} is not a subspace store (it has no projection)")
    projection, record = stored
    if projection.shape != (encoding.width, feature_dim):
        raise DflashError(
            f"the projection of {cfg.projection_from} is {projection.shape[0]} x {projection.shape[1]}, this harvest "
            f"stores {encoding.width} of {feature_dim} features; give the --subspace and --layers it was made with"
        )
    return projection, record, hashlib.sha256(projection.tobytes()).hexdigest()


def _tokenizer_spec(model: str) -> manifest.TokenizerSpec:
    tokenizer = load_tokenizer(model)
    vocab = tokenizer.get_vocab()
    mask_id = vocab.get(MASK_TOKEN)
    if mask_id is None:
        logger.warning("the tokenizer of %s has no %s token; the drafter will need a mask token id", model, MASK_TOKEN)
    special = {name: getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad", "unk")}
    return manifest.TokenizerSpec(model, len(tokenizer), {**special, "mask": mask_id})


def target_spec(model: str, target: TappedTarget) -> manifest.TargetSpec:
    """The target as the manifest records it: identity plus the text-model fields the drafter is shaped from."""
    config = load_config(model)
    text = config.get_text_config()
    return manifest.TargetSpec(
        **asdict(target.info),
        intermediate_size=getattr(text, "intermediate_size", None),
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None),
        head_dim=getattr(text, "head_dim", None),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_of(text),
        max_position_embeddings=text.max_position_embeddings,
        tie_word_embeddings=bool(
            getattr(config, "tie_word_embeddings", False)
        ),  # the checkpoint's, not a VL text part's
    )


# ---------------------------------------------------------------------------------------------- the harvest


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) during a harvest: unwinds like KeyboardInterrupt, so the writer commits what it has."""


def _on_sigterm(signum, _frame):
    raise Interrupted(signal.Signals(signum).name)


def run_harvest(cfg: HarvestConfig) -> Path:
    """Harvest this rank's part of the store at cfg.out (resuming it if started); return the store path."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return _harvest(_resolve(cfg))
    except (KeyboardInterrupt, Interrupted) as exc:
        why = exc.args[0] if isinstance(exc, Interrupted) else "SIGINT"
        raise DflashError(
            f"harvest interrupted ({why}); the rows committed so far are kept: rerun the same command to resume "
            "after them"
        ) from None
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise DflashError(
            f"the disk holding {cfg.out} is full ({exc}); free space and rerun the same command: the harvest "
            "resumes after the rows already written"
        ) from exc
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _harvest(cfg: HarvestConfig) -> Path:
    out = Path(cfg.out)
    fingerprint = store.as_recorded(out, _fingerprint(cfg))
    state = store.check_folder(out, fingerprint)
    if state == "complete" and not cfg.repair:
        if cfg.self_check > 0 and store.read_manifest(out / store.MANIFEST_FILE).self_check is None:
            logger.info("%s is complete, but no check against the target was recorded (stopped during it?)", out)
            _self_check(out, cfg)
            return out
        logger.info(
            "%s is already a complete store; nothing to do (if `dflash inspect --verify` finds damaged chunks, rerun "
            "this command with --repair)",
            out,
        )
        return out
    store.check_writable(out)
    if cfg.repair and state != "new":  # what of the part's metadata is damaged is rebuilt first
        for rewritten in verify.repair_metadata(out, cfg.rank, store.read_manifest(out / store.HARVEST_FILE)):
            logger.info("repaired: rewrote %s", rewritten)
    with contextlib.ExitStack() as stack:  # the part's lock, once taken, is held to the end of the run

        def lock() -> None:
            stack.enter_context(store.part_lock(out, cfg.rank))

        return _harvest_part(cfg, out, fingerprint, state, lock)


def _harvest_part(cfg: HarvestConfig, out: Path, fingerprint: dict, state: str, lock) -> Path:
    progress = store.part_progress(out, cfg.world_size)[cfg.rank] if state != "new" else None
    done = progress is not None and progress["rows_committed"] == progress["rows"]
    damage = None
    if cfg.repair:
        if not done:
            raise DflashError(
                f"--repair mends a finished part, and part {store.part_name(cfg.rank)} of {out} is not finished; rerun "
                "the same command without --repair to finish it first"
            )
        recorded = store.read_manifest(out / store.HARVEST_FILE)
        damage = verify.part_damage(out, cfg.rank, recorded.features, recorded.teacher)
        whole = store.damaged_whole_arrays(out, recorded)  # the projection, the document sources
        if not damage.rows and not damage.documents and not whole:
            logger.info("part %s of %s: every chunk present and its checksum correct; nothing to repair", cfg.rank, out)
            if state != "complete":
                _finish(out, cfg)
            return out
        for problem in whole.values():
            logger.info("repairing: %s", problem)
        logger.info("part %d: re-harvesting %d damaged rows %s", cfg.rank, len(damage.rows), damage.rows[:20])
    elif done:
        _finish(out, cfg)
        return out

    documents, stats = load_documents(data_config(cfg), cfg.model)
    logger.info("data %s: %s", ", ".join(cfg.data), stats.summary())
    if torch.device(cfg.device).type == "cuda":
        # Triton kernels (fla's) launch on the current device, and pinned buffers bind to it: under torchrun
        # every rank would otherwise start a context on cuda:0.
        torch.cuda.set_device(cfg.device)
    plan = PartPlan.build(documents, cfg.rank, cfg.world_size, cfg.token_budget)
    rows_left = len(damage.rows) if damage else len(plan.rows) - (progress or {}).get("rows_committed", 0)
    check_free_space(out, cfg, fingerprint, rows_left)
    # Lock the part before anything of it is written (or a leftover deleted): a second run of this rank is refused
    # here, before it loads the target. Data and free space were checked first: a refused run leaves no folder.
    lock()
    if state == "resume" and not cfg.repair:
        progress = store.part_progress(out, cfg.world_size)[cfg.rank]  # the run that held the lock may have gone on
        if progress is not None and progress["rows_committed"] == progress["rows"]:
            _finish(out, cfg)
            return out
    teacher = teacher_encoding(cfg)
    target = TappedTarget(
        cfg.model,
        fingerprint["layers"],
        cfg.device,
        DTYPES[cfg.dtype],
        cfg.allow_slow_kernels,
        teacher.kind if teacher else None,
    )
    header = _header(cfg, fingerprint, target, stats, teacher)
    if state == "resume" and store.read_manifest(out / store.HARVEST_FILE).target != header.target:
        raise DflashError(
            f"the checkpoint at {cfg.model} changed since {out} was started (its config differs); harvest into a new folder"
        )
    projection = None
    if header.features.subspace is not None and _projection_damaged(out, damage is not None and whole):
        recorded = store.read_manifest(out / store.HARVEST_FILE)  # None: stopped before harvest.json, no row uses it
        projection, header = _recalibrated(out, cfg, header, documents, target, recorded)
    elif header.features.subspace is not None:
        projection, header = _calibrated(out, cfg, header, documents, target)
    if damage is not None and store.DOCUMENT_SOURCES in whole:
        shutil.rmtree(out / store.DOCUMENT_SOURCES)  # rewritten below from the data, as every rank computes it

    store.create_store(out, header)  # harvest.json: the first write of this run but the calibration
    # Ranks started together race to write harvest.json: each checks the one it finds before its first row.
    store.check_header(out, header, cfg.rank)
    if len(stats.sources) > 1:  # what training needs for its metrics per source
        store.write_document_sources(out, document_sources(documents, stats.lines))
    part = store.PartWriter(out, plan.part_spec(cfg.rank, header.features, header.teacher), header)
    counts = plan.counts()
    logger.info(
        "rank %d/%d: %d documents, %d tokens in %d rows of %d (%.1f%% padding)%s",
        cfg.rank,
        cfg.world_size,
        counts["documents"],
        counts["tokens"],
        len(plan.rows),
        cfg.token_budget,
        100 * counts["padding_tokens"] / max(1, len(plan.rows) * cfg.token_budget),
        f"; resuming after row {part.rows_committed}" if part.rows_committed else "",
    )
    if damage is not None:
        return _repair(cfg, out, plan, target, part, header, projection, damage, state)
    stalls = _run_rows(cfg, plan, target, part, header, projection)
    logger.info("rank %d: %s", cfg.rank, stalls.describe())
    _finish(out, cfg, target)
    return out


def _repair(cfg, out: Path, plan: PartPlan, target, part, header, projection, damage, state: str) -> Path:
    """Rewrite the damaged rows of a finished part. The rows are re-harvested in the row groups an uninterrupted
    harvest formed (multiples of the group size from row 0), so the forward batches, and the bytes, are the same."""
    if damage.documents:
        part.arrays["documents"][:] = plan.documents_table()
    per_group = max(1, cfg.forward_tokens // cfg.token_budget)
    firsts = sorted({row // per_group * per_group for row in damage.rows})
    groups = [(first, min(first + per_group, len(plan.rows))) for first in firsts]
    if groups:
        _run_rows(cfg, plan, target, part, header, projection, groups)
    left = verify.part_damage(out, cfg.rank, header.features, header.teacher)
    if left.rows or left.documents:
        raise DflashError(
            f"part {store.part_name(cfg.rank)} of {out} is still damaged after the repair: {left.problems[:3]}"
        )
    logger.info("part %d repaired: %d rows rewritten, every chunk of the part checks", cfg.rank, len(damage.rows))
    if state != "complete":
        _finish(out, cfg, target)
    return out


# The lossless codecs shrink stored rows by at most about 1.4x (docs/shard-format.md): a harvest whose rows, at
# that ratio, would still not fit on the disk cannot succeed.
BEST_CODEC_RATIO = 1.45


def document_sources(documents: list[Document], doc_ids: int) -> np.ndarray:
    """int16 [doc_ids]: the data source of each doc id, -1 for a record of the mixture that gave no document."""
    sources = np.full(doc_ids, -1, np.int16)
    sources[[d.doc_id for d in documents]] = [d.source for d in documents]
    return sources


def row_bytes(token_budget: int, features: manifest.FeatureSpec, teacher: manifest.TeacherSpec | None = None) -> int:
    """Uncompressed bytes of one stored row: the features (and fp8 scales), the token arrays and the teacher's."""
    token_bytes = sum(np.dtype(d).itemsize for d in store.TOKEN_ARRAYS.values())
    teacher_bytes = teacher.bytes_per_token if teacher else 0
    return token_budget * (
        features.width * features.bytes_per_value + features.scale_groups + token_bytes + teacher_bytes
    )


def check_free_space(out: Path, cfg: HarvestConfig, fingerprint: dict, rows_left: int) -> None:
    """Refuse, before the target loads, a harvest that cannot fit on the disk of --out (every rank's rows are
    counted as this rank's: they usually share the disk); warn when it fits only if the codec compresses."""
    stored = manifest.FeatureSpec(fingerprint["precision"], fingerprint["stored_width"], fingerprint["scale_groups"])
    need = rows_left * cfg.world_size * row_bytes(cfg.token_budget, stored, teacher_encoding(cfg))
    existing = store.nearest_existing(out)
    free = shutil.disk_usage(existing).free
    sizes = f"the rows left need {need / 1e9:.1f} GB before compression, {existing} has {free / 1e9:.1f} GB free"
    if need / BEST_CODEC_RATIO > free:
        raise DflashError(
            f"this harvest cannot fit: {sizes} (the codec saves at most ~30 %); free space, harvest to a larger disk, or "
            "store fewer bytes per token: --precision fp8 (about half) or --subspace 1/8 (about an eighth; README, "
            "'Store modes', gives each mode's cost in acceptance length)"
        )
    if need > free:
        logger.warning("%s: the harvest fits only if the codec compresses well; watch the disk", sizes)


def _header(cfg: HarvestConfig, fingerprint: dict, target: TappedTarget, stats, teacher) -> manifest.Manifest:
    """harvest.json: everything the manifest states that no part's progress decides."""
    options = {k: v for k, v in asdict(cfg).items() if k not in ("rank", "device")}
    if teacher is None:
        del options["teacher"]  # a store without a teacher records what it did before the option existed
    header = store.new_manifest(
        target=target_spec(cfg.model, target),
        layer_ids=target.layer_ids,
        token_budget=cfg.token_budget,
        tokenizer=_tokenizer_spec(cfg.model),
        fingerprint=fingerprint,
        features=feature_encoding(cfg, len(target.layer_ids), len(target.layer_ids) * target.info.hidden_size),
        options=options,
        data={
            "file": ", ".join(Path(spec).name for spec in cfg.data),
            **{key: fingerprint[key] for key in ("data_bytes", "data_sha256")},
            "stats": {k: v for k, v in asdict(stats).items() if k != "sources"},
        },
        dflash_version=__version__,
        teacher=teacher,
    )
    return replace(header, sources=tuple(stats.sources))


def _calibrated(
    out: Path, cfg: HarvestConfig, header: manifest.Manifest, documents: list[Document], target: TappedTarget
):
    """The store's projection (calibrating it first if no rank has yet) and the header that records it."""
    out.mkdir(parents=True, exist_ok=True)
    stored = store.read_projection(out)
    made_for = hashlib.sha256(json.dumps(header.fingerprint, sort_keys=True).encode()).hexdigest()
    if stored is not None and stored[1].get("fingerprint_sha256") != made_for:
        raise DflashError(
            f"{out} holds the projection of a harvest with other settings (its harvest stopped before harvest.json); "
            f"delete {out / store.PROJECTION} or choose a new --out"
        )
    if stored is None and cfg.projection_from is not None:
        projection, record, _ = _borrowed_projection(cfg, header.features, header.feature_dim)
        stored = _written_projection(out, cfg, projection, {**record, "fingerprint_sha256": made_for}, made_for)
    if stored is None:
        width = header.features.subspace.width
        moment, sample = _second_moment(documents, target, cfg.calibration_tokens, cfg.forward_tokens)
        projection, captured = features.top_subspace(moment.sum, width)
        logger.info(
            "calibration: %d tokens of %d documents; the top %d of %d directions hold %.2f%% of the second moment",
            moment.tokens,
            sample,
            width,
            header.feature_dim,
            100 * captured,
        )
        record = {
            "captured": captured,
            "calibration_tokens": moment.tokens,
            "calibration_documents": sample,
            "fingerprint_sha256": made_for,
        }
        stored = _written_projection(out, cfg, projection.numpy(), record, made_for)
    projection, record = stored
    subspace = manifest.SubspaceSpec(
        header.features.width,
        float(record["captured"]),
        int(record["calibration_tokens"]),
        int(record["calibration_documents"]),
    )
    header = replace(header, features=replace(header.features, subspace=subspace))
    return torch.from_numpy(projection).to(cfg.device), header


def _projection_damaged(out: Path, whole: dict | bool) -> bool:
    """Whether the store's projection must be recomputed: found damaged by --repair, or unreadable on a resume."""
    if whole:
        return store.PROJECTION in whole
    try:
        store.read_projection(out)
    except DflashError as exc:
        logger.info("recomputing: %s", exc)
        return True
    return False


def _recalibrated(out: Path, cfg: HarvestConfig, header, documents: list[Document], target, recorded):
    """`--repair` of a damaged (or missing) projection: calibrate again, deterministically, and keep the result
    only if it is the matrix the store's rows were encoded with (the calibration record of harvest.json, and the
    sha256 the damaged array's attributes record when they are readable); otherwise put the damaged one back."""
    folder, aside = out / store.PROJECTION, out / f"{store.TMP_PREFIX}{store.PROJECTION}.damaged.{uuid.uuid4().hex}"
    old_sha256 = None
    if folder.exists():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            old_sha256 = json.loads((folder / "zarr.json").read_text())["attributes"].get("sha256")
        os.rename(folder, aside)
    try:
        projection, header = _calibrated(out, cfg, header, documents, target)
        new_sha256 = store.read_projection(out)[1].get("sha256")
        if recorded is not None and (
            header.features.subspace != recorded.features.subspace or old_sha256 not in (None, new_sha256)
        ):
            raise DflashError(
                f"the recomputed projection of {out} is not the one its rows were encoded with (calibration "
                f"{header.features.subspace}, the store records {recorded.features.subspace}): rerun --repair on the "
                f"device type and --dtype the harvest ran with ({recorded.fingerprint.get('dtype')}), restore "
                f"{folder} from a copy, or harvest again into a new folder"
            )
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)  # nothing half-repaired: the damaged array goes back
        if aside.exists():
            os.rename(aside, folder)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    logger.info("projection of %s recomputed: the same matrix as the one the rows were encoded with", out)
    return projection, header


def _written_projection(out: Path, cfg: HarvestConfig, projection: np.ndarray, record: dict, made_for: str):
    """Store this rank's projection unless another rank's is there, and check that the stored one was made for
    this rank's settings: ranks that calibrate at once with other settings must not share a matrix."""
    stored = store.write_projection(out, projection, record)
    if stored[1].get("fingerprint_sha256") != made_for:
        raise DflashError(
            f"rank {cfg.rank} calibrated with other settings than the rank that stored {out / store.PROJECTION} "
            f"(another --subspace, --precision, --data or --layers; its shape is {stored[0].shape[0]} x "
            f"{stored[0].shape[1]}, this rank's {projection.shape[0]} x {projection.shape[1]}); every rank of a "
            "harvest must run the same command but for --rank: stop this rank and rerun it with the other ranks' "
            "settings, or harvest into a new --out folder"
        )
    return stored


def _second_moment(documents: list[Document], target: TappedTarget, tokens: int, forward_tokens: int):
    """The uncentered second moment of the target's features over a seeded sample of the documents (the same on
    every rank): whole documents in a random order until `tokens` tokens, the last one cut to fit."""
    order = np.random.default_rng(0).permutation(len(documents))
    sample, total = [], 0
    for i in order:
        ids = documents[i].input_ids[: tokens - total]
        sample.append(ids)
        total += len(ids)
        if total >= tokens:
            break
    sample.sort(key=len, reverse=True)
    device = target.device
    moment = features.SecondMoment(len(target.layer_ids) * target.info.hidden_size, device)
    start = 0
    while start < len(sample):
        width = round_up(len(sample[start]), PAD_MULTIPLE)
        batch = sample[start : start + max(1, forward_tokens // width)]
        ids = np.zeros((len(batch), width), np.int64)
        for b, doc in enumerate(batch):
            ids[b, : len(doc)] = doc
        hidden = target.features(torch.from_numpy(ids).to(device))
        for b, doc in enumerate(batch):
            moment.add(hidden[b, : len(doc)])
        start += len(batch)
    return moment, len(sample)


def _finish(out: Path, cfg: HarvestConfig, target: TappedTarget | None = None) -> None:
    if store.finalize(out, store.read_manifest(out / store.HARVEST_FILE)):
        logger.info("store complete: %s", out)
        if cfg.self_check > 0:
            _self_check(out, cfg, target)
    else:
        parts = store.part_progress(out, cfg.world_size)
        pending = [r for r, p in enumerate(parts) if p is None or p["rows_committed"] < p["rows"]]
        logger.info("part %d done; the store completes when ranks %s finish", cfg.rank, pending)


def _self_check(out: Path, cfg: HarvestConfig, target: TappedTarget | None = None) -> None:
    """Re-run `cfg.self_check` documents of the complete store through the target and record the result."""
    if target is None:
        m = store.read_manifest(out / store.MANIFEST_FILE)
        kind = m.teacher.kind if m.teacher else None
        target = TappedTarget(cfg.model, list(m.layer_ids), cfg.device, DTYPES[cfg.dtype], cfg.allow_slow_kernels, kind)
    check = selfcheck.reforward_check(out, target, cfg.self_check)
    store.record_self_check(out, check)
    selfcheck.log_check(check, out)


# ---------------------------------------------------------------------------------------------- the pipeline


@dataclass
class PipelineStalls:
    """Seconds the main thread (the one launching the target's kernels) spent blocked, by cause."""

    groups: int = 0
    setup_s: float = 0.0  # allocating the device row buffers and the pinned host buffers, once per run
    buffer_wait_s: float = 0.0  # no free pinned buffer: writing fell behind the forward
    # Waiting for the GPU to finish the previous group (and its host copy). Expected: the thread queues one group
    # ahead of the GPU. Near zero means the thread cannot stay ahead and the GPU idles between its kernels.
    gpu_wait_s: float = 0.0
    drain_s: float = 0.0  # after the last group's host copy, until the writer had committed everything

    def describe(self) -> str:
        return (
            f"{self.groups} row groups after {self.setup_s:.1f} s of buffer setup; the forward thread waited "
            f"{self.buffer_wait_s:.1f} s for free host buffers "
            f"(writing behind) and {self.gpu_wait_s:.1f} s for the GPU (running a group ahead of it); "
            f"{self.drain_s:.1f} s of writes after the last forward"
        )


@dataclass
class RowGroup:
    first: int
    last: int
    host: dict[str, torch.Tensor]  # hidden [rows, T, W] (bf16 or fp8 bits), scales for fp8; pinned on CUDA
    tokens: dict[str, np.ndarray]
    ready: torch.cuda.Event | None  # the host copy is complete once this fires


class RowWriter(threading.Thread):
    """Writes finished row groups and commits them; CPU only. An error stops writing and is raised later."""

    def __init__(self, part: store.PartWriter, free: queue.Queue, on_commit, commit: bool = True):
        super().__init__(daemon=True, name="dflash-writer")
        self.part, self.free, self.on_commit, self.commit = part, free, on_commit, commit
        self.jobs: queue.Queue = queue.Queue()  # bounded in effect by the HOST_BUFFERS buffers in circulation
        self.error: BaseException | None = None

    def run(self):
        while (group := self.jobs.get()) is not None:
            if self.error is None:
                try:
                    n = group.last - group.first
                    host = {name: store_bits(buffer[:n]) for name, buffer in group.host.items()}
                    self.part.write_rows(group.first, host.pop("hidden"), {**host, **group.tokens})
                    if self.commit:  # a repair rewrites rows of a finished part: nothing new to commit
                        self.part.commit(group.last)
                    self.on_commit(group)
                except BaseException as exc:  # handed to the main thread, which raises it
                    self.error = exc
            self.free.put(group.host)  # keep buffers circulating so that the main thread never blocks for ever

    def check(self):
        if self.error is not None:
            raise self.error


class Progress:
    """tqdm bar over tokens (documents vary a lot in length): documents done, tokens/s, MB/s (uncompressed), ETA."""

    def __init__(self, plan: PartPlan, committed_rows: int, row_bytes: int, rank: int):
        counts = plan.counts()
        self.plan, self.row_bytes, self.start, self.bytes = plan, row_bytes, time.perf_counter(), 0
        self.total_docs = counts["documents"]
        self.docs = sum(len(row) for row in plan.rows[:committed_rows])
        self.bar = tqdm(
            total=counts["tokens"],
            initial=plan.row_tokens(0, committed_rows),
            unit="tok",
            unit_scale=True,
            desc=f"harvest rank {rank}",
            dynamic_ncols=True,
            mininterval=1.0,
        )

    def commit(self, group: RowGroup):
        self.docs += sum(len(row) for row in self.plan.rows[group.first : group.last])
        self.bytes += (group.last - group.first) * self.row_bytes
        mb_per_s = self.bytes / 1e6 / (time.perf_counter() - self.start)
        self.bar.set_postfix_str(f"docs {self.docs}/{self.total_docs}, {mb_per_s:.0f} MB/s", refresh=False)
        self.bar.update(self.plan.row_tokens(group.first, group.last))

    def close(self):
        self.bar.close()


class RowEncoder:
    """Turns row groups of full bf16 features into the stored encoding, on their device, into preallocated
    buffers: the identity (a view) for bf16 at full width; the projection P h for a subspace; FP8 bits and
    exponents for fp8."""

    def __init__(self, spec: manifest.FeatureSpec, projection: torch.Tensor | None, shape: tuple[int, int], device):
        self.spec, self.projection = spec, projection
        self.identity = spec.precision == "bf16" and projection is None
        self.shapes = {"hidden": (*shape, spec.width)}
        if spec.precision == "fp8":
            self.shapes["scales"] = (*shape, spec.scale_groups)
        self.dtypes = {"hidden": torch.uint8 if spec.precision == "fp8" else torch.int16, "scales": torch.int8}
        self.device = device

    def buffers(self, pin: bool = False, device=None) -> dict[str, torch.Tensor]:
        return {
            name: torch.empty(shape, dtype=self.dtypes[name], device=device or "cpu", pin_memory=pin)
            for name, shape in self.shapes.items()
        }

    def encode(self, rows: torch.Tensor, out: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """rows bf16 [R, T, n*H] -> the stored arrays (`out` filled, or a view of `rows` for the identity)."""
        if self.identity:
            return {"hidden": rows.view(torch.int16)}
        values = rows if self.projection is None else features.project(rows, self.projection)
        if self.spec.precision == "fp8":
            bits, exponents = features.quantize_fp8(values, self.spec.scale_groups)
            out["hidden"].copy_(bits)
            out["scales"].copy_(exponents)
        else:
            out["hidden"].copy_(values.view(torch.int16))
        return out


class TeacherEncoder:
    """The teacher arrays of row groups, on their device, from the rows of the target's final-normed hidden state
    (`rows()`): its bf16 bits (hidden; a view), or the top-k of the next-token distribution with the tail mass
    computed a chunk of tokens at a time, zeros on padding (topk). Without a teacher it has no arrays."""

    TORCH_DTYPES = {"int32": torch.int32, "float16": torch.float16, "bfloat16": torch.int16}  # bf16 as its bits

    def __init__(self, spec: manifest.TeacherSpec | None, target: TappedTarget, shape: tuple[int, int]):
        self.spec, self.lm_head, self.shape = spec, target.lm_head, shape
        arrays = spec.arrays if spec else {}
        self.shapes = {name: shape if name == "teacher_tail" else (*shape, spec.width) for name in arrays}
        self.dtypes = {name: self.TORCH_DTYPES[dtype] for name, dtype in arrays.items()}
        self.identity = spec is None or spec.kind == "hidden"
        # Stored as bf16 (hidden); the LM head's input in the target's own dtype (topk)
        self.final_dtype = torch.bfloat16 if self.identity else target.dtype
        self.hidden_size = target.info.hidden_size

    def rows(self, device) -> torch.Tensor | None:
        """A zeroed device buffer for the final hidden state of a row group; None without a teacher."""
        if self.spec is None:
            return None
        return torch.zeros(*self.shape, self.hidden_size, dtype=self.final_dtype, device=device)

    def buffers(self, pin: bool = False, device=None) -> dict[str, torch.Tensor]:
        return {
            name: torch.empty(shape, dtype=self.dtypes[name], device=device or "cpu", pin_memory=pin)
            for name, shape in self.shapes.items()
        }

    def encode(self, final: torch.Tensor | None, doc_ids: np.ndarray, out: dict | None) -> dict[str, torch.Tensor]:
        """final [R, T, H] (its first n = len(doc_ids) rows used), doc_ids [n, T] (-1: padding) -> the stored
        teacher arrays."""
        if self.spec is None:
            return {}
        if self.identity:
            return {"teacher_hidden": final.view(torch.int16)}
        n = len(doc_ids)
        probs, ids, tail = features.next_token_top_k(final[:n].flatten(0, 1), self.lm_head, self.spec.k)
        real = _to_device(doc_ids.reshape(-1) >= 0, final.device)
        for name, values in (("teacher_probs", probs), ("teacher_ids", ids), ("teacher_tail", tail)):
            mask = real if values.dim() == 1 else real[:, None]
            out[name][:n].copy_(torch.where(mask, values, 0).unflatten(0, (n, -1)))
        return out


def store_bits(buffer: torch.Tensor) -> np.ndarray:
    """A host buffer as the numpy dtype the store holds (uint16 for bf16 bits, uint8 for fp8 bits, int8 scales)."""
    array = buffer.numpy()
    return array.view(np.uint16) if array.dtype == np.int16 else array


def _run_rows(
    cfg: HarvestConfig,
    plan: PartPlan,
    target: TappedTarget,
    part: store.PartWriter,
    header: manifest.Manifest,
    projection: torch.Tensor | None,
    groups: list[tuple[int, int]] | None = None,
) -> PipelineStalls:
    """Harvest the row groups [first, last) after the committed rows (or `groups`: a repair's, not committed)."""
    spec = header.features
    setup_start = time.perf_counter()
    device, T = torch.device(cfg.device), cfg.token_budget
    F = len(target.layer_ids) * target.info.hidden_size
    rows_per_group = max(1, cfg.forward_tokens // T)
    cuda = device.type == "cuda"
    copy_stream = torch.cuda.Stream(device) if cuda else None
    encoder = RowEncoder(spec, projection, (rows_per_group, T), device)
    teacher = TeacherEncoder(header.teacher, target, (rows_per_group, T))
    # Two device buffers on CUDA: the next group fills one while the other is still being copied to the host.
    device_rows = [torch.zeros(rows_per_group, T, F, dtype=torch.bfloat16, device=device) for _ in range(1 + cuda)]
    final_rows = [teacher.rows(device) for _ in device_rows]
    encoded = [None if encoder.identity else encoder.buffers(device=device) for _ in device_rows]
    teacher_encoded = [None if teacher.identity else teacher.buffers(device=device) for _ in device_rows]
    copied = [None] * len(device_rows)  # event: device buffer k may be overwritten
    free: queue.Queue = queue.Queue()
    for _ in range(HOST_BUFFERS):
        free.put({**encoder.buffers(pin=cuda), **teacher.buffers(pin=cuda)})
    progress = Progress(
        plan, part.rows_committed if groups is None else 0, row_bytes(T, spec, header.teacher), cfg.rank
    )
    writer = RowWriter(part, free, progress.commit, commit=groups is None)
    if groups is None:
        starts = range(part.rows_committed, len(plan.rows), rows_per_group)
        groups = [(first, min(first + rows_per_group, len(plan.rows))) for first in starts]
    writer.start()
    pending, stalls = None, PipelineStalls(setup_s=time.perf_counter() - setup_start)
    try:
        for step, (first, last) in enumerate(groups):
            writer.check()
            t0 = time.perf_counter()
            host = free.get()  # blocks only when writing falls behind the forward
            stalls.buffer_wait_s += time.perf_counter() - t0
            stalls.groups += 1
            k = step % len(device_rows)
            if copied[k] is not None:
                torch.cuda.current_stream(device).wait_event(copied[k])
            rows, tokens = device_rows[k], plan.token_arrays(first, last)
            _fill_rows(rows, plan, first, last, target, cfg.forward_tokens, final_rows[k])
            teacher_arrays = teacher.encode(final_rows[k], tokens["doc_ids"], teacher_encoded[k])
            stored = {**encoder.encode(rows, encoded[k]), **teacher_arrays}
            copied[k] = _copy_to_host(stored, host, last - first, copy_stream)
            group = RowGroup(first, last, host, tokens, copied[k])
            if pending is not None:  # hand over the previous group once its copy is done: one group of lag
                stalls.gpu_wait_s += _submit(writer, pending)
            pending = group
        if pending is not None:
            _submit(writer, pending)  # waits for the last forward and its copy
        writes_left = time.perf_counter()
    finally:
        writer.jobs.put(None)
        writer.join()
        progress.close()
    stalls.drain_s = time.perf_counter() - writes_left
    writer.check()
    return stalls


def _fill_rows(
    rows: torch.Tensor,
    plan: PartPlan,
    first: int,
    last: int,
    target: TappedTarget,
    forward_tokens: int,
    final_rows: torch.Tensor | None = None,
):
    """Run the forward batches of rows [first, last) and place each document's features (and final hidden state,
    for a teacher) at its offset."""
    rows.zero_()  # padding holds zeros
    if final_rows is not None:
        final_rows.zero_()
    start_of = {(r, d): s for r in range(first, last) for d, s in zip(plan.rows[r], plan.starts[r])}
    for batch in forward_batches(plan, first, last, forward_tokens):
        lengths = [len(plan.docs[d].input_ids) for _, d in batch]
        ids = np.zeros((len(batch), round_up(lengths[0], PAD_MULTIPLE)), np.int64)
        for b, (_, d) in enumerate(batch):
            ids[b, : lengths[b]] = plan.docs[d].input_ids
        features, final = target.forward(_to_device(ids, rows.device))
        for b, ((r, d), n) in enumerate(zip(batch, lengths)):
            start = start_of[r, d]
            rows[r - first, start : start + n] = features[b, :n]
            if final_rows is not None:
                final_rows[r - first, start : start + n] = final[b, :n]


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":  # a pageable source would make the copy wait for the GPU to drain
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _copy_to_host(stored: dict, host: dict, n: int, copy_stream) -> torch.cuda.Event | None:
    """Start the device-to-host copy of the first n encoded rows on the side stream; returns its completion event."""
    if copy_stream is None:
        for name, source in stored.items():
            host[name][:n].copy_(source[:n])
        return None
    copy_stream.wait_stream(torch.cuda.current_stream(copy_stream.device))
    with torch.cuda.stream(copy_stream):
        for name, source in stored.items():
            host[name][:n].copy_(source[:n], non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy_stream)
    return done


def _submit(writer: RowWriter, group: RowGroup) -> float:
    """Queue a group for writing once its host copy is complete; returns the seconds spent waiting for that."""
    t0 = time.perf_counter()
    if group.ready is not None:
        group.ready.synchronize()
    waited = time.perf_counter() - t0
    writer.jobs.put(group)
    return waited
