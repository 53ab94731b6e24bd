"""The `dflash` command line: thin click commands over the `dflash` library."""

import logging
import os
import sys

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


def entry() -> None:
    """`dflash` and `python -m cli`: `main`, then, in a process of a torchrun launch, an exit that skips the
    interpreter's finalisation. There, torch.distributed's gloo threads can still hold work whose tensors reach
    Python objects; destroying them while the interpreter is torn down aborts the process after it succeeded
    ("terminate called without an active exception", pytorch/pytorch#179291). The command's own cleanup (the
    groups destroyed, the outputs closed) has run by then; stdout, stderr and the log handlers are flushed first."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        raise SystemExit(code)
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
