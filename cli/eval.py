"""`dflash regenerate` (target responses to train on) and `dflash eval` (acceptance length and speedup).

Thin click commands over dflash.regenerate and dflash.evaluate; their options come from RegenerateConfig and
EvalConfig. torch and transformers are imported inside the commands so that `dflash --help` stays fast.
"""

import contextlib
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
    from dflash.parallel import is_first_process
    from dflash.regenerate import regenerate

    cfg = given(RegenerateConfig, options)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the target's kernels
    stats = regenerate(cfg)
    if not is_first_process():
        return  # split over torchrun's processes, the first one reports
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
    from dflash.parallel import is_first_process

    cfg = given(EvalConfig, options)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the target's kernels
    json_path = Path(cfg.json_path) if cfg.json_path else None
    if json_path and json_path.is_dir():
        raise DflashError(f"--json {json_path} is a folder; give the path of a JSON file for the report")
    if json_path and not json_path.parent.is_dir():
        raise DflashError(f"--json {json_path}: the folder {json_path.parent} does not exist; create it first")
    if json_path and not os.access(json_path.parent, os.W_OK | os.X_OK):
        raise DflashError(f"--json {json_path}: the folder {json_path.parent} is not writable; give another path")
    # Under torchrun the processes share the prompts (dflash.evaluate): the first one reports.
    reports = is_first_process()
    writes = json_path is not None and reports
    with report_lock(json_path) if writes else contextlib.nullcontext():
        if json_path and not cfg.resume and json_path.exists():
            raise DflashError(
                f"{json_path} exists: pass --resume to go on from that report, or give another --json "
                "(or remove it) to start a new one"
            )
        earlier = read_report(json_path) if cfg.resume and json_path.exists() else None
        report = evaluate(
            cfg,
            resume=earlier,
            on_prompt=(lambda partial: write_report(json_path, partial)) if writes else None,
            progress=reports,
        )
        if not reports:
            return
        click.echo(report.prompt_table() + "\n")
        click.echo(report.table())
        if json_path:
            write_report(json_path, report)
            click.echo(f"report written to {json_path}")


def report_lock(json_path: Path):
    """Held while an eval writes its report: a second eval into the same report is refused, not interleaved."""
    from dflash.locks import FileLock

    return FileLock(
        json_path.with_name(f".{json_path.name}.lock"),
        lambda holder: (
            f"the report {json_path} is being written right now by another eval ({holder}); let it finish (then "
            "--resume adds to it), or give this eval another --json"
        ),
        remove=True,
    )


def write_report(json_path: Path, report) -> None:
    """The report, replacing the previous one atomically: a failed write (a full disk) leaves the last one whole."""
    from dflash.errors import DISK_ERRORS, DflashError, disk_error
    from dflash.store import write_json_atomic

    try:
        write_json_atomic(json_path, asdict(report))
    except OSError as exc:
        fix = "rerun with --resume: the report holds the prompts finished before this one"
        if exc.errno in DISK_ERRORS:
            raise disk_error(exc, f"writing the report {json_path} failed", json_path.parent, fix) from None
        raise DflashError(f"writing the report {json_path} failed ({exc.strerror}); fix that and {fix}") from None


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
