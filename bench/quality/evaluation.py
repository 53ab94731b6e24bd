"""The eval: held-out prompts decoded by every drafter and the baselines, in shares over worker processes."""

import hashlib
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.quality.scale import Scale
from bench.quality.store_modes import BF16
from bench.quality.workers import gpu_count, in_workers

logger = logging.getLogger("quality")


def evaluate_all(
    scale: Scale,
    target_path: Path,
    drafter_path: Path,
    prompts: list[dict],
    device: torch.device,
    budget: float,
    seed: int,
    work: Path,
    log: Path,
    modes: dict[str, str] | None = None,
    temperature: float = 0.0,
):
    """The trained drafter and prompt lookup in one `dflash.evaluate.evaluate` run (one plain greedy decoding
    per prompt is the reference of both: tokens/s and the mismatch check), with the drafters of the store modes
    (`modes`: report name -> drafter folder) in the same run when given, after the untrained drafter on the first
    `scale.baseline_prompts` prompts. The untrained drafter's tau is 1 by construction and it pays a verify
    forward per token: run on every prompt, it took 38 % of the eval. Its speedup is against the plain decoding of
    its own run.

    The prompts are dealt out to `eval_workers_per_gpu` workers per GPU (prompt i to worker i % W), each going
    through its share in order until `budget` is spent. Each worker saves its reports in `work` after every
    prompt and a later call goes on from them (`evaluate`'s resume), so that every held-out prompt is evaluated
    however many calls that takes. The shares are then merged into one report in prompt order. Returns the
    report and whether it covers every prompt. At a temperature above 0: the drafters alone (bf16's and the
    modes'), sampled with `seed`, verified losslessly, in a report of their own."""
    records = [{"prompt": p["text"]} for p in prompts]
    gpus = gpu_count(device)
    count = max(gpus, 1) * scale.eval_workers_per_gpu
    settings = dict(
        model=str(target_path),
        device=device.type,
        dtype="float32",
        temperature=temperature,
        seed=seed,
        max_new_tokens=scale.new_tokens,
        min_prompts=scale.min_eval_prompts,
    )
    main = "eval_main"
    drafters = str(drafter_path)
    if modes:  # another report: the one without modes (an earlier call's) has other methods
        drafters = {BF16.method: str(drafter_path), **modes}
        main = "eval_modes_" + hashlib.sha256(json.dumps(drafters).encode()).hexdigest()[:10]
    runs = {  # report name: the drafter(s), the prompts, prompt lookup's draft length
        "eval_baseline": ("untrained", records[: scale.baseline_prompts], 0),
        main: (drafters, records, scale.prompt_lookup_tokens),
    }
    if temperature > 0:
        runs = {f"{main}_T{temperature:g}": (drafters, records, 0)}
    jobs = [dict(runs=runs, share=(w, count), work=work, budget=budget, **settings) for w in range(count)]
    in_workers(evaluate_share, jobs, gpus, log)
    if temperature > 0:
        ((name, run),) = runs.items()
        report = merge_shares(name, *run, count, work, settings)
        return report, len(report.prompts) == len(records)
    baseline, report = (merge_shares(name, *run, count, work, settings) for name, run in runs.items())
    report.methods.update(baseline.methods)
    report.drafter = f"{report.drafter}, {baseline.drafter}"
    for row, baseline_row in zip(report.prompts, baseline.prompts):
        row["runs"].update(baseline_row["runs"])
    for row in report.prompts:
        row["file"] = prompts[row["index"]]["file"]
    return report, len(report.prompts) == len(records)


def share_path(work: Path, name: str, share: tuple[int, int]) -> Path:
    # "share": its rows carry the prompts' own indices (`evaluate(share=...)`); the files of earlier versions,
    # numbered within the share, are not read.
    return work / f"{name}_share{share[0]}of{share[1]}.json"


def named_drafters(drafters: str | dict[str, str]) -> list[str] | dict[str, str]:
    """`evaluate`'s drafters for a run's drafter: one folder (or "untrained"), or {method name: folder} for the
    drafters of the store modes, evaluated on the same prompts as the bf16 one."""
    return [drafters] if isinstance(drafters, str) else drafters


def evaluate_share(runs: dict, share: tuple[int, int], work: Path, budget: float | None, **settings):
    """One worker's share of each run: prompts share[0], share[0] + share[1], ... (`evaluate`'s share); its
    reports saved in `work` after every prompt and resumed from there. The budget counts from the worker's start."""
    from dflash.config import EvalConfig
    from dflash.evaluate import evaluate
    from dflash.store import write_json_atomic

    start = time.perf_counter()
    for name, (drafter, records, lookup) in runs.items():
        path, count = share_path(work, name, share), len(range(share[0], len(records), share[1]))
        earlier = json.loads(path.read_text()) if path.exists() else None
        if earlier:
            done = len(earlier["prompts"])
            logger.info(
                "eval %s: %s",
                path.name,
                f"all {done} prompts done by earlier calls"
                if done == count
                else f"going on after {done} of {count} prompts",
            )
        left = None if budget is None or name == "eval_baseline" else max(0.0, budget - (time.perf_counter() - start))
        evaluate(
            EvalConfig(data=records, prompt_lookup=lookup, time_budget=left, **settings),
            drafters=named_drafters(drafter),
            resume=earlier,
            on_prompt=lambda partial, path=path: write_json_atomic(path, asdict(partial)),
            share=share,
        )


def merge_shares(
    name: str, drafter: str | dict[str, str], records: list[dict], lookup: int, count: int, work: Path, settings: dict
):
    """The workers' reports of one run as one report (`dflash.evaluate.shares.merge_reports`), then the whole report
    rebuilt (totals, histogram, tau) by `evaluate` resuming from it with nothing left to run."""
    from dflash.config import EvalConfig
    from dflash.evaluate import evaluate
    from dflash.evaluate.shares import merge_reports

    paths = [share_path(work, name, (w, count)) for w in range(count)]
    shares = [json.loads(path.read_text()) for path in paths if path.exists()]
    if not shares:
        raise RuntimeError(f"no worker wrote a report of {name} in {work}")
    cfg = EvalConfig(
        data=records, prompt_lookup=lookup, time_budget=0.0, warmup=False, **{**settings, "min_prompts": 0}
    )
    return evaluate(cfg, drafters=named_drafters(drafter), resume=merge_reports(shares))
