"""Options shared by every command: `--config file.toml` (flags override its values) and error reporting."""

import dataclasses
import functools
import tomllib
import types
import typing
from pathlib import Path

import click

from dflash.errors import DflashError

_FILE_DICTS = "dflash.config_dicts"  # ctx.meta key: dict options' values from --config, merged by _key_values


def _command_names(ctx: click.Context) -> set[str]:
    """Every dflash command's name (a --config file may hold tables for several commands)."""
    return set(_commands(ctx)) | {ctx.info_name}


def _commands(ctx: click.Context) -> dict[str, click.Command]:
    root = ctx.find_root().command
    return dict(root.commands) if isinstance(root, click.Group) else {}


def _key_names(command: click.Command) -> dict[str, str]:
    """A command's --config keys (its flags' names and its parameters' own, `-` as `_`) -> parameter names."""
    params = [p for p in command.params if p.name != "config"]
    names = {opt.lstrip("-").replace("-", "_"): p.name for p in params for opt in p.opts}
    names.update({p.name: p.name for p in params})
    return names


def _load_config(ctx: click.Context, _param, path: str | None):
    """Turn a TOML file into the command's defaults, so that flags given on the command line win.

    The file holds the command's keys at top level and / or under a table named after the command (`[harvest]`,
    `[train]`; the table's value wins); keys use the option names with `-` or `_`. Tables named after other dflash
    commands, and top-level keys that only other dflash commands take (`token-budget` for `train`), are skipped, so
    one file may serve the whole chain. Every other key must be an option of this command with a value of its
    type: anything else is an error naming the key, never silently dropped.
    """
    if path is None:
        return None
    try:
        document = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise click.BadParameter(f"cannot read config {path}: {exc}") from exc
    # Keys are the flags' names (`shards`, `val-shards`) or the parameters' own (`store`).
    params = {p.name: p for p in ctx.command.params if p.name != "config"}
    names = _key_names(ctx.command)
    others = {key for command in _commands(ctx).values() for key in _key_names(command)} - set(names)
    commands = _command_names(ctx)
    own = ctx.info_name
    entries = []  # (key as written, where, value); the command's table after the top level, so that it wins
    tables = []
    for key, value in document.items():
        if isinstance(value, dict) and key in commands:
            if key == own:
                tables = [(k, f"[{own}] {k}", v) for k, v in value.items()]
        elif key.replace("-", "_") in others:
            continue  # a key only other commands take serves those
        elif _serves_a_list_option(ctx, key.replace("-", "_"), value):
            continue  # harvest's `data = [...]` (docs/data.md): eval's single --data comes from its table or flag
        elif isinstance(value, dict) and key.replace("-", "_") not in names:
            raise click.BadParameter(
                f"{path}: [{key}] is neither a dflash command's table ({', '.join(sorted(commands))}) nor an "
                f"option of dflash {own}; fix the table's name"
            )
        else:
            entries.append((key, key, value))
    unknown = sorted(where for key, where, _ in entries + tables if key.replace("-", "_") not in names)
    if unknown:
        known = sorted(k.replace("_", "-") for k in names)
        raise click.BadParameter(
            f"unknown keys in {path} for dflash {own}: {', '.join(unknown)} (known: {', '.join(known)}); "
            "keys meant for another command go under its table, e.g. [harvest]"
        )
    defaults, dicts = {}, {}
    for key, where, value in entries + tables:
        param = params[names[key.replace("-", "_")]]
        value = _checked(param, value, f"{path}: {where}")
        if isinstance(value, dict):
            dicts[param.name] = {**dicts.get(param.name, {}), **value}  # the table's keys win
        else:
            defaults[param.name] = value
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    ctx.meta[_FILE_DICTS] = dicts
    return path


def _param(command: click.Command, key: str) -> click.Parameter | None:
    """The parameter of `command` that the --config key `key` (`-` as `_`) sets, if any."""
    name = _key_names(command).get(key)
    return next((p for p in command.params if p.name == name), None) if name else None


def _serves_a_list_option(ctx: click.Context, key: str, value) -> bool:
    """Whether a top-level list for a key this command takes once is the value of another command's repeatable
    option of that key: one file then serves the chain (harvest's mixture, eval's own prompts in [eval])."""
    own = _param(ctx.command, key)
    if not isinstance(value, list) or own is None or getattr(own, "multiple", False):
        return False
    for command in _commands(ctx).values():
        other = _param(command, key)
        if other is not None and getattr(other, "multiple", False) and other.callback is None:
            try:
                _checked(other, value, "")
            except click.BadParameter:
                continue
            return True
    return False


