"""`dflash train` and `dflash export`: thin click commands over dflash.train.

torch is imported inside the commands so that `dflash --help` stays fast.
"""

import logging

import click

from cli.options import config_option, reports_errors


def _key_values(_ctx, _param, values):
    """`--drafter-option intermediate_size=9216` (repeatable) -> {"intermediate_size": 9216}."""
    if isinstance(values, dict):  # from a --config file
        return values
    out = {}
    for item in values or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE, e.g. intermediate_size=9216")
        out[key.strip()] = _number(raw.strip())
    return out


def _number(raw: str):
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


@click.command()
@config_option
@click.option("--shards", required=True, type=click.Path(), help="The harvest store to train from.")
@click.option("--out", required=True, type=click.Path(), help="Run folder: checkpoints, metrics.jsonl, tb/, drafter/.")
@click.option("--target", type=click.Path(), help="Checkpoint to read the embedding / LM head from.  [default: the store's target]")
@click.option("--draft-layers", default=5, type=int, help="Drafter layers.")
@click.option("--block-size", default=16, type=int, help="Tokens per block (1 known + B-1 drafted).")
@click.option("--drafter-option", "drafter_overrides", multiple=True, callback=_key_values, help="Override a drafter config field, KEY=VALUE (repeatable).")
@click.option("--anchors", type=int, help="Anchors per row.  [default: 512 per 3072 tokens of the store's token budget]")
@click.option("--gamma", type=float, help="Loss decay exp(-(k-1)/gamma).  [default: 7 for B=16, 5 for 10, 4 for 8]")
@click.option("--rows-per-step", default=1, type=int, help="Rows per micro-step on each rank.")
@click.option("--grad-accum", default=1, type=int, help="Micro-steps per optimizer step.")
@click.option("--loss-chunk", default=None, type=int, help="Drafted tokens per LM-head chunk in the loss; default: the most that keep a chunk of logits under 2^29 (2048 rows for a 152 K-248 K vocabulary).")
@click.option("--lr", default=6e-4, type=float, help="Peak learning rate.")
@click.option("--min-lr-ratio", default=0.0, type=float, help="Final learning rate as a fraction of the peak.")
@click.option("--warmup-ratio", default=0.04, type=float, help="Fraction of the steps with linear warmup.")
@click.option("--weight-decay", default=0.0, type=float, help="AdamW weight decay (matrices only).")
@click.option("--betas", default=(0.9, 0.999), type=(float, float), help="AdamW betas.")
@click.option("--clip", default=1.0, type=float, help="Gradient norm clip.")
@click.option("--epochs", default=6, type=int, help="Passes over the training rows.")
@click.option("--max-steps", type=int, help="Stop after this many optimizer steps (overrides --epochs).")
@click.option("--seed", default=0, type=int, help="Seed of the weights, the row order and the anchors.")
@click.option("--val-fraction", default=0.01, type=float, help="Fraction of the store's rows held out for validation (not with --val-shards).")
@click.option("--val-shards", type=click.Path(), help="A held-out store of other documents (same target, layers and token budget) to validate on, instead of --val-fraction of the training store's rows.")
@click.option("--val-every", default=0, type=int, help="Validate every N steps (0: only at the end).")
@click.option("--log-every", default=10, type=int, help="Steps between metric records.")
@click.option("--ckpt-every", default=1000, type=int, help="Steps between checkpoints (one is always written at the end).")
@click.option("--resume", is_flag=True, help="Continue from the latest complete checkpoint in --out.")
@click.option("--export/--no-export", default=True, help="Export the drafter to OUT/drafter at the end.")
@click.option("--export-dtype", default="bfloat16", type=click.Choice(["bfloat16", "float32"]), help="Dtype of the exported weights.")
@click.option("--prefetch", default=2, type=int, help="Steps of rows read ahead.")
@click.option("--reader-workers", default=4, type=int, help="Threads reading rows from the store.")
@click.option("--device", help="Torch device.  [default: cuda:$LOCAL_RANK when CUDA is available, else cpu]")
@click.option("--compile/--no-compile", default=None, help="torch.compile the step.  [default: on for CUDA, off on the CPU]")
@click.option("--cuda-graph/--no-cuda-graph", default=True, help="Capture the whole step in a CUDA graph (CUDA only).")
@click.option("--peak-tflops", default=792.0, type=float, help="Dense bf16 TFLOP/s of one device, the MFU denominator.")
@click.option("--tensorboard/--no-tensorboard", default=True, help="Write TensorBoard scalars to OUT/tb.")
@reports_errors
def train(**options):
    """Train a DFlash drafter from a harvest store.

    Run with torchrun for several GPUs (one process per GPU); on one GPU or the CPU, run it directly. Writes
    metrics to OUT/metrics.jsonl and OUT/tb, checkpoints to OUT/checkpoints/step_N, and exports the drafter
    to OUT/drafter at the end.
    """
    from dflash.train import TrainConfig, run_training

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    options["betas"] = tuple(options["betas"])
    result = run_training(TrainConfig(**options))
    if "export" in result:
        click.echo(f"drafter written to {result['export']}")


@click.command()
@click.argument("run", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="Folder to write config.json + model.safetensors to.")
@click.option("--step", type=int, help="Checkpoint step to export.  [default: the latest complete one]")
@click.option("--dtype", default="bfloat16", type=click.Choice(["bfloat16", "float32"]), help="Dtype of the exported weights.")
@reports_errors
def export(run, out, step, dtype):
    """Export the drafter of a training RUN in the public DFlash checkpoint layout."""
    from dflash.train import export_run

    click.echo(f"drafter written to {export_run(run, out, step=step, dtype=dtype)}")
