"""The checkpoints of a training run: the run folder's lock, save, find the latest, load in place, check a resume,
export.

A checkpoint is the folder RUN/checkpoints/step_N: written into .tmp-step_N-<save id> by every rank (every file
flushed to disk), and renamed by rank 0 once all files are in it, so a folder named step_N is complete by
construction. Every checkpoint is self-consistent: its digests.json, written last, holds the sha256 of every other
file (state.json and each rank's rng file included), so that an edited, damaged or foreign file is caught; a resume
takes the newest checkpoint that passes these checks (naming the ones it skips, and any of an earlier dflash, which
has no digests.json). Loading copies into the trainer's live tensors in place, so that the
captured step keeps reading the same storage. One run at a time owns a run folder (`run_lock`). Contents and resume
semantics are in docs/training.md.
"""

import dataclasses
import hashlib
import json
import logging
import os
import secrets
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from dflash import methods, store
from dflash.config import TrainConfig
from dflash.errors import DISK_ERRORS, DflashError, describe_differences, disk_error  # noqa: F401  (train's)
from dflash.export import check_export_target, export_drafter, read_target_embeddings
from dflash.locks import LOCK_FILE, FileLock

logger = logging.getLogger("dflash")

PREFIX = "step_"
METRICS_FILE = "metrics.jsonl"  # (dflash.train.metrics writes it; named here to tell an earlier run's folder)
DIGESTS = "digests.json"  # {"sha256": {name: digest}} of every other file of a checkpoint

# Options that may differ between a run and its resumption: they change how the run executes or reports, not
# the sequence of weights it computes (max_damaged_rows: a run stopped by a damaged row resumes with it raised).
RESUMABLE_CHANGES = {
    "out",
    "store",
    "target",
    "log_every",
    "ckpt_every",
    "val_every",
    "resume",
    "export",
    "export_dtype",
    "export_with_target_embeddings",
    "device",
    "compile",
    "cuda_graph",
    "attention_kernel_options",
    "mask_tile_size",
    "recompute",
    "embedding",
    "peak_tflops",
    "tensorboard",
    "prefetch",
    "reader_workers",
    "max_damaged_rows",
    "allow_failed_self_check",
    "allow_other_target_weights",
    "allow_val_overlap",
    "ignore_memory_estimate",
}


def fingerprint(cfg: TrainConfig, world_size: int) -> dict:
    """The options a resumed run must share with its checkpoint (JSON-normalised), and the number of ranks.

    Where the held-out store lives does not change the weights; whether there is one does (without it, a fraction
    of the rows is held out)."""
    options = json.loads(json.dumps(dataclasses.asdict(cfg)))
    if cfg.val_store:
        options.update(val_store=True, val_fraction=None)
    return {**{k: v for k, v in options.items() if k not in RESUMABLE_CHANGES}, "world_size": world_size}


def read_state(path: Path) -> dict:
    """The state.json of a checkpoint: step, data position, total steps, config, fingerprint, drafter config."""
    return json.loads((Path(path) / "state.json").read_text())


def on_rank0(rank: int, world_size: int, fn):
    """fn() on rank 0, its result (or its DflashError) handed to every rank: no rank waits for one that failed."""
    if world_size == 1:
        return fn()
    box = [None]
    if rank == 0:
        try:
            box = [("ok", fn())]
        except DflashError as exc:
            box = [("error", str(exc))]
    dist.broadcast_object_list(box, 0)
    kind, value = box[0]
    if kind == "error":
        raise DflashError(value)
    return value


def max_over_ranks(value: int, world_size: int, device) -> int:
    """The largest of the ranks' `value`s (one tiny all-reduce; the value itself on one rank)."""
    if world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def any_rank(flag: bool, world_size: int, device) -> bool:
    """True when `flag` is true on any rank."""
    return bool(max_over_ranks(int(flag), world_size, device))


