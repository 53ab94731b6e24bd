"""`dflash regenerate` (target responses to train on) and `dflash eval` (acceptance length and speedup).

Thin click commands over dflash.regenerate and dflash.evaluate; their options come from RegenerateConfig and
EvalConfig. torch and transformers are imported inside the commands so that `dflash --help` stays fast.
"""

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

import click

from cli.options import config_option, config_options, reports_errors
from dflash.config import EvalConfig, RegenerateConfig, given


@click.command("regenerate")
@config_option
@config_options(RegenerateConfig)
@reports_errors
def regenerate_command(**options):
    """Answer every prompt with the target itself, writing chat JSONL that `dflash harvest` reads."""
    from dflash.regenerate import regenerate

    cfg = given(RegenerateConfig, options)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the target's kernels
    stats = regenerate(cfg)
    click.echo(
        f"{cfg.out}: {stats.written} responses written, {stats.already_done} already there, {stats.prompts} prompts"
    )
    if stats.context_turns:
        click.echo(
            f"{stats.context_turns} earlier assistant turns of {stats.context_conversations} conversations are the "
            "data's, not the target's: kept as context, with no loss in harvest (--turns all has the target write "
            "them)"
        )
    if stats.unfinished:
        click.echo(
            f"{stats.unfinished} answers were cut at --max-new-tokens {cfg.max_new_tokens} before the target ended "
            'them: marked "unfinished", their end-of-turn token is kept out of the loss in harvest (raise '
            "--max-new-tokens to let them finish)"
        )


@click.command("eval")
@config_option
@config_options(EvalConfig)
@reports_errors
def eval_command(**options):
    """Speculative decoding with the drafter: acceptance length tau, histogram, tokens/s and speedup."""
    from dflash.errors import DflashError
    from dflash.evaluate import evaluate
    from dflash.store import write_json_atomic

    cfg = given(EvalConfig, options)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the target's kernels
    json_path = Path(cfg.json_path) if cfg.json_path else None
    if json_path and json_path.is_dir():
        raise DflashError(f"--json {json_path} is a folder; give the path of a JSON file for the report")
    if json_path and not json_path.parent.is_dir():
        raise DflashError(f"--json {json_path}: the folder {json_path.parent} does not exist; create it first")
    if json_path and not os.access(json_path.parent, os.W_OK | os.X_OK):
        raise DflashError(f"--json {json_path}: the folder {json_path.parent} is not writable; give another path")
    if json_path and not cfg.resume and json_path.exists():
        raise DflashError(
            f"{json_path} exists: pass --resume to go on from that report, or give another --json "
            "(or remove it) to start a new one"
        )
    earlier = read_report(json_path) if cfg.resume and json_path.exists() else None
    # Split over torchrun's processes, every one runs the same evaluation: the first one reports.
    reports = cfg.tensor_parallel == 1 or int(os.environ.get("RANK", 0)) == 0
    report = evaluate(
        cfg,
        resume=earlier,
        on_prompt=(lambda partial: write_json_atomic(json_path, asdict(partial))) if json_path and reports else None,
        progress=reports,
    )
    if not reports:
        return
    click.echo(report.prompt_table() + "\n")
    click.echo(report.table())
    if json_path:
        write_json_atomic(json_path, asdict(report))
        click.echo(f"report written to {json_path}")


def read_report(path: Path) -> dict:
    """The JSON object at `path`; `evaluate` checks that it is a report of this evaluation."""
    from dflash.errors import DflashError

    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        report = error
    if not isinstance(report, dict):
        raise DflashError(
            f"{path} is not a dflash eval report ({report if isinstance(report, Exception) else 'not a JSON object'}); "
            "give another --json or leave out --resume"
        )
    return report
