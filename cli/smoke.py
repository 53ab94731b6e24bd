import click

from cli.options import config_option, reports_errors


@click.command()
@config_option
@click.option(
    "--work",
    default=".smoke",
    type=click.Path(file_okay=False),
    help="Folder for the tiny target (cached) and every stage's output.",
)
@click.option("--prompts", default=16, help="Bundled prompts the target answers (the training responses).")
@click.option("--train-steps", default=40, help="Drafter training steps.")
@reports_errors
def smoke(work, prompts, train_steps):
    """Run the whole chain on a tiny embedded target, on the CPU: regenerate, harvest, train, export, eval."""
    import logging

    from dflash.smoke import SmokeConfig, run_smoke, summary_table

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    summary = run_smoke(SmokeConfig(work=work, prompts=prompts, train_steps=train_steps))
    click.echo("\n" + summary_table(summary))
