"""The whole chain on a tiny embedded target, on a CPU: what `make smoke` runs.

tiny Qwen3.5-architecture target (cached) -> regenerate responses to bundled prompts -> harvest (responses and
the bundled corpus) -> train a few steps -> export -> speculative-decoding eval -> one summary table.
Every stage goes through the same library entry points as the CLI commands.
"""

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dflash.tiny import CORPUS, PROMPTS, make_tiny_target

logger = logging.getLogger("dflash")


@dataclass
class SmokeConfig:
    work: str = ".smoke"
    prompts: int = 16  # bundled prompts answered by the target
    max_new_tokens: int = 48
    token_budget: int = 1024
    train_steps: int = 40
    eval_prompts: int = 4
    eval_new_tokens: int = 48


def run_smoke(cfg: SmokeConfig) -> dict:
    """Run every stage fresh (only the tiny target is cached) and return the summary."""
    from dflash.config import EvalConfig, HarvestConfig, RegenerateConfig, TrainConfig
    from dflash.evaluate import evaluate
    from dflash.harvest import run_harvest
    from dflash.regenerate import regenerate
    from dflash.store import Store, disk_bytes
    from dflash.train.run import run_training

    work = Path(cfg.work)
    for stale in ("store", "run"):  # every stage but the target reruns from scratch
        shutil.rmtree(work / stale, ignore_errors=True)
    (work / "responses.jsonl").unlink(missing_ok=True)
    seconds = {}

    def stage(name, fn):
        start = time.perf_counter()
        logger.info("smoke: %s", name)
        result = fn()
        seconds[name] = time.perf_counter() - start
        return result

    target = stage("target", lambda: str(make_tiny_target(work / "target", "qwen3_5")))
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(PROMPTS.read_text().splitlines(keepends=True)[: cfg.prompts]))
    responses = work / "responses.jsonl"
    stage(
        "regenerate",
        lambda: regenerate(
            RegenerateConfig(
                target,
                str(prompts),
                str(responses),
                max_new_tokens=cfg.max_new_tokens,
                device="cpu",
                dtype="float32",
            )
        ),
    )
    data = work / "train.jsonl"
    data.write_text(responses.read_text() + CORPUS.read_text())
    store_path = work / "store"
    stage(
        "harvest",
        lambda: run_harvest(
            HarvestConfig(
                model=target,
                data=str(data),
                out=str(store_path),
                token_budget=cfg.token_budget,
                workers=1,
                device="cpu",
                dtype="float32",
            )
        ),
    )
    store = Store.open(store_path)
    result = stage(
        "train",
        lambda: run_training(
            TrainConfig(
                store=str(store_path),
                out=str(work / "run"),
                max_steps=cfg.train_steps,
                log_every=10,
                device="cpu",
                tensorboard=False,
            )
        ),
    )
    report = stage(
        "eval",
        lambda: evaluate(
            EvalConfig(
                target,
                str(prompts),
                drafter=result["export"],
                num_prompts=cfg.eval_prompts,
                max_new_tokens=cfg.eval_new_tokens,
                device="cpu",
                dtype="float32",
            ),
            progress=True,
        ),
    )
    tokens = store.manifest.counts.tokens
    last = result["records"][-1]
    summary = {
        "method": TrainConfig.method,  # the trainer's default, which the smoke trains
        "store_bytes": disk_bytes(store_path),
        "stored_tokens": tokens,
        "bytes_per_token": disk_bytes(store_path) / tokens,
        "train_context_tok_s": last["context_tok_s"],
        "train_loss": last["loss"],
        "tau": report.methods["dflash"].tau,
        "val_tau": (result.get("val") or {}).get("tau"),
        "mismatches": report.methods["dflash"].mismatches,
        "seconds": seconds,
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def summary_table(s: dict) -> str:
    rows = [
        ("drafter method", s["method"]),
        ("store size", f"{s['store_bytes'] / 1e6:.2f} MB ({s['stored_tokens']} tokens)"),
        ("bytes per token", f"{s['bytes_per_token']:.0f}"),
        ("train tokens/s (context)", f"{s['train_context_tok_s']:.0f}"),
        ("final train loss", f"{s['train_loss']:.3f}"),
        ("tau (acceptance length)", f"{s['tau']:.2f}"),
        (
            "tau replayed on held-out rows",
            f"{s['val_tau']:.2f}" if s["val_tau"] is not None else "- (no held-out rows)",
        ),
        ("greedy mismatches", str(s["mismatches"])),
        ("stage seconds", ", ".join(f"{k} {v:.1f}" for k, v in s["seconds"].items())),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
