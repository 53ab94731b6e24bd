"""The harvest's options, checked before anything loads, and what they decide: the stored encoding, the teacher,
the data, the fingerprint a resumed store must match, and whether the rows fit on the disk."""

import hashlib
import logging
import os
import shutil
from dataclasses import asdict, fields, replace
from pathlib import Path

import numpy as np

from dflash import features, manifest, parallel, store
from dflash.config import HarvestConfig, check_expert_parallel
from dflash.data import DataConfig, sources
from dflash.device import DTYPES, local_device
from dflash.errors import DflashError, format_size
from dflash.store import verify
from dflash.target import check_layer_ids, default_layer_ids
from dflash.target_files import config_hash, load_config, weights_sha256

logger = logging.getLogger("dflash")

BLOCK_SIZE = 16  # a row must hold at least one DFlash block


def resolve(cfg: HarvestConfig) -> HarvestConfig:
    """Fill the defaults that depend on the environment and check the options that need no file. The rank and
    world size are the store part's and the number of parts: with --tensor-parallel, the group's and the number
    of groups."""
    rank, world_size = _data_rank(cfg)
    device = str(local_device(cfg.device))
    cfg = check_options(HarvestConfig(**{**asdict(cfg), "rank": rank, "world_size": world_size, "device": device}))
    if not 0 <= cfg.rank < cfg.world_size:
        raise DflashError(f"rank {cfg.rank} must be in 0..{cfg.world_size - 1} for world size {cfg.world_size}")
    return cfg


def _data_rank(cfg: HarvestConfig) -> tuple[int, int]:
    if cfg.tensor_parallel == 1:
        rank = cfg.rank if cfg.rank is not None else int(os.environ.get("RANK", 0))
        return rank, cfg.world_size if cfg.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    if cfg.rank is not None or cfg.world_size is not None:
        raise DflashError(
            "--rank and --world-size name a process's part without --tensor-parallel; with it, run under torchrun "
            "and leave them out: each group of --tensor-parallel processes writes the part of its index"
        )
    layout = parallel.group_layout(cfg.tensor_parallel)
    return layout.group, layout.groups


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
    if cfg.tensor_parallel < 1:
        raise DflashError(
            f"--tensor-parallel must be at least 1 (1: the target whole on each process), got {cfg.tensor_parallel}"
        )
    check_expert_parallel(cfg)
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
    if cfg.self_check < 0:
        raise DflashError(f"--self-check {cfg.self_check} must be at least 0 (0 skips the check); give e.g. 4")
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


def harvest_fingerprint(cfg: HarvestConfig) -> dict:
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
        "projection_sha256": borrowed_projection(cfg, encoding, len(layers) * text.hidden_size)[2],
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


def borrowed_projection(cfg: HarvestConfig, encoding: manifest.FeatureSpec, feature_dim: int):
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


# The lossless codecs shrink stored rows by at most about 1.4x (docs/shard-format.md): a harvest whose rows, at
# that ratio, would still not fit on the disk cannot succeed.
BEST_CODEC_RATIO = 1.45


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
    sizes = f"the rows left need {format_size(need)} before compression, {existing} has {format_size(free)} free"
    if need / BEST_CODEC_RATIO > free:
        raise DflashError(
            f"this harvest cannot fit: {sizes} (the codec saves at most ~30 %); free space, harvest to a larger disk, or "
            "store fewer bytes per token: --precision fp8 (about half) or --subspace 1/8 (about an eighth; README, "
            "'Store modes', gives each mode's cost in acceptance length)"
        )
    if need > free:
        logger.warning("%s: the harvest fits only if the codec compresses well; watch the disk", sizes)