def fsync_folder(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def gather(value, world_size: int) -> list:
    """Every rank's `value`, in rank order (on one rank, the value itself in a list)."""
    if world_size == 1:
        return [value]
    values = [None] * world_size
    dist.all_gather_object(values, value)
    return values


def run_lock(run) -> FileLock:
    """The run folder's lock, held by rank 0 for the lifetime of a run: a second run into it is refused."""
    run = Path(run)
    return FileLock(
        run / LOCK_FILE,
        lambda holder: (
            f"{run} is in use by another dflash train ({holder}); wait for it to finish or stop it, or "
            "choose another --out"
        ),
    )


def warn_if_undigested(path: Path, taker: str):
    """A checkpoint without digests (an earlier dflash's) is taken, saying what of it goes unchecked."""
    if not (path / DIGESTS).exists():
        logger.warning(
            "%s: %s has no %s (an earlier dflash wrote it, or it was removed): its state.json and rng files are not "
            "verified; taking it anyway",
            taker,
            path,
            DIGESTS,
        )


class _Hashing:
    """A write-only file that hashes what passes through (torch.save writes into it): no second read to hash. It
    keeps the OSError of a failed write, which torch.save reports only as a RuntimeError of its own."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data):
        self.sha.update(data)
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self):
        self.f.flush()


def drafter_config_of(state: dict):
    """The drafter config a checkpoint's state.json records (a run from before methods existed is DFlash's)."""
    return methods.get(state.get("method", methods.UNLABELLED)).config_cls(**state["drafter"])


def _write(path: Path, obj) -> str:
    """torch.save `obj` (or write bytes) to `path`, flushed to the disk; returns the file's sha256."""
    with open(path, "wb") as f:
        out = _Hashing(f)
        if isinstance(obj, bytes):
            out.write(obj)
        else:
            try:
                torch.save(obj, out)
            except RuntimeError:
                if out.error is None:
                    raise
                raise out.error from None  # the disk's error, not torch's wrapper of it
        f.flush()
        os.fsync(f.fileno())
    return out.sha.hexdigest()


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            sha.update(block)
    return sha.hexdigest()


