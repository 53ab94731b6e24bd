"""The `--modes` stage: each variant's stores harvested and its drafter trained, several at a time in worker
processes."""

import json
import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.quality.drafter import drafter_steps, harvest_store, train_drafter
from bench.quality.scale import Scale
from bench.quality.store_modes import BF16, MODES, StoreMode, mode_done, mode_harvested
from bench.quality.workers import gpu_count, in_workers

logger = logging.getLogger("quality")


def store_stats(path) -> dict:
    """Bytes on disk of a store (all of it, and its features alone: hidden, scales, projection), per token and
    against raw bf16 features (tokens x feature_dim x 2 bytes); its encoding and the calibration's captured share."""
    from dflash.store import Store, disk_bytes

    path = Path(path)
    manifest = Store.open(path).manifest
    f, tokens = manifest.features, manifest.counts.tokens
    features = [*path.glob("parts/*/hidden"), *path.glob("parts/*/scales"), path / "projection"]
    total, feature_bytes = disk_bytes(path), sum(disk_bytes(p) for p in features if p.exists())
    teacher_bytes = sum(disk_bytes(p) for p in path.glob("parts/*/teacher_*"))
    raw = tokens * manifest.feature_dim * 2
    return {
        "path": str(path),
        "bytes": total,
        "feature_bytes": feature_bytes,
        "teacher": manifest.teacher.name if manifest.teacher else None,
        "teacher_bytes_per_token": teacher_bytes / max(tokens, 1),
        "tokens": tokens,
        "rows": manifest.counts.rows,
        "feature_dim": manifest.feature_dim,
        "precision": f.precision,
        "width": f.width,
        "scale_groups": f.scale_groups,
        "captured": f.subspace.captured if f.subspace else None,
        "bytes_per_token": total / max(tokens, 1),
        "raw_bf16_ratio": total / max(raw, 1),
        "feature_ratio": feature_bytes / max(raw, 1),
    }


def data_wait_share(records: list[dict]) -> float | None:
    """The share of the training loop's time spent waiting for rows, over the whole run: each train record's
    `data_wait` (a share of its interval) weighted by the interval's time."""
    train, weights, last = [r for r in records if r.get("kind", "train") == "train"], [], 0
    for r in train:
        weights.append(r["step_ms"] * (r["step"] - last))
        last = r["step"]
    total = sum(weights)
    return sum(r["data_wait"] * w for r, w in zip(train, weights)) / total if total else None


def harvest_mode(
    mode: StoreMode, scale: Scale, target: str, data: str, val_data: str, folder: str, device: str, done: str
):
    """A store mode's harvests, in a worker: the drafter's responses and the held-out ones in the mode (the held-out
    store with the training store's projection); their sizes saved."""
    from dflash.store import write_json_atomic

    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)  # an unfinished earlier attempt
    t0 = time.perf_counter()
    shards = harvest_store(scale, target, data, folder / "shards", device, mode)
    projection = shards if mode.subspace != "none" else None
    val_shards = harvest_store(scale, target, val_data, folder / "shards_val", device, mode, projection_from=projection)
    result = {
        "mode": asdict(mode),
        "store": store_stats(shards),
        "val_store": store_stats(val_shards),
        "harvest_s": round(time.perf_counter() - t0, 1),
    }
    logger.info("mode %s: store %s", mode.name, result["store"])
    write_json_atomic(Path(done), result)


def train_mode(scale: Scale, folder: str, steps: int, device: str, seed: int, harvested: str, done: str):
    """A store mode's drafter, in a worker, trained as the bf16 one on the mode's stores; the mode's result saved."""
    from dflash.store import write_json_atomic

    result = json.loads(Path(harvested).read_text())
    folder = Path(folder)
    shutil.rmtree(folder / "run", ignore_errors=True)
    t0 = time.perf_counter()
    mode = StoreMode(**result["mode"])
    result["drafter"] = train_drafter(
        scale,
        result["store"]["path"],
        result["val_store"]["path"],
        folder / "run",
        steps,
        device,
        seed,
        dict(mode.train),
    )
    result["drafter_s"] = round(time.perf_counter() - t0, 1)
    write_json_atomic(Path(done), result)


