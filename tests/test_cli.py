"""The command line: every command listed with a description, and --config values that flags override."""

from click.testing import CliRunner

from cli.main import main

COMMANDS = ("harvest", "inspect", "train", "export", "regenerate", "eval", "smoke")


def test_help_lists_every_command_with_a_description():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.startswith("  ") and line.split()}
    for command in COMMANDS:
        assert command in lines and len(lines[command].split()) > 1, f"{command} missing or undescribed"


def test_every_option_has_help_text():
    for command in COMMANDS:
        for param in main.commands[command].params:
            if param.param_type_name == "option":
                assert param.help, f"dflash {command} {param.opts[0]} has no help text"


def _harvest(tmp_path, config_text: str, *flags: str):
    config = tmp_path / "run.toml"
    config.write_text(config_text)
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    args = [
        "harvest",
        "--config",
        str(config),
        "--model",
        str(tmp_path),
        "--data",
        str(data),
        "--out",
        str(tmp_path / "s"),
    ]
    return CliRunner().invoke(main, [*args, *flags])


def test_config_values_apply_and_flags_override_them(tmp_path):
    # A token budget too small for a block is refused before anything is loaded: the message shows which value won.
    from_file = _harvest(tmp_path, "token_budget = 8\n")
    assert from_file.exit_code == 2 and "token budget 8 " in from_file.output
    from_table = _harvest(tmp_path, "[harvest]\ntoken-budget = 9\n")
    assert from_table.exit_code == 2 and "token budget 9 " in from_table.output
    overridden = _harvest(tmp_path, "token_budget = 8\n", "--token-budget", "12")
    assert overridden.exit_code == 2 and "token budget 12 " in overridden.output
    assert not (tmp_path / "s").exists()


def test_unknown_config_keys_are_named(tmp_path):
    result = _harvest(tmp_path, "token_budgt = 8\n")
    assert result.exit_code != 0 and "token_budgt" in result.output


def test_config_keys_may_be_the_flags_names(tmp_path):
    """`shards` (the flag) and `store` (the field behind it) both set `dflash train --shards`."""
    for key in ("shards", "store"):
        config = tmp_path / f"{key}.toml"
        config.write_text(f'[train]\n{key} = "{tmp_path / "missing-store"}"\nout = "{tmp_path / "run"}"\n')
        result = CliRunner().invoke(main, ["train", "--config", str(config)])
        assert result.exit_code == 2, result.output
        assert "missing-store" in result.output and "unknown keys" not in result.output, result.output
