"""`dflash harvest` and `dflash inspect`: thin click commands over dflash.harvest and dflash.store.

torch, transformers and zarr are imported inside the commands so that `dflash --help` stays fast.
"""

import logging

import click

from cli.options import config_option, config_options, reports_errors
from dflash.config import HarvestConfig, given


@click.command()
@config_option
@config_options(HarvestConfig)
@reports_errors
def harvest(**options):
    """Harvest target hidden states into a store.

    Runs the frozen target once over the JSONL data and writes the tapped layers' outputs, packed into rows of
    --token-budget tokens, to a Zarr v3 store at --out. Rerunning the same command resumes a stopped harvest.
    """
    from dflash.harvest import run_harvest

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run_harvest(given(HarvestConfig, options))


@click.command()
@config_option
@config_options(
    HarvestConfig, skip=("rank", "device", "dtype", "allow_slow_kernels", "calibration_tokens", "projection_from")
)
@click.option(
    "--sample",
    type=int,
    help="Tokenize only this many lines (a seeded random sample) and scale up, with the sampling error.  [default: every line]",
)
@click.option(
    "--epochs", type=int, default=6, show_default=True, help="Training epochs to estimate (dflash train --epochs)."
)
@click.option(
    "--draft-layers",
    type=int,
    default=5,
    show_default=True,
    help="Drafter layers to estimate (dflash train --draft-layers).",
)
@click.option("--block-size", type=int, default=16, show_default=True, help="Drafter block size to estimate.")
@reports_errors
def plan(sample, epochs, draft_layers, block_size, **options):
    """Estimate a harvest and a training run before running the target.

    Tokenizes the data (or --sample lines of it) and packs it at the token budget: documents, tokens, rows,
    padding; prints the store's size in every store mode, the harvest and train GPU-hours scaled from the H200
    benchmarks, and whether the store fits in the free space at --out.
    """
    from dflash.plan import check_plan_options, plan_report

    check_plan_options(sample)
    click.echo(plan_report(given(HarvestConfig, options), sample, epochs, draft_layers, block_size))


@click.command()
@click.argument("store_path", metavar="STORE", type=click.Path())
@click.option("--verify", is_flag=True, help="Read every chunk and check its CRC32C checksum.")
@reports_errors
def inspect(store_path, verify):
    """Summarise a store (--verify: check chunks).

    Prints the manifest, counts, padding and bytes per token; --verify reads every chunk and checks its
    checksum, exiting with status 1 if any is damaged.
    """
    from pathlib import Path

    from dflash import store

    path = Path(store_path)
    header = store.read_manifest(path / store.HARVEST_FILE) if path.is_dir() else None
    if header is not None and not (path / store.MANIFEST_FILE).exists():
        click.echo(_describe(path, header))
    opened = store.Store.open(path)  # raises for an incomplete or foreign store
    click.echo(_describe(path, opened.manifest))
    if verify:
        _verify(opened)


def _describe(path, manifest) -> str:
    from dflash import store

    lines = [
        f"store      {path} (format {manifest.format_version}, dflash {manifest.dflash_version})",
        *manifest.describe(),
    ]
    if not manifest.complete:
        for rank, progress in enumerate(store.part_progress(path, manifest.world_size)):
            done = "not started" if progress is None else f"{progress['rows_committed']} of {progress['rows']} rows"
            lines.append(f"part {rank:<5} {done}")
        return "\n".join(lines)
    counts = manifest.counts
    slots = counts.rows * manifest.token_budget
    on_disk = store.disk_bytes(path)
    raw = counts.tokens * manifest.feature_dim * 2
    lines += [
        f"documents  {counts.documents} in {counts.rows} rows over {len(manifest.parts)} parts; data "
        f"{manifest.data.get('stats')}",
        f"tokens     {counts.tokens} ({counts.loss_tokens} with loss), padding {counts.padding_tokens} "
        f"({counts.padding_tokens / max(1, slots):.1%} of row slots)",
        f"disk       {on_disk / 1e9:.3f} GB: {on_disk / max(1, counts.tokens):.0f} bytes per token, "
        f"{on_disk / max(1, raw):.3f} of raw bf16 features ({manifest.feature_dim * 2} bytes per token)",
    ]
    return "\n".join(lines)


def _verify(opened) -> None:
    from tqdm import tqdm

    from dflash import store

    total = sum(array.nbytes for part in opened.parts for array in part.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", mininterval=1.0) as bar:
        problems = store.check_chunks(opened, progress=bar.update)
    if problems:
        click.echo(f"verify     {len(problems)} damaged chunks:")
        for problem in problems:
            click.echo(f"  {problem}")
        raise SystemExit(1)
    click.echo("verify     every chunk present and its checksum correct")
