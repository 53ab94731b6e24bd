"""The `dflash` command line: thin click commands over the `dflash` library."""

import click

from dflash import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="dflash")
def main():
    """Train DFlash speculative-decoding drafters offline: harvest target hidden states, then train."""


from cli.eval import eval_command, regenerate_command  # noqa: E402  (commands import the group's options)

main.add_command(regenerate_command)
main.add_command(eval_command)

from cli.harvest import harvest, inspect  # noqa: E402

main.add_command(harvest)
main.add_command(inspect)

from cli.train import export, train  # noqa: E402

main.add_command(train)
main.add_command(export)
