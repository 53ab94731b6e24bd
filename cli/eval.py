"""`dflash regenerate` (target responses to train on) and `dflash eval` (acceptance length and speedup)."""

import json
import logging
from dataclasses import asdict
from pathlib import Path

import click

from cli.options import config_option, reports_errors

DEVICE_HELP = "torch device; auto = cuda if available, else cpu."
DTYPE_HELP = "model dtype: auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16, float16."


@click.command("regenerate")
@config_option
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False), help="Target model folder.")
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False), help="Prompts JSONL: chat 'messages', 'text' or 'prompt'.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Responses JSONL; an existing one is resumed.")
@click.option("--batch-size", default=8, type=click.IntRange(min=1), help="Prompts per generate call (left-padded).")
@click.option("--max-new-tokens", default=512, type=click.IntRange(min=1), help="Longest response, in tokens.")
@click.option("--temperature", default=0.0, type=click.FloatRange(min=0), help="0 = greedy; > 0 samples.")
@click.option("--top-p", default=1.0, type=click.FloatRange(0, 1, min_open=True), help="Nucleus sampling (with --temperature > 0).")
@click.option("--top-k", default=0, type=click.IntRange(min=0), help="Top-k sampling; 0 = off (overrides the model's default).")
@click.option("--seed", default=0, help="Sampling seed.")
@click.option("--device", default="auto", help=DEVICE_HELP)
@click.option("--dtype", default="auto", help=DTYPE_HELP)
@reports_errors
def regenerate_command(model, data, out, batch_size, max_new_tokens, temperature, top_p, top_k, seed, device, dtype):
    """Answer every prompt with the target itself, writing chat JSONL that `dflash harvest` reads."""
    from dflash.regenerate import Sampling, regenerate

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the target's kernels

    sampling = Sampling(max_new_tokens, temperature, top_p, top_k, seed)
    stats = regenerate(model, data, out, sampling, batch_size, device, dtype)
    click.echo(f"{out}: {stats.written} responses written, {stats.already_done} already there, {stats.prompts} prompts")


@click.command("eval")
@config_option
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False), help="Target model folder.")
@click.option("--drafter", type=click.Path(exists=True, file_okay=False), help="Exported drafter folder.")
@click.option("--untrained", is_flag=True, help="Use a randomly initialised drafter shaped from the target (baseline).")
@click.option("--block-size", default=16, type=click.IntRange(min=2), help="Block size of the --untrained drafter.")
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False), help="Prompts JSONL: chat 'messages', 'text' or 'prompt'.")
@click.option("--num-prompts", type=click.IntRange(min=1), help="Only the first N prompts.")
@click.option("--max-new-tokens", default=256, type=click.IntRange(min=1), help="Tokens generated per prompt.")
@click.option("--temperature", default=0.0, type=click.FloatRange(min=0), help="0 = greedy (checked against plain decoding).")
@click.option("--prompt-lookup", default=10, type=click.IntRange(min=0), help="Prompt-lookup draft length to compare with; 0 = skip.")
@click.option("--seed", default=0, help="Seed for sampling and for the --untrained drafter.")
@click.option("--device", default="auto", help=DEVICE_HELP)
@click.option("--dtype", default="auto", help=DTYPE_HELP)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the full report (per prompt) as JSON here, updated after every prompt.")
@click.option("--resume", is_flag=True, help="Go on from the partial report at --json: its prompts are not run again.")
@reports_errors
def eval_command(model, drafter, untrained, block_size, data, num_prompts, max_new_tokens, temperature, prompt_lookup, seed, device, dtype, json_path, resume):
    """Speculative decoding with the drafter: acceptance length tau, histogram, tokens/s and speedup."""
    from dflash.errors import DflashError
    from dflash.regenerate import load_prompts
    from dflash.speculative import evaluate
    from dflash.store import write_json_atomic

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the target's kernels
    if drafter and untrained:
        raise DflashError("give either --drafter or --untrained, not both")
    if not drafter and not untrained and not prompt_lookup:
        raise DflashError("nothing to evaluate: give --drafter, --untrained or --prompt-lookup N")
    if resume and not json_path:
        raise DflashError("--resume goes on from the report at --json: give --json REPORT")
    if json_path and not resume and Path(json_path).exists():
        raise DflashError(f"{json_path} exists: pass --resume to go on from that report, or give another --json "
                          "(or remove it) to start a new one")  # fmt: skip
    earlier = read_report(Path(json_path)) if resume and Path(json_path).exists() else None
    prompts = load_prompts(data)[:num_prompts]
    report = evaluate(
        model,
        "untrained" if untrained else drafter,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        device=device,
        dtype=dtype,
        prompt_lookup_tokens=prompt_lookup,
        block_size=block_size,
        seed=seed,
        progress=True,
        on_prompt=(lambda partial: write_json_atomic(Path(json_path), asdict(partial))) if json_path else None,
        resume=earlier,
    )
    click.echo(report.prompt_table() + "\n")
    click.echo(report.table())
    if json_path:
        write_json_atomic(Path(json_path), asdict(report))
        click.echo(f"report written to {json_path}")


def read_report(path: Path) -> dict:
    """The JSON object at `path`; `evaluate` checks that it is a report of this evaluation."""
    from dflash.errors import DflashError

    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        report = error
    if not isinstance(report, dict):
        raise DflashError(f"{path} is not a dflash eval report ({report if isinstance(report, Exception) else 'not a JSON object'}); "
                          "give another --json or leave out --resume")  # fmt: skip
    return report
