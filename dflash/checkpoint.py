"""The checkpoints of a training run: save, find the latest, load in place, check a resume, export.

A checkpoint is the folder RUN/checkpoints/step_N: written into .tmp-step_N by every rank and renamed by rank 0
once all files are in it, so a folder named step_N is complete by construction and the latest checkpoint is the
highest such N. Loading copies into the trainer's live tensors in place, so that the captured step keeps reading
the same storage. Contents and resume semantics are in docs/training.md.
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.config import TrainConfig
from dflash.drafter import DFlashDrafter, DrafterConfig, export_drafter
from dflash.errors import DflashError, describe_differences

PREFIX = "step_"

# Options that may differ between a run and its resumption: they change how the run executes or reports, not
# the sequence of weights it computes.
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
    "device",
    "compile",
    "cuda_graph",
    "peak_tflops",
    "tensorboard",
    "prefetch",
    "reader_workers",
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


class Checkpointer:
    """The checkpoints of the run in `out`, seen from one rank (rank 0 writes the files every rank shares)."""

    def __init__(self, out, rank: int = 0, world_size: int = 1):
        self.run = Path(out)
        self.folder = self.run / "checkpoints"
        self.rank, self.world_size = rank, world_size

    def path(self, step: int) -> Path:
        return self.folder / f"{PREFIX}{step}"

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step: complete ones are exactly those renamed to step_N."""
        numbers = [p.name.removeprefix(PREFIX) for p in self.folder.glob(f"{PREFIX}*")]
        steps = [int(n) for n in numbers if n.isdigit()]
        return self.path(max(steps)) if steps else None

    # ---- resume

    def to_resume(self, cfg: TrainConfig) -> Path | None:
        """The checkpoint this run continues from (None: a fresh run), after checking that it may.

        --resume needs a complete checkpoint made with the same trajectory-shaping options; without --resume the
        run folder must hold no checkpoints."""
        latest = self.latest()
        if not cfg.resume:
            if latest is not None:
                raise DflashError(
                    f"{self.run} already holds checkpoints of a run; pass --resume to continue it or choose a new --out"
                )
            return None
        if latest is None:
            raise DflashError(f"--resume: {self.run} has no complete checkpoint; start without --resume")
        self.check_resumable(cfg, latest)
        return latest

    def check_resumable(self, cfg: TrainConfig, path: Path):
        """A resume must continue the same run: every option that shapes the trajectory must be unchanged."""
        now = fingerprint(cfg, self.world_size)
        details = describe_differences(read_state(path)["fingerprint"], now, "checkpoint", "now")
        if details:
            raise DflashError(
                f"cannot resume {path}: the run was made with other options ({details}); "
                "rerun with the original options or train into a new --out"
            )

    # ---- save and load

    def save(self, trainer, step: int):
        """Written into a temporary folder that rank 0 renames to step_N once every rank's files are in it."""
        self.check_replicas(trainer)
        main = self.rank == 0
        final = self.path(step)
        tmp = final.with_name(f".tmp-{final.name}")
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        rng = {"torch": torch.get_rng_state()}
        if trainer.cuda:
            rng["cuda"] = torch.cuda.get_rng_state(trainer.device)
        torch.save(rng, tmp / f"rng_rank{self.rank}.pt")
        if main:
            epoch, index = trainer.plan.position(step)
            state = {
                "step": step,
                "epoch": epoch,
                "index": index,
                "total_steps": trainer.total_steps,
                "fingerprint": fingerprint(trainer.cfg, self.world_size),
                "config": dataclasses.asdict(trainer.cfg),
                "drafter": dataclasses.asdict(trainer.dcfg),
                "world_size": self.world_size,
            }
            torch.save(trainer.model.state_dict(), tmp / "model.pt")
            if trainer.projection is not None:  # the export folds it into fc
                torch.save(trainer.projection, tmp / "projection.pt")
            torch.save(trainer.optimizer.state_dict(), tmp / "optimizer.pt")
            (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
        self._barrier()
        if main:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        self._barrier()

    def load(self, trainer, path: Path):
        """Copy the checkpoint into the live tensors in place: the captured graph keeps reading the same storage."""
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
        torch.set_rng_state(rng["torch"])
        if trainer.cuda and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], trainer.device)

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

    def export(self, out, step: int | None = None, dtype: str = "bfloat16") -> Path:
        """Write the drafter of a checkpoint (the latest complete one by default) in the public layout."""
        path = self.latest() if step is None else self.path(step)
        if path is None or not (path / "state.json").exists():
            which = "a complete checkpoint" if step is None else f"checkpoint step {step}"
            raise DflashError(
                f"{self.run} has no {which} (looked in {self.folder}); train first or pick another --step"
            )
        dcfg = DrafterConfig(**read_state(path)["drafter"])
        with torch.device("meta"):
            model = DFlashDrafter(dcfg)
        model.load_state_dict(torch.load(path / "model.pt", map_location="cpu"), assign=True)
        projection = torch.load(path / "projection.pt") if dcfg.feature_width is not None else None
        return export_drafter(model, dcfg, out, dtype=getattr(torch, dtype), projection=projection)
