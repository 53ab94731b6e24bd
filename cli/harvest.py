"""`dflash harvest` and `dflash inspect`: thin click commands over dflash.harvest and dflash.store.

torch, transformers and zarr are imported inside the commands so that `dflash --help` stays fast.
"""

import logging

import click

from cli.options import config_option, reports_errors


def _layer_list(_ctx, _param, value):
    if value is None or isinstance(value, list):
        return value
    try:
        return [int(part) for part in str(value).split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of layer indices, e.g. 1,9,17,25,33") from None


@click.command()
@config_option
@click.option("--model", required=True, help="Target checkpoint: a local transformers folder (or a hub name).")
@click.option("--data", required=True, type=click.Path(), help='JSONL file: one {"messages": [...]}, {"prompt": ..., "completion": ...} or {"text": ...} per line.')
@click.option("--out", required=True, type=click.Path(), help="Store folder to create, or to resume when it holds this harvest.")
@click.option("--layers", callback=_layer_list, help="Comma-separated target layers to tap.  [default: the DFlash rule, 5 layers from 1 to L-3]")
@click.option("--token-budget", default=12288, type=int, help="Tokens per stored row; documents are packed whole into rows.")
@click.option("--max-length", type=int, help="Documents longer than this are truncated or split.  [default: the token budget]")
@click.option("--overflow", default="truncate", type=click.Choice(["truncate", "split"]), help="What to do with documents over --max-length.")
@click.option("--forward-tokens", default=32768, type=int, help="Padded tokens per forward batch (GPU memory vs. speed).")
@click.option("--workers", default=4, type=int, help="Tokenizer processes.")
@click.option("--rank", type=int, help="This process's rank.  [default: $RANK or 0]")
@click.option("--world-size", type=int, help="Number of harvest processes.  [default: $WORLD_SIZE or 1]")
@click.option("--device", help="Torch device.  [default: cuda:$LOCAL_RANK when CUDA is available, else cpu]")
@click.option("--dtype", default="bfloat16", type=click.Choice(["bfloat16", "float16", "float32"]), help="Target compute dtype (the store always holds bf16).")
@click.option("--allow-slow-kernels", is_flag=True, help="Run a hybrid target on PyTorch reference kernels on GPU instead of refusing.")
@reports_errors
def harvest(**options):
    """Harvest target hidden states into a store.

    Runs the frozen target once over the JSONL data and writes the tapped layers' outputs, packed into rows of
    --token-budget tokens, to a Zarr v3 store at --out. Rerunning the same command resumes a stopped harvest.
    """
    from dflash.harvest import HarvestConfig, run_harvest

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run_harvest(HarvestConfig(**options))


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
    header = store.read_json(path / store.HARVEST_FILE)
    if header is not None and not (path / store.MANIFEST_FILE).exists():
        click.echo(_describe(path, header))
    shards = store.ShardStore.open(path)  # raises for an incomplete or foreign store
    click.echo(_describe(path, shards.manifest))
    if verify:
        _verify(shards)


def _describe(path, manifest: dict) -> str:
    from dflash import store

    target, tokenizer = manifest["target"], manifest["tokenizer"]
    lines = [
        f"store      {path} (format {manifest['format_version']}, dflash {manifest['dflash_version']})",
        f"target     {target['name']} ({target['model_type']}), {target['num_layers']} layers, hidden "
        f"{target['hidden_size']}, vocab {target['vocab_size']}, config sha256 {target['config_hash'][:12]}",
        f"features   layers {manifest['layer_ids']} -> {manifest['feature_dim']} features, {manifest['dtype']} "
        f"(stored as uint16 bits)",
        f"tokenizer  {tokenizer['name']}, vocab {tokenizer['vocab_size']}, special ids {tokenizer['special_ids']}",
        f"rows       {manifest['token_budget']} tokens each; codec {manifest['codecs']['hidden'][0]['name']} "
        f"{manifest['codecs']['hidden'][0].get('configuration', {})} + crc32c",
    ]
    if "counts" not in manifest:
        world_size = manifest["fingerprint"]["world_size"]
        for rank, progress in enumerate(store.part_progress(path, world_size)):
            done = "not started" if progress is None else f"{progress['rows_committed']} of {progress['rows']} rows"
            lines.append(f"part {rank:<5} {done}")
        return "\n".join(lines)
    counts = manifest["counts"]
    slots = counts["rows"] * manifest["token_budget"]
    on_disk = store.disk_bytes(path)
    raw = counts["tokens"] * manifest["feature_dim"] * 2
    lines += [
        f"documents  {counts['documents']} in {counts['rows']} rows over {len(manifest['parts'])} parts; data "
        f"{manifest['data']['stats']}",
        f"tokens     {counts['tokens']} ({counts['loss_tokens']} with loss), padding {counts['padding_tokens']} "
        f"({counts['padding_tokens'] / max(1, slots):.1%} of row slots)",
        f"disk       {on_disk / 1e9:.3f} GB: {on_disk / max(1, counts['tokens']):.0f} bytes per token "
        f"(bf16 features alone: {manifest['feature_dim'] * 2}; {raw / max(1, on_disk):.2f}x vs. raw bf16)",
    ]
    return "\n".join(lines)


def _verify(shards) -> None:
    from tqdm import tqdm

    from dflash import store

    total = sum(array.nbytes for part in shards.parts for array in part.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", mininterval=1.0) as bar:
        problems = store.verify(shards, progress=bar.update)
    if problems:
        click.echo(f"verify     {len(problems)} damaged chunks:")
        for problem in problems:
            click.echo(f"  {problem}")
        raise SystemExit(1)
    click.echo("verify     every chunk present and its checksum correct")
