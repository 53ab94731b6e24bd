"""The harvest of one part: check the folder and the options, load the data and the target, calibrate, run the
pipeline, finish the store (and self-check it) once every part is done; resume and --repair go the same way."""

import contextlib
import errno
import glob
import logging
import shutil
import signal
import threading
from functools import partial
from pathlib import Path

import torch

from dflash import parallel, selfcheck, store
from dflash.config import HarvestConfig
from dflash.data import load_documents
from dflash.device import DTYPES
from dflash.errors import DflashError
from dflash.harvest.calibration import DAMAGED_PROJECTION, calibrated, projection_damaged, recalibrated
from dflash.harvest.header import document_sources, harvest_header, restore_harvest_file
from dflash.harvest.options import check_free_space, data_config, harvest_fingerprint, resolve, teacher_encoding
from dflash.harvest.pipeline import run_rows
from dflash.leftovers import remove_dead
from dflash.packing import PartPlan
from dflash.store import verify
from dflash.target import TappedTarget

logger = logging.getLogger("dflash")


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) during a harvest: unwinds like KeyboardInterrupt, so the writer commits what it has."""


def _on_sigterm(signum, _frame):
    raise Interrupted(signal.Signals(signum).name)


def run_harvest(cfg: HarvestConfig) -> Path:
    """Harvest this rank's part of the store at cfg.out (resuming it if started); return the store path."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return _harvest_in_layout(resolve(cfg))
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


def _harvest_in_layout(cfg: HarvestConfig) -> Path:
    """The harvest of one process, or this process's share of its tensor-parallel group's (dflash.parallel)."""
    group = parallel.open_group(
        cfg.model, cfg.tensor_parallel, torch.device(cfg.device), expert_parallel=cfg.expert_parallel
    )
    if group is None:
        return _harvest(cfg, partial(_load_target, cfg, None))
    try:
        with group.guarded():
            if not group.layout.leader:
                group.follow(lambda *args: TappedTarget(*args, group=group))
                return Path(cfg.out)
            return _harvest(cfg, partial(_load_target, cfg, group))
    finally:
        group.release()
        group.close()


def _load_target(cfg: HarvestConfig, group, layer_ids: list[int], teacher: str | None) -> TappedTarget:
    """The target of this process, split over its group when it has one (the followers load as announced)."""
    args = (cfg.model, layer_ids, cfg.device, DTYPES[cfg.dtype], cfg.allow_slow_kernels, teacher, cfg.experts)
    args += (cfg.expert_parallel,)
    if group is not None:
        group.announce("load", *args)
    return TappedTarget(*args, group=group)


def _harvest(cfg: HarvestConfig, load_target) -> Path:
    out = Path(cfg.out)
    restore_harvest_file(out)
    fingerprint = store.as_recorded(out, harvest_fingerprint(cfg))
    state = store.check_folder(out, fingerprint)
    _remove_killed_writes(out)
    if state == "complete" and not cfg.repair:
        if cfg.self_check > 0 and store.read_manifest(out / store.MANIFEST_FILE).self_check is None:
            logger.info("%s is complete, but no check against the target was recorded (stopped during it?)", out)
            _self_check(out, cfg, load_target)
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

        return _harvest_part(cfg, out, fingerprint, state, lock, load_target)


def _remove_killed_writes(out: Path) -> None:
    """The temporaries of the store's harvest.json and manifest.json and the projection a --repair moved aside, as
    killed writers left them (zarr would list that folder as an array of the store); a live writer's are kept."""
    names = (f"{store.TMP_PREFIX}{store.HARVEST_FILE}", f"{store.TMP_PREFIX}{store.MANIFEST_FILE}", DAMAGED_PROJECTION)
    removed = remove_dead(p for name in names for p in out.glob(f"{glob.escape(name)}.*"))
    if removed:
        logger.info("removed what killed writers left in %s: %s", out, ", ".join(p.name for p in removed))


