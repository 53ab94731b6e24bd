"""`dflash train` and `dflash export`: thin click commands over dflash.train and dflash.checkpoint.

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
    to OUT/drafter at the end.
    """
    from dflash.train import run_training

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = run_training(given(TrainConfig, options))
    if "export" in result:
        click.echo(f"drafter written to {result['export']}")


@click.command()
@click.argument("run", type=click.Path())
@config_options(ExportConfig)
@reports_errors
def export(**options):
    """Export the drafter of a training RUN in the public DFlash checkpoint layout."""
    from dflash.checkpoint import Checkpointer

    cfg = given(ExportConfig, options)
    path = Checkpointer(cfg.run).export(cfg.out, step=cfg.step, dtype=cfg.dtype)
    click.echo(f"drafter written to {path}")
