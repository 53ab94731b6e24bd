"""`dflash harvest` and `dflash inspect`: thin click commands over dflash.harvest and dflash.store.

torch, transformers and zarr are imported inside the commands so that `dflash --help` stays fast.
"""

import logging

import click

from cli.options import config_option, config_options, reports_errors
from dflash.config import DRAFTER_METHODS, HarvestConfig, TrainConfig, given


@click.command()
@config_option
@config_options(HarvestConfig)
@reports_errors
def harvest(**options):
    """Harvest target hidden states into a store.

    Runs the frozen target once over the data (docs/data.md: files, folders, mixtures) and writes the tapped
    layers' outputs, packed into rows of --token-budget tokens, to a Zarr v3 store at --out. Rerunning the same
    command resumes a stopped harvest.
    """
    from dflash.harvest import run_harvest

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run_harvest(given(HarvestConfig, options))


@click.command()
@config_option
@config_options(
    HarvestConfig,
    skip=(
        "rank",
        "device",
        "dtype",
        "allow_slow_kernels",
        "experts",
        "calibration_tokens",
        "projection_from",
        "self_check",
        "repair",
        "scale_groups",
        "forward_tokens",
    ),
)
@click.option(
    "--sample",
    type=int,
    help="Tokenize only this many records (a seeded random sample) and scale up, with the sampling error.  [default: every record]",
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
@click.option(
    "--block-size",
    type=int,
    help="Drafter block size to estimate (dflash train --block-size).  [default: 16; 7 for dspark]",
)
@click.option(
    "--method",
    type=click.Choice(list(DRAFTER_METHODS)),
    help=f"Drafter method to estimate (dflash train --method).  [default: {TrainConfig.method}]",
)
@click.option(
    "--anchors",
    type=int,
    help="Anchors per row to estimate (dflash train --anchors).  [default: 512 per 3072 tokens of the token budget]",
)
@reports_errors
def plan(sample, epochs, draft_layers, block_size, method, anchors, **options):
    """Estimate a harvest and a training run before running the target.

    Tokenizes the data (or --sample lines of it) and packs it at the token budget: documents, tokens, rows,
    padding; prints the store's size in every store mode, the harvest and train GPU-hours scaled from the H200
    benchmarks, and whether the store fits in the free space at --out.
    """
    from dflash.plan import check_plan_options, plan_report

    check_plan_options(sample)
    cfg = given(HarvestConfig, options)
    # The run it prices: train's options (validated as train validates them) on the store the harvest writes.
    train = TrainConfig(
        store=cfg.out,
        out="",
        epochs=epochs,
        draft_layers=draft_layers,
        block_size=block_size,
        method=method or TrainConfig.method,
        anchors=anchors,
    )
    click.echo(plan_report(cfg, sample, train))


@click.command()
@config_option
@click.argument("store_path", metavar="STORE", type=click.Path())
@click.option(
    "--verify", is_flag=True, help="Read every chunk and check its CRC32C checksum and its place (the part's digests)."
)
@click.option(
    "--reforward",
    type=click.IntRange(min=0),
    default=0,
    help="Load the target and re-run this many stored documents (drawn at random), each alone, comparing every "
    "stored feature with the fresh forward.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the --reforward draw.")
@click.option("--model", "model", help="Target folder for --reforward.  [default: the one the store records]")
@click.option("--device", help="Torch device for --reforward.  [default: cuda when available, else cpu]")
@reports_errors
def inspect(store_path, verify, reforward, seed, model, device):
    """Summarise a store (--verify: check chunks; --reforward N: check features against the target).

    Prints the manifest, counts, padding and bytes per token; --verify reads every chunk and checks its
    checksum and that it is the chunk written at its place, exiting with status 1 if any is damaged or misplaced;
    --reforward N re-runs N stored documents through the target and exits with status 1 if any stored feature
    differs by more than the store's encoding error.
    """
    from pathlib import Path

    from dflash import store

    path = Path(store_path)
    header = store.read_manifest(path / store.HARVEST_FILE) if path.is_dir() else None
    if header is not None and not (path / store.MANIFEST_FILE).exists():
        click.echo(_describe(path, header))
    opened = store.Store.open(path)  # raises for an incomplete or foreign store
    click.echo(_describe(path, opened.manifest))
    failed = False
    if verify:
        failed = _verify(opened)
    if reforward:
        from dflash.selfcheck import NO_LAYER_MATCHES, describe_failure, no_layer_matches, run_reforward

        check = run_reforward(path, reforward, seed, device, model)
        click.echo(f"reforward  {check.describe()}")
        for failure in check.failures:
            click.echo(f"  {describe_failure(failure)}")
        if no_layer_matches(check):
            click.echo(f"  {NO_LAYER_MATCHES}")
        failed = failed or not check.passed
    if failed:
        raise SystemExit(1)


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
        f"{on_disk / max(1, raw):.3f} of raw bf16 features ({manifest.feature_dim * 2} bytes per token)"
        + (f", the teacher's {manifest.teacher.name} included" if manifest.teacher else ""),
        "self-check " + (manifest.self_check.describe() if manifest.self_check else "not run (inspect --reforward N)"),
    ]
    return "\n".join(lines)


def _verify(opened) -> bool:
    from tqdm import tqdm

    from dflash.store import verify

    total = sum(array.nbytes for part in opened.parts for array in part.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", mininterval=1.0) as bar:
        problems = verify.check_chunks(opened, progress=bar.update)
    if problems:
        click.echo(f"verify     {len(problems)} damaged chunks:")
        for problem in problems:
            click.echo(f"  {problem}")
        ranks = sorted({int(problem.split("part rank", 1)[1][:5]) for problem in problems})
        click.echo(
            f"repair     rerun the harvest command with --repair for rank(s) {', '.join(map(str, ranks))}: it "
            "re-harvests exactly the damaged rows"
        )
        return True
    if not opened.digested:  # older stores record no digests
        click.echo(
            "verify     every chunk present and its checksum correct; format version "
            f"{opened.manifest.format_version} records no digests: a chunk in another's place goes unnoticed"
        )
        return False
    click.echo("verify     every chunk present and its checksum correct, each the one written at its place")
    return False
