"""Target-regenerated responses: DFlash trains on what the target itself says.

Prompts are read as harvest reads data (JSONL, .gz, .zst, Parquet, folders: docs/data.md): chat records
(`{"messages": [...]}` or ShareGPT `{"conversations": [...]}`) ending with a user turn (a trailing assistant turn, the
original answer, is dropped; one that ends otherwise, with a tool result say, is skipped with a count, as eval
skips it), rendered with the tokenizer's chat template; or text records, `{"text": ...}` or
`{"prompt": ...}` (a `"completion"` beside it, an original answer, is dropped), which the target continues as
raw text. Output lines, in prompt order, are what `dflash harvest` reads:
`{"messages": [...prompt turns, {"role": "assistant", "content": response, "target": true}]}` for chat prompts
(with `--turns all`, every assistant turn of the prompt is the target's too, marked alike) and
`{"prompt": prompt, "completion": response}` for text prompts (harvest puts the loss on the target's text only).

Under torchrun, `--tensor-parallel T` splits the target over the T processes of each group (dflash.parallel):
every process of a group runs the same generation on the split target's replicated logits (the same seeds: the
same samples), and only the first process of the launch reads the output's state, checks it and writes. With
several groups (G*T processes) they take the batches in turn and hand theirs to the first process, which
appends them in prompt order: the output is the one a single process writes (`_answer`).

Resuming: dflash.regenerate.answers (the prompt and response records, the output's resume check and recorded settings,
shared with `--server`, where dflash.regenerate.remote asks a serving engine (vLLM, SGLang) for the answers instead).
"""

from dflash.config import RegenerateConfig
from dflash.errors import DflashError
from dflash.regenerate.answers import (
    RegenerateStats,
    answer_records,
    answerable_prompts,
    append_lines,
    check_output,
    check_positions,
    completed_count,
    generation_settings,
    output_counts,
    output_path,
    plain_messages,
)

# ---------------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------------


def encode_prompt(tokenizer, record: dict) -> list[int]:
    """Token ids the target starts generating after."""
    if "prompt" in record:
        return tokenizer(record["prompt"])["input_ids"]
    if not tokenizer.chat_template:
        raise DflashError('chat prompts need a tokenizer with a chat template; use {"text": ...} prompts instead')
    text = tokenizer.apply_chat_template(plain_messages(record["messages"]), add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class StepCounter:
    """A logits processor that changes nothing and calls `on_step(n)` at generate's n-th new token: generate hands
    back a batch's answers only at its end, minutes away for long ones."""

    def __init__(self, on_step):
        self.on_step, self.steps = on_step, 0

    def __call__(self, input_ids, scores):
        self.steps += 1
        self.on_step(self.steps)
        return scores


def generate_batch(
    model, tokenizer, prompts: list[list[int]], cfg: RegenerateConfig, eos_ids: set[int], on_step=None
) -> list[tuple[str, bool]]:
    """Generate for a batch of token-id prompts, left-padded, with `cfg`'s sampling settings; returns each response
    up to its first EOS, and whether it is unfinished (no EOS within max_new_tokens). A top_k of 0 turns off a
    top_k in the target's generation_config. `on_step(n)` is called at each new token."""
    import torch
    from transformers import LogitsProcessorList

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in prompts], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], device=model.device)
    sample = cfg.temperature > 0
    options = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k) if sample else {}
    try:
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=cfg.max_new_tokens,
            do_sample=sample,
            pad_token_id=pad_id,
            logits_processor=LogitsProcessorList([StepCounter(on_step)] if on_step else []),
            **options,
        )
    except torch.OutOfMemoryError as exc:  # the KV cache grows with every new token: long answers meet it late
        raise DflashError(
            f"generating {len(prompts)} answers of up to {cfg.max_new_tokens} new tokens to prompts of up to {width} "
            f"tokens ran out of memory on {model.device}: rerun with a lower --batch-size (now {cfg.batch_size}) "
            "or, for a target this large, --tensor-parallel under torchrun; or generate through a serving engine "
            "with --server (it pages its cache). The answers written so far are kept and the rerun resumes after "
            "them"
        ) from exc
    responses = []
    for row in out[:, width:].tolist():
        stop = next((i for i, token in enumerate(row) if token in eos_ids), len(row))
        # Special tokens the target produced before EOS are part of its answer: keep them.
        responses.append((tokenizer.decode(row[:stop], skip_special_tokens=False), stop == len(row)))
    return responses


def eos_token_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise DflashError("the target defines no EOS token (generation_config.eos_token_id or tokenizer.eos_token)")
    return ids


def regenerate(cfg: RegenerateConfig, progress: bool = True) -> RegenerateStats:
    """Answer every prompt of `cfg.data` with the target at `cfg.model` (or through `cfg.server`), appending to
    `cfg.out` (resumable). Ctrl-C stops it at once, keeping the whole answers written."""
    try:
        if cfg.server is not None:
            from dflash.regenerate.remote import regenerate_remote

            return regenerate_remote(cfg, progress)
        return _regenerate_local(cfg, progress)
    except KeyboardInterrupt:
        raise DflashError(
            f"regenerate interrupted; the answers already in {cfg.out} are kept (whole lines): rerun the same "
            "command to resume after them"
        ) from None


