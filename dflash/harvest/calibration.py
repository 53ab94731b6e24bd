"""A subspace store's projection P: calibrated once for the whole store (the same seeded sample on every rank,
the first rank to finish stores it), borrowed from another store, or recomputed by --repair."""

import contextlib
import hashlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from dflash import features, manifest, store
from dflash.config import HarvestConfig
from dflash.data import Document
from dflash.errors import DflashError
from dflash.harvest.options import borrowed_projection
from dflash.harvest.pipeline import forward_fits
from dflash.leftovers import owner_tag
from dflash.packing import PAD_MULTIPLE, round_up
from dflash.target import TappedTarget

logger = logging.getLogger("dflash")

DAMAGED_PROJECTION = f"{store.TMP_PREFIX}{store.PROJECTION}.damaged"  # the projection --repair moves aside


def calibrated(
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
        projection, record, _ = borrowed_projection(cfg, header.features, header.feature_dim)
        stored = _written_projection(out, cfg, projection, {**record, "fingerprint_sha256": made_for}, made_for)
    if stored is None:
        width = header.features.subspace.width
        moment, sample = second_moment(documents, target, cfg.calibration_tokens, cfg.forward_tokens)
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


def projection_damaged(out: Path, whole: dict | bool) -> bool:
    """Whether the store's projection must be recomputed: found damaged by --repair, or unreadable on a resume."""
    if whole:
        return store.PROJECTION in whole
    try:
        store.read_projection(out)
    except DflashError as exc:
        logger.info("recomputing: %s", exc)
        return True
    return False


def recalibrated(out: Path, cfg: HarvestConfig, header, documents: list[Document], target, recorded):
    """`--repair` of a damaged (or missing) projection: calibrate again, deterministically, and keep the result
    only if it is the matrix the store's rows were encoded with (the calibration record of harvest.json, and the
    sha256 the damaged array's attributes record when they are readable); otherwise put the damaged one back."""
    folder, aside = out / store.PROJECTION, out / f"{DAMAGED_PROJECTION}.{uuid.uuid4().hex}.{owner_tag()}"
    old_sha256 = None
    if folder.exists():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            old_sha256 = json.loads((folder / "zarr.json").read_text())["attributes"].get("sha256")
        os.rename(folder, aside)
    try:
        projection, header = calibrated(out, cfg, header, documents, target)
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


def second_moment(documents: list[Document], target: TappedTarget, tokens: int, forward_tokens: int):
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
        with forward_fits(ids.shape, forward_tokens, device):
            hidden = target.features(torch.from_numpy(ids).to(device))
        for b, doc in enumerate(batch):
            moment.add(hidden[b, : len(doc)])
        start += len(batch)
    return moment, len(sample)