def _checked(param: click.Parameter, value, where: str):
    """A --config value checked against its option's type; lists of integers as `1,3,5` for _int_list."""

    def wrong(expected: str):
        return click.BadParameter(f"{where} = {value!r} is not {expected}")

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def is_number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    kind = param.type
    if getattr(param, "multiple", False) and param.callback is None:
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return value
        raise wrong('a string or a list of strings, e.g. ["a.jsonl", "b.parquet:0.25"]')
    if param.callback is _key_values:
        if not isinstance(value, dict):
            key, example = _example(param)
            raise wrong(f"a table, e.g. {{{key} = {example}}}")
        return value
    if param.callback is _int_list:
        if isinstance(value, list) and all(is_int(v) for v in value):
            return ",".join(map(str, value))
        if isinstance(value, str):
            return value
        raise wrong("a list of integers, e.g. [1, 9, 17]")
    if isinstance(value, (dict, list)) and not isinstance(kind, click.Tuple):
        raise wrong("a single value")
    if getattr(param, "is_flag", False) or isinstance(kind, click.types.BoolParamType):
        if not isinstance(value, bool):
            raise wrong("true or false")
    elif isinstance(kind, click.Tuple):
        if not isinstance(value, list) or len(value) != len(kind.types):
            raise wrong(f"a list of {len(kind.types)} values")
        for item, item_type in zip(value, kind.types):
            if isinstance(item_type, click.types.FloatParamType) and not is_number(item):
                raise wrong(f"a list of {len(kind.types)} numbers")
            if isinstance(item_type, click.types.IntParamType) and not is_int(item):
                raise wrong(f"a list of {len(kind.types)} integers")
    elif isinstance(kind, click.Choice):
        if value not in kind.choices:
            raise wrong(f"one of {', '.join(map(str, kind.choices))}")
    elif isinstance(kind, click.types.IntParamType):
        if not is_int(value):
            raise wrong("an integer")
    elif isinstance(kind, click.types.FloatParamType):
        if not is_number(value):
            raise wrong("a number")
    elif isinstance(kind, click.Path):
        if not isinstance(value, str):
            raise wrong('a path in quotes, e.g. "runs/a"')
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # a plain string option given a number, e.g. `subspace = 256`
    elif not isinstance(value, str):
        raise wrong("a string")
    return value


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


# An example KEY=VALUE of each such option (the drafter's otherwise), for the error naming a malformed one.
_EXAMPLES = {"attention_kernel_options": ("bwd_num_warps", 8)}


def _example(param: click.Parameter) -> tuple[str, object]:
    return _EXAMPLES.get(param.name, ("intermediate_size", 9216))


def _key_values(ctx, param, values):
    """`--drafter-option intermediate_size=9216` (repeatable) -> {"intermediate_size": 9216}; the flags win over
    a `drafter-option = {...}` table of the --config file."""
    out = dict(ctx.meta.get(_FILE_DICTS, {}).get(param.name) or {})
    for item in values or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE, e.g. {'='.join(map(str, _example(param)))}")
        out[key.strip()] = _number(raw.strip())
    return out or None


def _number(raw: str):
    if raw.lower() == "none":  # an optional field switched off, e.g. sliding_window=none
        return None
    if raw.lower() in ("true", "false"):  # a switch, e.g. --attention-kernel-option USE_TMA=true
        return raw.lower() == "true"
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
    required = meta.get("required") or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    default = None if required else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
    shown = meta.get("default_doc", default)
    help_text = meta["help"] + ("" if required or shown in (None, {}) else f"  [default: {shown}]")
    kind = _base_type(annotation)
    kwargs: dict = {"help": help_text, "required": required, "show_default": False}
    if not required:  # a default of None is a value to click (8.3 on): a required option given it is never missing
        kwargs["default"] = None
    if kind is bool:
        decls = [f"{name}/--no-{name[2:]}"]
    else:
        decls = [name]
        if "choices" in meta:
            kwargs["type"] = click.Choice(meta["choices"])
        elif meta.get("multiple"):
            kwargs.update(multiple=True, type=str)
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
