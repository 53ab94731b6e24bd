"""Options shared by every command: `--config file.toml` (flags override its values) and error reporting."""

import dataclasses
import functools
import tomllib
import types
import typing
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
    # Keys are the flags' names (`shards`, `val-shards`) or the parameters' own (`store`).
    names = {opt.lstrip("-").replace("-", "_"): p.name for p in ctx.command.params for opt in p.opts}
    names.update({p.name: p.name for p in ctx.command.params})
    known = set(names)
    values = {key.replace("-", "_"): value for key, value in table.items() if not isinstance(value, dict)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise click.BadParameter(f"unknown keys in {path}: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    ctx.default_map = {**(ctx.default_map or {}), **{names[key]: value for key, value in values.items()}}
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


def _key_values(_ctx, _param, values):
    """`--drafter-option intermediate_size=9216` (repeatable) -> {"intermediate_size": 9216}."""
    if values is None or isinstance(values, dict):  # not given, or from a --config file
        return values or None
    out = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE, e.g. intermediate_size=9216")
        out[key.strip()] = _number(raw.strip())
    return out or None


def _number(raw: str):
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def _int_list(_ctx, _param, value):
    """`1,9,17` (or a TOML list) -> [1, 9, 17]."""
    if value is None or isinstance(value, list):
        return value
    try:
        return [int(part) for part in str(value).split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers, e.g. 1,9,17,25,33") from None


def _base_type(annotation):
    """`int | None` -> int; other annotations unchanged."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def _option_for(f: dataclasses.Field, annotation):
    """The click.option decorator of one config field."""
    meta = f.metadata
    name = meta.get("flag", "--" + f.name.replace("_", "-"))
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    default = None if required else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
    shown = meta.get("default_doc", default)
    help_text = meta["help"] + ("" if required or shown in (None, {}) else f"  [default: {shown}]")
    kind = _base_type(annotation)
    kwargs: dict = {"help": help_text, "required": required, "default": None, "show_default": False}
    if kind is bool:
        decls = [f"{name}/--no-{name[2:]}"]
    else:
        decls = [name]
        if "choices" in meta:
            kwargs["type"] = click.Choice(meta["choices"])
        elif typing.get_origin(kind) is list:
            kwargs["callback"] = _int_list
        elif typing.get_origin(kind) is tuple:
            kwargs["type"] = typing.get_args(kind)
        elif kind is dict or typing.get_origin(kind) is dict:
            kwargs.update(multiple=True, callback=_key_values)
        elif meta.get("path"):
            kwargs["type"] = click.Path()
        else:
            kwargs["type"] = kind
    if name[2:].replace("-", "_") != f.name:
        decls.append(f.name)
    return click.option(*decls, **kwargs)


def config_options(cls, skip: tuple[str, ...] = ()):
    """Decorate a click command with one option per field of the config dataclass `cls` (its single source).

    Every option defaults to None; build the config with `dflash.config.given(cls, options)` so that the
    dataclass fills in what the user did not give.
    """
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.name not in skip and not f.metadata.get("hidden")]

    def decorate(command):
        for f in reversed(fields):
            command = _option_for(f, hints[f.name])(command)
        return command

    return decorate
