"""The command line: every command listed with a description, and --config values that flags override."""

import pytest
from click.testing import CliRunner

from cli.main import main
from dflash.config import TrainConfig
from dflash.errors import DflashError

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


def test_every_data_option_names_every_format_the_sources_read():
    for command in COMMANDS:
        for param in main.commands[command].params:
            if param.name == "data":
                assert all(kind in param.help for kind in ("JSONL", ".gz", ".zst", "Parquet", "folder")), command


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


# ---------------------------------------------------------------------------------------------- --config strictness


def _echo_group():
    """A group shaped like `dflash`: stand-in `train`, `eval` and `regenerate` commands that print the options they
    got (none required: the tests give only the ones they look at), and the real harvest."""
    import json

    import click

    from cli.harvest import harvest
    from cli.options import config_option, config_options, reports_errors
    from dflash.config import EvalConfig, RegenerateConfig, TrainConfig

    @click.group()
    def group():
        pass

    for name, cls in (("train", TrainConfig), ("eval", EvalConfig), ("regenerate", RegenerateConfig)):

        @click.command(name)
        @config_option
        @config_options(cls)
        @reports_errors
        def echo(**options):
            click.echo(json.dumps({k: v for k, v in options.items() if v is not None}))

        for param in echo.params:
            param.required = False
        group.add_command(echo)
    group.add_command(harvest)
    return group


def _options(tmp_path, command: str, config_text: str, *flags: str):
    """The options the stand-in `command` got from `config_text` and `flags`; the failed result otherwise."""
    import json

    config = tmp_path / "c.toml"
    config.write_text(config_text)
    result = CliRunner().invoke(_echo_group(), [command, "--config", str(config), *flags])
    return json.loads(result.output) if result.exit_code == 0 else result


def _train_options(tmp_path, config_text: str, *flags: str):
    return _options(tmp_path, "train", config_text, *flags)


def test_config_top_level_and_command_table_both_apply(tmp_path):
    got = _train_options(tmp_path, 'shards = "s"\nmax-steps = 3\n[train]\nout = "r"\nmax-steps = 4\n')
    assert got == {"store": "s", "out": "r", "max_steps": 4}  # the command's table wins over the top level


def test_config_tables_of_other_commands_are_skipped_and_unknown_tables_refused(tmp_path):
    got = _train_options(tmp_path, '[train]\nshards = "s"\n[harvest]\nmodel = "m"\ntoken-budget = 8\n')
    assert got == {"store": "s"}
    result = _train_options(tmp_path, '[trian]\nshards = "s"\n')
    assert result.exit_code == 2 and "[trian] is neither a dflash command's table" in result.output, result.output
    result = _train_options(tmp_path, '[train]\nshards = "s"\nmax_stepz = 3\n')
    assert result.exit_code == 2 and "[train] max_stepz" in result.output, result.output


def test_config_top_level_keys_of_other_commands_serve_those_and_unknown_ones_are_refused(tmp_path):
    # One file for the whole chain: harvest's keys at top level, train's own under [train].
    chain = 'model = "m"\ndata = "d.jsonl"\ntoken-budget = 8\nshards = "s"\n[train]\nout = "r"\n'
    assert _train_options(tmp_path, chain) == {"store": "s", "out": "r"}
    result = _train_options(tmp_path, chain + "tokn-budget = 8\n")
    assert result.exit_code == 2 and "unknown keys" in result.output and "tokn-budget" in result.output


def test_a_top_level_data_list_serves_harvest_while_eval_and_regenerate_take_their_own(tmp_path):
    # docs/data.md's mixture at top level; eval's and regenerate's single --data in their tables or flags.
    chain = 'model = "m"\ndata = ["chat.jsonl", "code/:0.25"]\n'
    tables = '[eval]\ndata = "prompts.jsonl"\n[regenerate]\ndata = "p.jsonl"\nout = "o.jsonl"\n'
    assert _options(tmp_path, "eval", chain + tables)["data"] == "prompts.jsonl"
    assert _options(tmp_path, "regenerate", chain + tables)["data"] == "p.jsonl"
    assert _options(tmp_path, "eval", chain, "--data", "q.jsonl")["data"] == "q.jsonl"
    config = tmp_path / "chain.toml"
    config.write_text(chain)  # nothing of eval's own: click names the option
    missing = CliRunner().invoke(main, ["eval", "--config", str(config)])
    assert missing.exit_code == 2 and "Missing option '--data'" in missing.output, missing.output
    # A list no dflash command takes is still refused.
    result = _options(tmp_path, "eval", 'model = ["m", "n"]\ndata = "p.jsonl"\n')
    assert result.exit_code == 2 and "model = ['m', 'n'] is not a single value" in result.output, result.output


def test_a_required_option_missing_from_the_command_line_is_named_by_click(tmp_path):
    result = CliRunner().invoke(main, ["export", str(tmp_path / "nope_run")])
    assert result.exit_code == 2 and "Missing option '--out'" in result.output, result.output
    assert "Traceback" not in result.output


def test_export_of_a_run_folder_that_does_not_exist_says_so(tmp_path):
    run = tmp_path / "nope_run"
    result = CliRunner().invoke(main, ["export", str(run), "--out", str(tmp_path / "drafter")])
    assert result.exit_code == 2, result.output
    assert f"error: the run folder {run} does not exist; give dflash export the --out folder of a dflash train run" in (
        result.output
    )
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "drafter").exists()


