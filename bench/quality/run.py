"""A quality run's stages against their budgets, kept in its work folder so that a later call goes on from them."""

import json
import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from bench.quality.scale import Scale
from bench.quality.store_modes import MODES, mode_harvested
from dflash.errors import describe_differences

logger = logging.getLogger("quality")


class WorkFolderInUse(Exception):
    pass


class Run:
    """Stage timing against budgets, and the JSON results written after every stage.

    A finished stage's result is also kept as `WORK/stages/NAME.json`, written last (tmp + rename), so that a
    later call with the same --work, sizes and seed skips it: the run can be split over several device calls
    on one machine (--stop-after).
    """

    RESUMABLE = {
        "target": ["target"],
        "regenerate": ["responses*.jsonl"],
        "harvest": ["shards", "shards_val"],
        "drafter": ["run", "eval_*.json"],
    }
    # How long a call may take and how its work is spread over processes: no finished stage's result depends on
    # them, so a later call on the same --work may change them (a longer eval budget, say) and keep its stages.
    CALL_FIELDS = frozenset(
        {
            "total_seconds",
            "eval_seconds",
            "drafter_seconds",
            "min_eval_prompts",
            "regen_workers_per_gpu",
            "eval_workers_per_gpu",
            "mode_workers",
            "mode_train_workers",
        }
    )

    def __init__(self, out: Path, scale: Scale, work: Path, seed: int, restart: bool = False):
        self.out, self.scale = out, scale
        self.start = time.perf_counter()
        self.results: dict = {"scale": asdict(scale), "stages": {}}
        self.stages = work / "stages"
        identity = {"seed": seed, **{k: v for k, v in asdict(scale).items() if k not in self.CALL_FIELDS}}
        self._forget_other_runs(work, identity, restart)

    def _forget_other_runs(self, work: Path, identity: dict, restart: bool):
        """Keep the finished stages of an earlier call with the same sizes and seed; drop every other output.

        An earlier run of other sizes or seed is only deleted when asked (`restart`): its stages may have cost a
        whole device call."""
        marker = self.stages / "identity.json"
        if marker.exists() and (earlier := json.loads(marker.read_text())) != identity:
            differences = describe_differences(earlier, identity, "the run in --work", "this call")
            if not restart:
                raise WorkFolderInUse(
                    f"{work} holds a run of other sizes or seed ({differences}): give the same --set values and "
                    "--seed to go on with it, another --work, or --restart to delete it and start over"
                )
            logger.warning("work folder %s holds a run of other sizes or seed (%s): starting over", work, differences)
            shutil.rmtree(self.stages)
        self.stages.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps(identity))
        for name, outputs in self.RESUMABLE.items():
            if not (self.stages / f"{name}.json").exists():
                for path in (path for pattern in outputs for path in work.glob(pattern)):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in (work / MODES).glob("*"):  # a store mode (--modes) is kept once its stores are saved
            if not mode_harvested(self.stages, path.name).exists():
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.scale.total_seconds - self.elapsed()

    def stage(self, name: str, budget: float | None, fn, keep: bool = False):
        """Run stage `name` (or take its result from an earlier call); `keep`: its result goes into the results
        under its name before they are saved, so that a later stage's crash does not lose it."""
        done = self.stages / f"{name}.json"
        if name in self.RESUMABLE and done.exists():
            saved = json.loads(done.read_text())
            self.results["stages"][name] = {**saved["timing"], "resumed": True}
            if keep:
                self.results[name] = saved["result"]
            logger.info("-- %s: finished by an earlier call (%s), skipped", name, done)
            return saved["result"]
        logger.info(
            "== %s: budget %s (run at %.0f s of %.0f s)",
            name,
            f"{budget:.0f} s" if budget else "-",
            self.elapsed(),
            self.scale.total_seconds,
        )
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
        self.results["stages"][name] = {"budget_s": budget, "seconds": round(seconds, 2)}
        over = f" (OVER budget by {seconds - budget:.0f} s)" if budget and seconds > budget * 1.1 else ""
        logger.info("-- %s done in %.1f s%s", name, seconds, over)
        if name in self.RESUMABLE:
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps({"timing": self.results["stages"][name], "result": result}, default=str))
            tmp.rename(done)
        if keep:
            self.results[name] = result
        self.save()
        return result

    def save(self):
        self.results["elapsed_s"] = round(self.elapsed(), 2)
        self.out.write_text(json.dumps(self.results, indent=1, default=str))