class Checkpointer:
    """The checkpoints of the run in `out`, seen from one rank (rank 0 writes the files every rank shares)."""

    def __init__(self, out, rank: int = 0, world_size: int = 1):
        self.run = Path(out)
        self.folder = self.run / "checkpoints"
        self.rank, self.world_size = rank, world_size

    def path(self, step: int) -> Path:
        return self.folder / f"{PREFIX}{step}"

    def complete(self) -> list[Path]:
        """The checkpoints renamed to step_N (complete by construction unless a power loss cut them), newest first."""
        numbers = [p.name.removeprefix(PREFIX) for p in self.folder.glob(f"{PREFIX}*")]
        return [self.path(s) for s in sorted((int(n) for n in numbers if n.isdigit()), reverse=True)]

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step: complete ones are exactly those renamed to step_N."""
        paths = self.complete()
        return paths[0] if paths else None

    def problem(self, path: Path) -> str | None:
        """Why the checkpoint at `path` cannot be loaded (a file edited, cut short, missing or not its own), or None."""
        if not (path / DIGESTS).exists():
            return self._undigested_problem(path)
        try:
            digests = dict(json.loads((path / DIGESTS).read_text())["sha256"])
            extra = sorted({p.name for p in path.iterdir()} - {DIGESTS, *digests})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"{DIGESTS} is unreadable ({exc.__class__.__name__})"
        if extra:  # the export would read a projection.pt, say, that the run never wrote
            return f"{extra[0]} is not in {DIGESTS}: no file of this checkpoint's"
        for name, digest in digests.items():
            if not (path / name).is_file():
                return f"{name} is missing (restore it to take this checkpoint)"
            if _sha256(path / name) != digest:
                return (
                    f"{name} does not match its sha256 in {DIGESTS} (edited, damaged or cut short; restore it to "
                    "take this checkpoint)"
                )
        return None

    def _undigested_problem(self, path: Path) -> str | None:
        """`problem` for a checkpoint of an earlier dflash: its weights against the sha256 its state.json may record,
        every rng file against the save id."""
        try:
            state = read_state(path)
        except (OSError, ValueError) as exc:
            return f"its state.json is missing or unreadable ({exc.__class__.__name__})"
        files, save_id = state.get("files"), state.get("save_id")
        if files is None:  # older still: no sha256 in state.json either, check that its files are not empty
            files = {name: None for name in ("model.pt", "optimizer.pt")}
        for name, digest in files.items():
            file = path / name
            if not file.is_file() or file.stat().st_size == 0:
                return f"{name} is missing or empty"
            if digest is not None and _sha256(file) != digest:
                return f"{name} does not match its state.json (cut short, or written by another save)"
        for r in range(state.get("world_size", self.world_size)):
            file = path / f"rng_rank{r}.pt"
            try:
                saved = torch.load(file, weights_only=True)
            except Exception as exc:  # missing, empty or cut short: whatever torch.load raises
                return f"{file.name} cannot be read ({exc.__class__.__name__})"
            if saved.get("save_id") != save_id:
                return f"{file.name} belongs to another save than its state.json"
        return None

    # ---- resume

    def to_resume(self, cfg: TrainConfig, store_identity: str = "") -> Path | None:
        """The checkpoint this run continues from (None: a fresh run), after checking that it may; decided on rank
        0 and handed to every rank.

        --resume takes the newest checkpoint that loads (naming the ones it skips) made with the same
        trajectory-shaping options and store; without --resume the run folder must hold no earlier run."""
        return on_rank0(self.rank, self.world_size, lambda: self._to_resume(cfg, store_identity))

    def _to_resume(self, cfg: TrainConfig, store_identity: str) -> Path | None:
        paths = self.complete()
        metrics = self.run / METRICS_FILE
        earlier = metrics.is_file() and metrics.stat().st_size > 0
        if not cfg.resume:
            if paths:
                raise DflashError(
                    f"{self.run} already holds checkpoints; pass --resume to continue that run, or choose a new "
                    "--out (or delete the folder) to start fresh"
                )
            if earlier:
                raise DflashError(
                    f"{self.run} holds the metrics of an earlier run ({metrics.name}) that stopped before its first "
                    "checkpoint; pass --resume to start it again from step 0 (its records are replaced), or choose a "
                    "new --out"
                )
            return None
        if not paths:  # killed before its first checkpoint (or never started): nothing to continue
            if earlier:
                logger.warning(
                    "--resume: %s has no checkpoint (the run stopped before its first one): starting again from "
                    "step 0, replacing its records",
                    self.run,
                )
            return None
        path, skipped = self.newest_whole("--resume")
        if path is None:
            raise DflashError(
                f"--resume: {self.run} has no checkpoint that loads ({'; '.join(skipped)}); remove its checkpoints "
                "folder to start again from step 0, or train into a new --out"
            )
        self.check_resumable(cfg, path, store_identity)
        return path

    def newest_whole(self, taker: str) -> tuple[Path | None, list[str]]:
        """The newest checkpoint that passes `problem` (None: none does) and a `step_N: reason` for each newer one;
        `taker` (--resume, export) logs each one skipped, and a taken checkpoint whose files cannot be verified."""
        skipped = []
        for path in self.complete():
            reason = self.problem(path)
            if reason is None:
                if skipped:
                    logger.warning("%s: taking %s instead", taker, path.name)
                warn_if_undigested(path, taker)
                return path, skipped
            logger.warning("%s: skipping checkpoint %s: %s", taker, path, reason)
            skipped.append(f"{path.name}: {reason}")
        return None, skipped

    def check_resumable(self, cfg: TrainConfig, path: Path, store_identity: str = ""):
        """A resume must continue the same run: every option that shapes the trajectory must be unchanged, and the
        store must be the same (its manifest's identity)."""
        state = read_state(path)
        now = fingerprint(cfg, self.world_size)
        details = describe_differences(state["fingerprint"], now, "checkpoint", "now")
        changed = {k for k in {*state["fingerprint"], *now} if state["fingerprint"].get(k) != now.get(k)}
        if details and changed <= {"max_steps", "epochs"}:
            raise DflashError(
                f"cannot resume {path} with other total steps ({details}): a run cannot be extended or shortened "
                "exactly (the learning rate's schedule spans the total steps); rerun with the original options, or "
                "train into a new --out with the new length"
            )
        if details:
            raise DflashError(
                f"cannot resume {path}: the run was made with other options ({details}); "
                "rerun with the original options or train into a new --out"
            )
        saved = state.get("store_identity", "")
        if saved and store_identity and saved != store_identity:
            raise DflashError(
                f"cannot resume {path}: it was trained on the store {state['config']['store']} (identity "
                f"{saved[:16]}), but --shards {cfg.store} is another store (identity {store_identity[:16]}); pass "
                "the original --shards or train into a new --out"
            )

    # ---- save and load

    def save(self, trainer, step: int) -> Path:
        """Written into a temporary folder of this save that rank 0 renames to step_N once every rank's files are
        in it, flushed to the disk. A full disk is one DflashError on every rank, the previous checkpoint intact."""
        self.check_replicas(trainer)
        main = self.rank == 0
        final = self.path(step)
        save_id = on_rank0(self.rank, self.world_size, lambda: secrets.token_hex(8))
        tmp = final.with_name(f".tmp-{final.name}-{save_id}")
        failure, rng_digest = None, None
        try:
            if main:
                for stale in self.folder.glob(".tmp-*"):  # the run folder is locked: these are a dead run's
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir(parents=True)
            self._barrier()
            rng = {"torch": torch.get_rng_state(), "save_id": save_id, "sums": trainer.train_tally.sums.detach().cpu()}
            if trainer.cuda:
                rng["cuda"] = torch.cuda.get_rng_state(trainer.device)
            rng_digest = _write(tmp / f"rng_rank{self.rank}.pt", rng)
        except OSError as exc:  # every rank must learn of it, or the others wait in the next collective
            failure = exc
        rng_digests = gather(rng_digest, self.world_size)  # a rank whose write failed too: none waits alone
        if main and None not in rng_digests:
            try:
                self._write_shared(trainer, tmp, step, save_id, rng_digests)
            except OSError as exc:
                failure = exc
        failed = any_rank(failure is not None, self.world_size, trainer.device)
        if failed:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            previous = self.latest()
            kept = f"; the previous checkpoint {previous.name} is intact" if previous else ""
            what = f"writing checkpoint {final.name} failed" + ("" if failure else " on another rank")
            if failure is None:
                raise DflashError(f"{what} (see that rank's output){kept}")
            if failure.errno not in DISK_ERRORS:
                raise DflashError(f"{what}: {failure.strerror or failure} in {self.folder}{kept}") from None
            raise DflashError(str(disk_error(failure, what, self.folder)) + kept) from None
        if main:
            fsync_folder(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            fsync_folder(self.folder)
        self._barrier()
        return final

    def _write_shared(self, trainer, tmp: Path, step: int, save_id: str, rng_digests: list[str]):
        """Rank 0's files: weights, optimizer, state.json, and last the digests of every file of the checkpoint."""
        epoch, index = trainer.plan.position(step)
        files = {"model.pt": _write(tmp / "model.pt", trainer.model.state_dict())}
        if trainer.projection is not None:  # the export folds it into fc
            files["projection.pt"] = _write(tmp / "projection.pt", trainer.projection)
        files["optimizer.pt"] = _write(tmp / "optimizer.pt", trainer.optimizer.state_dict())
        state = {
            "step": step,
            "epoch": epoch,
            "index": index,
            "total_steps": trainer.total_steps,
            "fingerprint": fingerprint(trainer.cfg, self.world_size),
            "config": dataclasses.asdict(trainer.cfg),
            "method": trainer.dcfg.method,
            "drafter": dataclasses.asdict(trainer.dcfg),
            "world_size": self.world_size,
            "store_identity": trainer.store.manifest.identity,
            "save_id": save_id,
        }
        files["state.json"] = _write(tmp / "state.json", (json.dumps(state, indent=2) + "\n").encode())
        files |= {f"rng_rank{r}.pt": digest for r, digest in enumerate(rng_digests)}
        _write(tmp / DIGESTS, (json.dumps({"sha256": files}, indent=2) + "\n").encode())

    def load(self, trainer, path: Path):
        """Copy the checkpoint into the live tensors in place: the captured graph keeps reading the same storage.
        The metric sums of the steps after the last record come back too, so the next record is the same."""
        state = read_state(path)
        with torch.no_grad():
            trainer.model.load_state_dict(torch.load(path / "model.pt", map_location=trainer.device))
            saved = torch.load(path / "optimizer.pt", map_location=trainer.device)["state"]
            # optimizer.state_dict() numbers the parameters in param-group order
            ordered = [p for group in trainer.optimizer.param_groups for p in group["params"]]
            for i, p in enumerate(ordered):
                for key, value in trainer.optimizer.state[p].items():
                    value.copy_(saved[i][key])
            trainer.step_t.fill_(state["step"])
        rng = torch.load(path / f"rng_rank{self.rank}.pt")
        if rng.get("save_id") != state.get("save_id"):
            raise DflashError(f"{path} holds files of two saves; resume from another checkpoint")
        torch.set_rng_state(rng["torch"])
        if trainer.cuda and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], trainer.device)
        if "sums" in rng and rng["sums"].shape == trainer.train_tally.sums.shape:
            trainer.train_tally.sums.copy_(rng["sums"])

    def check_replicas(self, trainer):
        """Every rank must hold the same weights (same gradients, same update): compare per-tensor checksums."""
        if self.world_size == 1:
            return
        sums = torch.stack([p.detach().sum(dtype=torch.float64) for p in trainer.params])
        gathered = [torch.empty_like(sums) for _ in range(self.world_size)]
        dist.all_gather(gathered, sums)
        if not all(torch.equal(g, gathered[0]) for g in gathered):
            raise DflashError("the ranks' weights diverged; this is a bug in dflash, please report it")

    def _barrier(self):
        if self.world_size > 1:
            dist.barrier()

    # ---- export

    def export(
        self,
        out,
        step: int | None = None,
        dtype: str = "bfloat16",
        force: bool = False,
        with_target_embeddings: bool = False,
        target: str | None = None,
    ) -> Path:
        """Write the drafter of a checkpoint (the latest complete one by default) in the public layout; with
        `with_target_embeddings`, the embedding and LM head of `target` (None: the run's target) too.

        `out` must be new, empty, or (with `force`) an earlier export; nothing else in it is ever overwritten."""
        check_export_target(out, replace_export=force)  # before reading the checkpoint: refuse early
        if step is None:  # the newest checkpoint that is whole, as a resume would take
            path, _ = self.newest_whole("export")
        else:
            path = self.path(step)
            problem = self.problem(path) if (path / "state.json").exists() else None
            if problem:
                raise DflashError(
                    f"checkpoint {path} is damaged or incomplete ({problem}); export another one with --step"
                )
            warn_if_undigested(path, "export")
        if path is None or not (path / "state.json").exists():
            which = "complete checkpoint" if step is None else f"checkpoint step {step}"
            raise DflashError(
                f"{self.run} has no {which} (looked in {self.folder}); train first or pick another --step"
            )
        try:
            state = read_state(path)
            dcfg = drafter_config_of(state)
            with torch.device("meta"):
                model = methods.model_for(dcfg)
            model.load_state_dict(torch.load(path / "model.pt", map_location="cpu"), assign=True)
            projection = torch.load(path / "projection.pt") if (path / "projection.pt").exists() else None
        except DflashError:
            raise
        except Exception as exc:  # a checkpoint cut short or edited: torch / pickle / JSON errors of many kinds
            raise DflashError(
                f"cannot read checkpoint {path} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "it is damaged or incomplete: export another one with --step"
            ) from None
        embeddings = read_target_embeddings(target or run_target(state), dcfg) if with_target_embeddings else None
        return export_drafter(
            model,
            dcfg,
            out,
            dtype=getattr(torch, dtype),
            projection=projection,
            replace_export=force,
            target_embeddings=embeddings,
        )


def run_target(state: dict) -> str:
    """The target checkpoint a run trained with (a checkpoint's state.json): its --target, else its store's."""
    cfg = state["config"]
    if cfg.get("target"):
        return cfg["target"]
    path = Path(cfg["store"])
    manifest = store.read_manifest(path / store.MANIFEST_FILE) if path.is_dir() else None
    if manifest is None:
        raise DflashError(
            f"the run's store {path} is not here to name the target it was harvested from; pass --target the "
            "target checkpoint the drafter was trained with"
        )
    return store.target_path(path, manifest)
