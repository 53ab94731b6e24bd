"""The `dflash` command line: thin click commands over the `dflash` library."""

import click

from cli.eval import eval_command, regenerate_command
from cli.harvest import harvest, inspect, plan
from cli.smoke import smoke
from cli.train import export, train
from dflash import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="dflash")
def main():
    """Train DFlash speculative-decoding drafters offline: harvest target hidden states, then train."""


for command in (regenerate_command, plan, harvest, inspect, train, export, eval_command, smoke):
    main.add_command(command)