def run_modes(
    scale: Scale,
    modes: list[StoreMode],
    target: Path,
    results: dict,
    work: Path,
    stages: Path,
    device: torch.device,
    seed: int,
    log: Path,
) -> dict:
    """Every store mode not finished by an earlier call (mode i on GPU i % GPUs), with the bf16 harvest's responses
    and its drafter's steps: first the harvests, `scale.mode_workers` at a time in worker processes, then the
    drafters, `scale.mode_train_workers` at a time (one alone measures its step and data wait undisturbed); then
    the saved results of all, bf16's (the harvest and drafter stages) first."""
    steps = drafter_steps(scale, results["harvest"]["rows"])
    todo = [m for m in modes if not mode_done(stages, m.folder).exists()]
    unharvested = [m for m in todo if not mode_harvested(stages, m.folder).exists()]
    if todo:
        logger.info(
            "modes: %s to train, of which %s to harvest (%s done by an earlier call); harvests %d at a time, "
            "drafters %d at a time, %d steps each",
            ", ".join(m.name for m in todo),
            ", ".join(m.name for m in unharvested) or "none",
            ", ".join(m.name for m in modes if m not in todo) or "none",
            scale.mode_workers,
            scale.mode_train_workers,
            steps,
        )
    gpus, common = gpu_count(device), dict(scale=scale, device=device.type)
    paths = {
        m: dict(folder=str(work / MODES / m.folder), harvested=str(mode_harvested(stages, m.folder))) for m in modes
    }
    from dflash.store import write_json_atomic

    bf16_stores = None
    for m in [m for m in unharvested if m.on_bf16_store]:  # a method variant: the bf16 run's stores
        bf16_stores = bf16_stores or {
            "store": store_stats(results["harvest"]["path"]),
            "val_store": store_stats(results["harvest"]["val_path"]),
        }
        write_json_atomic(Path(paths[m]["harvested"]), {"mode": asdict(m), **bf16_stores, "harvest_s": 0.0})
    # Variants on the same encoding and teacher (dspark-topk, dflash2-distill) share one harvest: the first's.
    harvested = {m.store_key: m for m in modes if Path(paths[m]["harvested"]).exists()}
    leaders = {m.store_key: m for m in reversed(unharvested) if not m.on_bf16_store} | harvested
    unharvested = [m for m in unharvested if not m.on_bf16_store and leaders[m.store_key] is m]
    in_workers(
        harvest_mode,
        [
            dict(
                mode=m,
                target=str(target),
                data=results["regenerate"]["file"],
                val_data=results["regenerate"]["val_file"],
                folder=paths[m]["folder"],
                done=paths[m]["harvested"],
                **common,
            )
            for m in unharvested
        ],
        gpus,
        log,
        at_once=max(scale.mode_workers, 1),
        names=[f"mode {m.name} harvest" for m in unharvested],
    )
    for m in todo:
        if not Path(paths[m]["harvested"]).exists():
            shared = json.loads(Path(paths[leaders[m.store_key]]["harvested"]).read_text())
            write_json_atomic(Path(paths[m]["harvested"]), {**shared, "mode": asdict(m), "harvest_s": 0.0})
    in_workers(
        train_mode,
        [dict(steps=steps, seed=seed, done=str(mode_done(stages, m.folder)), **paths[m], **common) for m in todo],
        gpus,
        log,
        at_once=max(scale.mode_train_workers, 1),
        names=[f"mode {m.name} drafter" for m in todo],
    )
    out = {
        BF16.name: {
            "mode": asdict(BF16),
            "store": store_stats(results["harvest"]["path"]),
            "val_store": store_stats(results["harvest"]["val_path"]),
            "drafter": results["drafter"],
        }
    }
    for m in modes:
        out[m.name] = json.loads(mode_done(stages, m.folder).read_text())
        if out[m.name]["store"]["rows"] != out[BF16.name]["store"]["rows"]:
            logger.warning(
                "mode %s: %d rows, bf16 %d: the stores should hold the same rows",
                m.name,
                out[m.name]["store"]["rows"],
                out[BF16.name]["store"]["rows"],
            )
    return out