def _regenerate_local(cfg: RegenerateConfig, progress: bool) -> RegenerateStats:
    from dflash.device import local_device
    from dflash.parallel import open_group, shared_work

    records = answerable_prompts(cfg.data, "regenerate answers")
    out = output_path(cfg)
    check_lengths(cfg, records)
    group = open_group(
        cfg.model, cfg.tensor_parallel, local_device(cfg.device), shares_work=True, expert_parallel=cfg.expert_parallel
    )
    with shared_work(group, "regenerate") as shares:
        done = _resume_point(cfg, records, out, group, shares)
        stats = _answer(cfg, records, out, done, group, shares, progress)
    return stats


def check_lengths(cfg: RegenerateConfig, records: list[dict]) -> None:
    """Refuse, before the target loads, answers that would run past the positions it was made for (eval's check)."""
    import torch
    from transformers import AutoTokenizer

    from dflash.target_files import check_target_folder, load_config

    check_target_folder(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    encoded = [torch.tensor(encode_prompt(tokenizer, record)) for record in records]
    check_positions(encoded, cfg.max_new_tokens, load_config(cfg.model).get_text_config(), first=1)


def batch_progress(bar, max_new_tokens: int, interval: float = 1.0):
    """`on_step` of generate_batch: the bar shows how far the batch's answers are, at most every `interval` s."""
    import time

    shown = [float("-inf")]

    def on_step(step: int) -> None:
        if time.monotonic() - shown[0] >= interval:
            shown[0] = time.monotonic()
            bar.set_postfix_str(f"{step}/{max_new_tokens} new tokens of the batch")

    return on_step


def _resume_point(cfg: RegenerateConfig, records: list[dict], out, group, shares) -> int:
    """Prompts already answered in `out`, checked and counted by the process that writes (it may cut a partial
    last line), then told to the others of its tensor-parallel group, and through `shares` to the other groups'
    leaders, which tell their followers; all stop too when it refuses."""
    if group is not None and not group.layout.leader:
        step = group.next_step()
        if step[0] == "refused":
            raise DflashError(f"the first process refused: {step[1]}")
        return step[1]
    if shares is not None and not shares.collects:  # the leader of another group
        step = shares.told()
        group.announce(*step)
        if step[0] == "refused":
            raise DflashError(f"the first process refused: {step[1]}")
        return step[1]
    try:
        check_output(out, generation_settings(cfg))
        done = completed_count(out, records, cfg.turns)
    except DflashError as exc:
        if group is not None:
            group.announce("refused", str(exc))
        if shares is not None:
            shares.tell(["refused", str(exc)])
        raise
    if group is not None:
        group.announce("resume", done)
    if shares is not None:
        shares.tell(["resume", done])
    return done


def _answer(
    cfg: RegenerateConfig, records: list[dict], out, done: int, group, shares, progress: bool
) -> RegenerateStats:
    """Generate the answers after the first `done`, appending them to `out` (the first process alone). Several
    groups (`shares`) take the batches in turn, batch b of the run to group b % G, each batch the one a single
    process makes (the same prompts, the same seed); the other groups' leaders post theirs to the first process,
    which appends every batch in prompt order once those before it are there. A batch it holds waiting for an
    earlier one is lost when it stops: a rerun answers it again."""
    import torch
    from tqdm import tqdm

    from dflash.target import load_target

    writes = group is None or (group.layout.leader and group.layout.group == 0)
    if done == len(records):
        return RegenerateStats(len(records), done, 0, *(output_counts(out) if writes else ()))
    model, tokenizer = load_target(
        cfg.model, cfg.device, cfg.dtype, cfg.tensor_parallel, cfg.experts, cfg.expert_parallel
    )
    eos_ids = eos_token_ids(model, tokenizer)
    bar = tqdm(total=len(records), initial=done, unit="prompt", desc="regenerate", disable=not (progress and writes))
    starts = list(range(done, len(records), cfg.batch_size))
    unwritten, ready = list(starts), {}  # the first process: the batches to append, in order; those answered

    def write(start: int, answered: list[dict]) -> None:
        ready[start] = answered
        while unwritten and unwritten[0] in ready:
            first = unwritten.pop(0)
            append_lines(out, ready.pop(first))
            bar.update(len(records[first : first + cfg.batch_size]))

    def take(posted: list[dict]) -> None:
        for batch in posted:
            write(batch["start"], batch["records"])

    for start in starts[shares.group :: shares.groups] if shares is not None else starts:
        batch = records[start : start + cfg.batch_size]
        # Seeded by position so that a resumed sampled run does not repeat the first run's random stream.
        torch.manual_seed(cfg.seed + start)

        def generate(prompts: list[dict]) -> list[tuple[str, bool]]:
            ids = [encode_prompt(tokenizer, p) for p in prompts]
            return generate_batch(model, tokenizer, ids, cfg, eos_ids, batch_progress(bar, cfg.max_new_tokens))

        answered = answer_records(batch, cfg.turns, generate)
        if shares is not None:
            shares.post({"start": start, "records": answered})
        if writes:
            write(start, answered)
            if shares is not None:
                take(shares.collect())
                shares.check_failure()  # another group failed: stop here too, what is in order is written
    if writes and shares is not None:
        shares.wait(take)
    bar.close()
    return RegenerateStats(len(records), done, len(records) - done, *(output_counts(out) if writes else ()))
