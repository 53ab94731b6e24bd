"""Options shared by every command: `--config file.toml` (flags override its values) and error reporting."""

import functools
import tomllib
from pathlib import Path

import click

from dflash.errors import DflashError


def _load_config(ctx: click.Context, _param, path: str | None):
    """Turn a TOML file into the command's defaults, so that flags given on the command line win.

    The file may hold the command's keys at top level or under a table named after the command
    (`[harvest]`, `[train]`); keys use the option names with `-` or `_`.
    """
    if path is None:
        return None
    try:
        table = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise click.BadParameter(f"cannot read config {path}: {exc}") from exc
    table = table.get(ctx.info_name, table)
    known = {p.name for p in ctx.command.params}
    values = {key.replace("-", "_"): value for key, value in table.items() if not isinstance(value, dict)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise click.BadParameter(f"unknown keys in {path}: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return path


config_option = click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False),
    callback=_load_config,
    is_eager=True,
    expose_value=False,
    help="TOML file of option values; flags given on the command line override it.",
)


def reports_errors(command):
    """Print a DflashError as one clear line and exit with status 2 instead of a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except DflashError as exc:
            click.echo(f"error: {exc}", err=True)
            raise SystemExit(2) from None

    return wrapper
