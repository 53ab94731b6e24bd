"""The bf16 store and the drafter trained on it, through the library entry points the CLI uses."""

import contextlib
import json
import logging
from pathlib import Path

from bench.quality.scale import Scale
from bench.quality.store_modes import BF16, StoreMode

logger = logging.getLogger("quality")


def slow_compile_phases(min_seconds: float = 1.0) -> dict[str, float]:
    """torch.compile's own timings (summed over this process's compiles) of its phases that took over
    min_seconds: tracing, AOT autograd, inductor's codegen, waiting for Triton's compile workers, ..."""
    from torch._dynamo.utils import compile_times

    phases = {}
    for line in compile_times(repr="str", aggregate=True).splitlines()[2:]:
        name, _, seconds = line.rpartition(", ")
        with contextlib.suppress(ValueError):
            if float(seconds) >= min_seconds:
                phases[name] = round(float(seconds), 1)
    return phases


def harvest_store(
    scale: Scale,
    target: Path,
    data: str,
    out: Path,
    device,
    mode: "StoreMode | None" = None,
    projection_from: Path | None = None,
) -> Path:
    """`run_harvest` of the responses in `data` into the store `out`, in `mode` (default: bf16, full width)."""
    from dflash.config import HarvestConfig
    from dflash.harvest import run_harvest

    mode = mode or BF16
    return run_harvest(
        HarvestConfig(
            model=str(target),
            data=str(data),
            out=str(out),
            token_budget=scale.token_budget,
            workers=scale.harvest_workers,
            device=str(device),
            dtype="float32",
            precision=mode.precision,
            subspace=mode.subspace,
            teacher=mode.teacher or "none",
            projection_from=str(projection_from) if projection_from else None,
        )
    )


def drafter_steps(scale: Scale, rows: int) -> int:
    return min(scale.drafter_epochs * (rows // scale.rows_per_step), scale.drafter_max_steps)


def train_drafter(
    scale: Scale, store: str, val_store: str, out: Path, steps: int, device, seed: int, overrides: dict | None = None
) -> dict:
    """`run_training` of the quality run's drafter (5 layers, DFlash unless `overrides` say otherwise, at the method's
    own block size unless they give one: 16, DSpark's 7) on `store`, validated on `val_store` 8 times over the run;
    its final numbers, held-out curve and metric records."""
    overrides = {"method": "dflash", **(overrides or {})}
    from dflash.config import TrainConfig
    from dflash.train.run import run_training

    cuda = str(device).startswith("cuda")
    result = run_training(
        TrainConfig(
            **overrides,
            store=str(store),
            out=str(out),
            draft_layers=5,
            rows_per_step=scale.rows_per_step,
            max_steps=max(steps, 1),
            val_store=str(val_store),
            log_every=50 if cuda else 10,
            ckpt_every=10**9,
            device=str(device),
            tensorboard=False,
            seed=seed,
            val_every=max(1, steps // 8),  # a held-out curve: where overfitting starts
        )
    )
    last, val = result["records"][-1], result.get("val") or {}
    metrics = (out / "metrics.jsonl").read_text().splitlines()
    val_curve = [
        (r["step"], round(r["loss"], 4), round(r["accept_len"], 3), round(r["tau"], 3))
        for r in map(json.loads, metrics)
        if r.get("kind") == "val"
    ]
    logger.info("drafter held-out curve (step, loss, accept length, tau of decoding replayed): %s", val_curve)
    compile_phases = slow_compile_phases()
    logger.info("drafter compile, the phases over 1 s: %s", compile_phases)
    return {
        "export": result["export"],
        "steps": last["step"],
        "train_loss": round(last["loss"], 4),
        "train_accept_len": round(last["accept_len"], 3),
        "val_loss": round(val["loss"], 4) if val else None,
        "val_accept_len": round(val["accept_len"], 3) if val else None,
        "val_tau": round(val["tau"], 3) if val else None,
        "step_ms": round(last["step_ms"], 2),
        "prepare_s": {k: round(v, 1) for k, v in result["prepare_s"].items()},
        "compile_phases_s": compile_phases,
        "val_curve": val_curve,
        "records": result["records"],
    }
