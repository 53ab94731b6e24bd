"""`dflash train`'s run: the run folder and its lock, where to resume, the trainer's fit, the export and the final
validation (rank 0 writes files). The trainer itself is dflash.train."""

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.config import TrainConfig
from dflash.export import export_drafter, read_target_embeddings
from dflash.store import Store
from dflash.train import Trainer
from dflash.train.checkpoint import DISK_ERRORS, Checkpointer, disk_error, on_rank0, read_state, run_lock
from dflash.train.metrics import MetricsLog, drop_records_after
from dflash.train.setup import check_out, finished_run, init_distributed

logger = logging.getLogger("dflash")


def export_final(trainer: "Trainer", out: Path) -> Path:
    """The drafter of the finished run into RUN/drafter (the final checkpoint is saved: a failure here loses
    nothing, a resume or `dflash export` exports it)."""
    cfg, dcfg = trainer.cfg, trainer.dcfg
    embeddings = read_target_embeddings(trainer.target_path, dcfg) if cfg.export_with_target_embeddings else None
    try:
        return export_drafter(
            trainer.model,
            dcfg,
            out / "drafter",
            dtype=getattr(torch, cfg.export_dtype),
            projection=trainer.projection,
            target_embeddings=embeddings,
        )
    except OSError as exc:
        if exc.errno not in DISK_ERRORS:
            raise
        raise disk_error(exc, "exporting the drafter failed", out) from None


def run_training(cfg: TrainConfig) -> dict:
    """Train (or resume) a drafter; returns the final metrics, validation and export path (rank 0 writes files).

    Rank 0 holds the run folder's lock for the whole run: a second run into the same --out is refused."""
    env = init_distributed(cfg.device)
    lock = run_lock(cfg.out)
    try:
        out = check_out(cfg)
        on_rank0(env.rank, env.world_size, lambda: lock.acquire() and None)
        identity = Store.open(cfg.store).manifest.identity
        checkpoint = Checkpointer(out, env.rank, env.world_size).to_resume(cfg, identity)
        start = read_state(checkpoint)["step"] if checkpoint is not None else 0
        kept = []  # the records of the steps up to the checkpoint (rank 0)
        if cfg.resume and env.main:  # (from step 0 when there is no checkpoint to continue)
            kept = drop_records_after(out, start)
        done = finished_run(cfg, env, out, checkpoint)
        if done is not None:
            return done
        trainer = Trainer(cfg, env)
        prep = trainer.prepare(checkpoint)
        log = MetricsLog(out, env.main, cfg.tensorboard)
        logger.info(
            "training %d-layer drafter (%.1f M parameters) on %d rank(s) from step %d to %d, a step's peak memory "
            "estimated at %.1f GB; warmup + capture %.1f s (train step %.1f s, validation step %.1f s, both once more "
            "%.1f s, capture and state restore %.1f s)",
            trainer.dcfg.num_layers,
            sum(p.numel() for p in trainer.params) / 1e6,
            env.world_size,
            start,
            trainer.total_steps,
            trainer.memory_estimate / 1e9,
            prep["total_s"],
            prep["train_warmup_s"],
            prep["val_warmup_s"],
            prep["settle_s"],
            prep["capture_s"],
        )
        # A run stopped by a damaged held-out row in the validation after its checkpoint's step has no record of it
        validate_first = on_rank0(
            env.rank,
            env.world_size,
            lambda: trainer.validation_due(start) and not any(r["kind"] == "val" and r["step"] == start for r in kept),
        )
        try:
            result = trainer.fit(start, log, validate_first)
            # The export comes before the final validation: a validation that fails must not cost the drafter.
            if cfg.export:  # rank 0 writes; its error reaches every rank (none waits in a collective for it)
                result["export"] = on_rank0(env.rank, env.world_size, lambda: str(export_final(trainer, out)))
            val = trainer.validate(trainer.total_steps)  # (a finished run resumed has none: see finished_run)
            log.write(val)
        finally:
            log.close()
        result["val"] = val
        result["prepare_s"] = prep
        result["damaged_rows"] = list(trainer.damaged.rows)
        if trainer.damaged.rows:
            logger.warning(
                "skipped %d damaged row(s) of the store (--max-damaged-rows %d): %s",
                len(trainer.damaged.rows),
                cfg.max_damaged_rows,
                ", ".join(map(str, trainer.damaged.rows[:20])),
            )
        if "allocated_spread" in result:
            logger.info(
                "memory over the run: allocated spread %d B, reserved spread %d B, peak %.1f GiB",
                result["allocated_spread"],
                result["reserved_spread"],
                torch.cuda.max_memory_allocated(env.device) / 2**30,
            )
        return result
    finally:
        lock.release()
        if env.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