def _harvest_part(cfg: HarvestConfig, out: Path, fingerprint: dict, state: str, lock, load_target) -> Path:
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
            logger.info(
                "part %s of %s: every chunk present, its checksum correct and in its place; nothing to repair",
                cfg.rank,
                out,
            )
            if state != "complete":
                _finish(out, cfg, load_target)
            return out
        for problem in whole.values():
            logger.info("repairing: %s", problem)
        logger.info("part %d: re-harvesting %d damaged rows %s", cfg.rank, len(damage.rows), damage.rows[:20])
    elif done:
        _finish(out, cfg, load_target)
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
            _finish(out, cfg, load_target)
            return out
    teacher = teacher_encoding(cfg)
    target = load_target(fingerprint["layers"], teacher.kind if teacher else None)
    header = harvest_header(cfg, fingerprint, target, stats, teacher)
    if state == "resume" and store.read_manifest(out / store.HARVEST_FILE).target != header.target:
        raise DflashError(
            f"the checkpoint at {cfg.model} changed since {out} was started (its config differs); harvest into a new folder"
        )
    projection = None
    if header.features.subspace is not None and projection_damaged(out, damage is not None and whole):
        recorded = store.read_manifest(out / store.HARVEST_FILE)  # None: stopped before harvest.json, no row uses it
        projection, header = recalibrated(out, cfg, header, documents, target, recorded)
    elif header.features.subspace is not None:
        projection, header = calibrated(out, cfg, header, documents, target)
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
        return _repair(cfg, out, plan, target, part, header, projection, damage, state, load_target)
    stalls = run_rows(cfg, plan, target, part, header, projection)
    logger.info("rank %d: %s", cfg.rank, stalls.describe())
    _finish(out, cfg, load_target, target)
    return out


def _repair(cfg, out: Path, plan: PartPlan, target, part, header, projection, damage, state: str, load_target) -> Path:
    """Rewrite the damaged rows of a finished part. The rows are re-harvested in the row groups an uninterrupted
    harvest formed (multiples of the group size from row 0), so the forward batches, and the bytes, are the same."""
    if damage.documents:
        part.write_documents(plan.documents_table())
    per_group = max(1, cfg.forward_tokens // cfg.token_budget)
    firsts = sorted({row // per_group * per_group for row in damage.rows})
    groups = [(first, min(first + per_group, len(plan.rows))) for first in firsts]
    if groups:
        run_rows(cfg, plan, target, part, header, projection, groups)
    left = verify.part_damage(out, cfg.rank, header.features, header.teacher)
    if left.rows or left.documents:
        raise DflashError(
            f"part {store.part_name(cfg.rank)} of {out} is still damaged after the repair: {left.problems[:3]}"
        )
    logger.info("part %d repaired: %d rows rewritten, every chunk of the part checks", cfg.rank, len(damage.rows))
    if state != "complete":
        _finish(out, cfg, load_target, target)
    return out


def _self_check(out: Path, cfg: HarvestConfig, load_target, target: TappedTarget | None = None) -> None:
    """Re-run `cfg.self_check` documents of the complete store through the target and record the result."""
    if target is None:
        m = store.read_manifest(out / store.MANIFEST_FILE)
        target = load_target(list(m.layer_ids), m.teacher.kind if m.teacher else None)
    check = selfcheck.reforward_check(out, target, cfg.self_check)
    store.record_self_check(out, check)
    selfcheck.log_check(check, out)


def _finish(out: Path, cfg: HarvestConfig, load_target, target: TappedTarget | None = None) -> None:
    if store.finalize(out, store.read_manifest(out / store.HARVEST_FILE)):
        logger.info("store complete: %s", out)
        if cfg.self_check > 0:
            _self_check(out, cfg, load_target, target)
    else:
        parts = store.part_progress(out, cfg.world_size)
        pending = [r for r, p in enumerate(parts) if p is None or p["rows_committed"] < p["rows"]]
        logger.info("part %d done; the store completes when ranks %s finish", cfg.rank, pending)
