"""`dflash train` and `dflash export`: thin click commands over dflash.train and dflash.train.checkpoint.

The options come from the fields of `TrainConfig` / `ExportConfig` (dflash/config.py). torch is imported inside
the commands so that `dflash --help` stays fast.
"""

import logging

import click

from cli.options import config_option, config_options, reports_errors
from dflash.config import ExportConfig, TrainConfig, given


@click.command()
@config_option
@config_options(TrainConfig)
@reports_errors
def train(**options):
    """Train a DFlash drafter from a harvest store.

    Run with torchrun for several GPUs (one process per GPU); on one GPU or the CPU, run it directly. Writes
    metrics to OUT/metrics.jsonl and OUT/tb, checkpoints to OUT/checkpoints/step_N, and exports the drafter
    to OUT/drafter at the end. One run at a time owns OUT. Ctrl-C or SIGTERM saves a checkpoint after the
    current step and stops; the same command with --resume continues the run.
    """
    from dflash.parallel import is_first_process
    from dflash.train.run import run_training

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        result = run_training(given(TrainConfig, options))
    except KeyboardInterrupt:  # before the first step, or a second Ctrl-C: no checkpoint was saved for it
        click.echo(
            "error: interrupted without a new checkpoint; rerun the same command with --resume to continue from the "
            "last checkpoint (from step 0 if there is none)",
            err=True,
        )
        raise SystemExit(130) from None
    if result.get("damaged_rows"):
        rows = result["damaged_rows"]
        click.echo(f"skipped {len(rows)} damaged row(s) of the store: {', '.join(map(str, rows[:20]))}")
    if "export" in result and is_first_process():  # every rank's result names the export that rank 0 wrote
        click.echo(f"drafter written to {result['export']}")


@click.command()
@config_option
@click.argument("run", type=click.Path())
@config_options(ExportConfig)
@reports_errors
def export(**options):
    """Export the drafter of a training RUN in the public DFlash checkpoint layout.

    OUT must be new or empty; an earlier export there is replaced only with --force. The files are written to a
    temporary folder beside OUT and renamed into place, so an interrupted export leaves no half-written folder.
    The folder also loads with transformers: AutoModel.from_pretrained(OUT, trust_remote_code=True).
    """
    from pathlib import Path

    from dflash.errors import DflashError
    from dflash.train.checkpoint import Checkpointer

    cfg = given(ExportConfig, options)
    if not Path(cfg.run).is_dir():  # a mistyped name: "no complete checkpoint" would send one looking for those
        what = "is a file, not a folder" if Path(cfg.run).exists() else "does not exist"
        raise DflashError(f"the run folder {cfg.run} {what}; give dflash export the --out folder of a dflash train run")
    path = Checkpointer(cfg.run).export(
        cfg.out,
        step=cfg.step,
        dtype=cfg.dtype,
        force=cfg.force,
        with_target_embeddings=cfg.with_target_embeddings,
        target=cfg.target,
    )
    click.echo(f"drafter written to {path}")