def test_config_values_of_the_wrong_type_are_named(tmp_path):
    cases = {
        "max-steps = 2.7": "max-steps = 2.7 is not an integer",
        'max-steps = "3"': "max-steps = '3' is not an integer",
        "lr = true": "lr = True is not a number",
        "resume = 1": "resume = 1 is not true or false",
        'export-dtype = "int8"': "export-dtype = 'int8' is not one of bfloat16, float32",
        "out = 3": "out = 3 is not a path",
        "betas = [0.9]": "betas = [0.9] is not a list of 2 values",
        "drafter-option = 3": "drafter-option = 3 is not a table",
        "out = [1, 2]": "out = [1, 2] is not a single value",
    }
    for line, message in cases.items():
        result = _train_options(tmp_path, line + "\n")
        assert result.exit_code == 2 and message in result.output, (line, result.output)


def test_config_lists_and_tables_reach_their_options(tmp_path):
    got = _train_options(
        tmp_path,
        "lr = 1\nbetas = [0.8, 0.9]\nresume = true\n[train.drafter-option]\nintermediate_size = 9216\nrope_theta = 1e4\n",
        "--drafter-option",
        "rope_theta=5",
    )
    assert got["lr"] == 1 and got["betas"] == [0.8, 0.9] and got["resume"] is True
    assert got["drafter_overrides"] == {"intermediate_size": 9216, "rope_theta": 5}  # the flag wins
    assert _train_options(tmp_path, "drafter-option = {num_layers = 2}\n")["drafter_overrides"] == {"num_layers": 2}


def test_attention_kernel_options_and_mask_tiles_reach_the_train_config(tmp_path):
    got = _train_options(
        tmp_path,
        "mask-tile-size = 64\nattention-kernel-option = {bwd_num_warps = 4, PRESCALE_QK = true}\n",
        "--attention-kernel-option",
        "bwd_num_warps=8",
        "--attention-kernel-option",
        "USE_TMA=true",
    )
    assert got["mask_tile_size"] == 64
    assert got["attention_kernel_options"] == {"bwd_num_warps": 8, "PRESCALE_QK": True, "USE_TMA": True}
    for tile in (8, 100):  # the kernels' tiles are powers of two that must divide it
        with pytest.raises(DflashError, match=f"--mask-tile-size {tile} \\(must be a power of two, at least 16\\)"):
            TrainConfig(store="s", out="o", mask_tile_size=tile)


def test_a_key_value_flag_that_is_not_one_gives_an_example_of_its_own_kind(tmp_path):
    for flag, example in (("--attention-kernel-option", "bwd_num_warps=8"), ("--drafter-option", "intermediate_size=")):
        result = _train_options(tmp_path, "", flag, "nonsense")
        assert result.exit_code == 2 and f"'nonsense' is not KEY=VALUE, e.g. {example}" in result.output, result.output
    result = _train_options(tmp_path, "attention-kernel-option = 3\n")
    assert result.exit_code == 2 and "is not a table, e.g. {bwd_num_warps = 8}" in result.output, result.output


def test_config_list_for_a_list_flag(tmp_path):
    for value in ("[1, 3, 5]", '"1,3,5"'):
        result = _harvest(tmp_path, f"token_budget = 8\nlayers = {value}\n")
        assert result.exit_code == 2 and "token budget 8 " in result.output, result.output  # layers accepted
    result = _harvest(tmp_path, "token_budget = 8\nlayers = [1, 2.5]\n")
    assert result.exit_code == 2 and "layers = [1, 2.5] is not a list of integers" in result.output, result.output


def test_export_takes_config(tmp_path):
    config = tmp_path / "e.toml"
    config.write_text('[export]\nout = "x"\nstep = 1.5\n')
    result = CliRunner().invoke(main, ["export", str(tmp_path), "--config", str(config)])
    assert result.exit_code == 2 and "step = 1.5 is not an integer" in result.output, result.output


def test_a_model_that_is_not_a_checkpoint_folder_is_one_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    for model, expected in ((tmp_path / "missing", "does not exist"), (empty, "has no config.json")):
        args = ["harvest", "--model", str(model), "--data", str(data), "--out", str(tmp_path / "s")]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and expected in result.output, result.output
        assert "Traceback" not in result.output and not (tmp_path / "s").exists()


def test_inspect_takes_a_config_file(tmp_path):
    config = tmp_path / "inspect.toml"
    config.write_text("[inspect]\nverify = true\nseed = 3\n")
    result = CliRunner().invoke(main, ["inspect", "--config", str(config), str(tmp_path / "no-store")])
    assert result.exit_code == 2 and "not a folder" in result.output and "unknown" not in result.output, result.output
    config.write_text("[inspect]\nverfy = true\n")
    result = CliRunner().invoke(main, ["inspect", "--config", str(config), str(tmp_path / "no-store")])
    assert result.exit_code != 0 and "verfy" in result.output, result.output


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_the_entry_point_exits_with_the_commands_status_inside_a_launch_too(tmp_path, world_size):
    """Inside a torchrun launch (WORLD_SIZE > 1) `python -m cli` ends by os._exit: the status and the output are
    still the command's, for a success and for a refused input alike."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dflash import __version__

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "WORLD_SIZE": world_size, "PYTHONPATH": str(root)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cli", *args], env=env, cwd=root, capture_output=True, text=True)

    version = run("--version")
    assert version.returncode == 0 and __version__ in version.stdout
    refused = run("inspect", str(tmp_path / "missing"))
    assert refused.returncode == 2 and "error:" in refused.stderr
    unknown = run("no-such-command")
    assert unknown.returncode == 2 and "no-such-command" in unknown.stderr
