"""The quality run's sizes, budgets and worker counts (`Scale`): the GPU run's, the CPU check's, and `--set`."""

import argparse
import dataclasses
import logging
from dataclasses import dataclass

logger = logging.getLogger("quality")


@dataclass(frozen=True)
class Scale:
    name: str
    # data: the stdlib's Python files as they are ("code"), or only their prose ("prose": docstrings and the
    # documentation strings of pydoc_data, English text whose next token is far less certain than code's)
    fixture: str = "code"
    heldout_percent: int = 10
    # Files for the regeneration prompts: unseen by the target, like the eval's, so that the drafter learns how the
    # target continues code it has not memorised (answers to its own training files are recitation).
    drafter_percent: int = 20
    max_file_bytes: int = 400_000
    corpus_chars: int | None = None  # cap on the train text used to train the target (None: all of it)
    tokenizer_chars: int = 8_000_000  # train text the BPE trainer sees
    vocab_size: int = 8192
    # target (Qwen3.5 hybrid: full attention every 4th layer)
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 1408
    linear_value_heads: int = 8
    linear_key_heads: int = 4
    linear_head_dim: int = 64
    seq_len: int = 512  # an eval sequence is a ~120-token prompt + 256 new tokens
    batch: int = 64
    lr: float = 2e-3
    target_seconds: float = 100.0  # steady training time (after the first, autotuning steps)
    # prompts and responses
    prompt_chars: int = 400  # a prompt is whole lines of code, at least this many characters
    train_prompts: int = 24576  # as many as regen_seconds allow: 512 take 4-6 s once fla's kernels are compiled
    new_tokens: int = 256  # response length of regenerate and of the eval
    regen_batch: int = 512
    regen_workers_per_gpu: int = 1  # batches of 512 keep a GPU busy
    regen_seconds: float = 240.0  # with the harvest of twice the answers (about 150 s), call 1 stays near 520 s
    # harvest and drafter
    token_budget: int = 4096
    rows_per_step: int = 2
    drafter_epochs: int = 30
    drafter_max_steps: int = 8000
    harvest_workers: int = 4
    drafter_seconds: float = 240.0  # only printed: compile + capture + steps (no hard stop inside the trainer)
    # store modes (--modes): this many modes harvested at a time, one worker process each, sharing the GPUs (mode
    # i on GPU i % GPUs); then this many drafters trained at a time (one alone: its step time and data wait are
    # its own, not those of a GPU and CPU shared with other drafters)
    mode_workers: int = 3
    mode_train_workers: int = 1
    # eval
    eval_prompts: int = 64
    # The drafter's held-out curve: answers to windows of the eval's files (unseen by target and drafter).
    # Held-out rows of its own store would continue prompts cut from its training files.
    val_prompts: int = 256
    min_eval_prompts: int = 6
    baseline_prompts: int = 6  # the untrained drafter's prompts: the first of the eval's
    eval_seconds: float = 360.0
    # One prompt at a time is bound by the host (about 100 tokens/s, a few ms of launches per token): two eval
    # processes share a GPU. Tokens/s are then those of a shared GPU; tau and the greedy check do not change.
    eval_workers_per_gpu: int = 2
    prompt_lookup_tokens: int = 10
    # whole run: the eval budget shrinks to what is left of this (a call is cut at 600 s)
    total_seconds: float = 530.0


FIXTURES = ("code", "prose")
GPU = Scale("gpu")
TINY = Scale(
    "tiny",
    corpus_chars=3_000_000,
    tokenizer_chars=1_500_000,
    vocab_size=1024,
    hidden=64,
    layers=8,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    linear_value_heads=4,
    linear_key_heads=2,
    linear_head_dim=16,
    seq_len=256,
    batch=8,
    lr=3e-3,
    target_seconds=45.0,
    prompt_chars=200,
    train_prompts=256,
    new_tokens=48,
    regen_batch=64,
    regen_seconds=30.0,
    token_budget=512,
    rows_per_step=1,
    drafter_epochs=8,
    drafter_max_steps=300,
    harvest_workers=1,
    drafter_seconds=100.0,
    mode_workers=1,
    eval_prompts=12,
    val_prompts=32,
    min_eval_prompts=4,
    baseline_prompts=4,
    eval_seconds=25.0,
    total_seconds=270.0,
)


def scale_with_overrides(scale: Scale, assignments: list[str], parser: argparse.ArgumentParser) -> Scale:
    """`FIELD=VALUE` strings applied to a Scale, each value parsed as the field's type."""
    types = {f.name: type(getattr(scale, f.name)) for f in dataclasses.fields(scale) if f.name != "name"}
    changes = {}
    for assignment in assignments:
        field, _, value = assignment.partition("=")
        if field not in types or not value:
            parser.error(f"--set {assignment}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(types))}")
        kind = int if types[field] is type(None) else types[field]  # (corpus_chars, a count, defaults to None)
        try:
            changes[field] = kind(value)
        except ValueError:
            parser.error(f"--set {assignment}: {field} takes a {kind.__name__}")
    if changes.get("fixture", scale.fixture) not in FIXTURES:
        parser.error(f"--set fixture={changes['fixture']}: one of {', '.join(FIXTURES)}")
    return dataclasses.replace(scale, **changes)
