"""`dflash eval`: plain decoding against speculative decoding with each method, prompt by prompt, and the
report of acceptance length, tokens/s and speedup; a partial report can be resumed.

The baseline every speedup is measured against is plain decoding at the eval's temperature: greedy at 0, sampled
at `--temperature` otherwise (the report's `baseline` names it). transformers' prompt lookup
(`prompt-lookup-generate`) decodes greedily, so it runs at temperature 0 only; sampled evals leave it out.

Acceptance length tau = mean over rounds of the tokens a round commits (accepted drafts + the bonus token),
cut at EOS like the public DFlash benchmark; the first token, from the prefill, belongs to no round, so
`tau = (new tokens - 1) / rounds`. At temperature 0 every method's output is compared with plain greedy
decoding's; a mismatch is reported with the plain target's top-2 logit gap there (a tiny gap is a numerical tie).
The report, its statistics and the checks before a resume are in `dflash.evaluate.report`.
"""

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dflash import methods as drafter_methods
from dflash.config import EvalConfig
from dflash.device import local_device
from dflash.drafter.proposers import DecodingOptions, PromptLookupProposer, Proposer
from dflash.errors import DflashError
from dflash.evaluate.decoding import Generation, generate_prompt_lookup, plain_decode, speculative_generate
from dflash.evaluate.drafters import (
    check_drafter_fits,
    check_trained_for,
    drafter_and_config,
    drafter_label,
    drafter_names,
)
from dflash.evaluate.report import (
    EvalReport,
    Run,
    baseline_name,
    compare_drafters,
    resumed_rows,
    summarise,
    token_hash,
)
from dflash.evaluate.shares import merge_reports, share_of
from dflash.export import read_drafter_config
from dflash.manifest import TargetIdentity
from dflash.parallel import open_group, shared_work
from dflash.regenerate import encode_prompt, eos_token_ids
from dflash.regenerate.answers import answerable_prompts, check_positions
from dflash.target import load_target
from dflash.target_files import check_target_folder

logger = logging.getLogger("dflash")


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def _compare(run: Run, tokens: list[int], plain: Generation) -> Run:
    run.mismatch_at = first_difference(tokens, plain.tokens)
    if run.mismatch_at is not None and run.mismatch_at < len(plain.margins):
        run.plain_margin_at_mismatch = plain.margins[run.mismatch_at]
    return run


# ---------------------------------------------------------------------------------------------------------------
# Methods compared against plain greedy decoding
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SpeculativeMethod:
    """Our draft-verify loop with a proposer."""

    proposer: Proposer
    max_drafts: int
    temperature: float
    block_size: int | None = None  # the drafter's; None for prompt lookup
    tau_definition = (
        "mean over verify rounds of (accepted drafts + 1 bonus token), cut at EOS; "
        "the prefill's first token belongs to no round"
    )

    @property
    def checks_greedy(self) -> bool:
        return self.temperature == 0

    def run(self, target, prompt, budget, plain: Generation, eos_ids, generator) -> Run:
        generation = speculative_generate(
            target, self.proposer, prompt, budget, eos_ids, self.temperature, generator, self.max_drafts
        )
        accepted = generation.accepted
        run = Run(len(generation.tokens), generation.seconds, len(accepted), _tau(accepted), accepted)
        run.overlaps = generation.overlaps
        return _compare(run, generation.tokens, plain) if self.checks_greedy else run

    @staticmethod
    def overall_tau(runs: list[Run]) -> float | None:
        return _tau([a for r in runs for a in r.accepted])


def _tau(accepted: list[int]) -> float | None:
    """Mean tokens committed per verify round: the accepted drafts plus the bonus token."""
    return sum(a + 1 for a in accepted) / len(accepted) if accepted else None


@dataclass
class GenerateLookupMethod:
    """transformers' own greedy prompt-lookup decoding (dense targets), tau from its forward count."""

    num_tokens: int
    tau_definition = (
        "new tokens / target forwards of transformers generate(prompt_lookup_num_tokens); "
        "its first forward verifies the prompt and the first candidates together"
    )
    checks_greedy = True
    block_size = None

    def run(self, target, prompt, budget, plain: Generation, eos_ids, generator) -> Run:
        generation, forwards = generate_prompt_lookup(target, prompt, budget, self.num_tokens)
        tokens = generation.tokens
        run = Run(len(tokens), generation.seconds, forwards, len(tokens) / forwards if forwards else None, [])
        return _compare(run, tokens, plain)

    @staticmethod
    def overall_tau(runs: list[Run]) -> float | None:
        forwards = sum(r.rounds for r in runs)
        return sum(r.new_tokens for r in runs) / forwards if forwards else None


# ---------------------------------------------------------------------------------------------------------------
# evaluate
# ---------------------------------------------------------------------------------------------------------------


def evaluate(
    cfg: EvalConfig,
    *,
    drafters: list | dict | None = None,
    resume: dict | None = None,
    on_prompt=None,
    progress: bool = False,
    share: tuple[int, int] | None = None,
) -> EvalReport:
    """Plain greedy decoding, then each method, prompt by prompt; tokens/s and speedups compare measurements of the
    same process (or, resumed, of the runs that made the report: same settings and device), and plain greedy is
    every method's reference.

    `drafters`: the drafters to compare, each an exported drafter folder, "untrained" (random init from the
    target's config with `cfg.block_size`, the baseline) or a `(model, config)` pair, named by `drafter_names`,
    or {method name: drafter}; None takes `cfg.drafter` or `cfg.untrained`. Several trained drafters are each
    compared with the first (`compare_drafters`). `cfg.data`: a JSONL path or a list of records as a prompt file holds them.
    `on_prompt(report)`: called after each prompt with the report so far (to save it). `resume`: an earlier,
    partial report of this evaluation as a JSON object: its prompts are not run again and count in the totals,
    so that a long eval can be spread over several runs. `share`: (part, count), run only the prompts part,
    part + count, ... (their rows keep their own indices: `merge_reports` merges the shares' reports).

    Under torchrun with several tensor-parallel groups (G*T processes, `cfg.tensor_parallel` T), group g runs share
    (g, G) and the first process (global rank 0) returns the report of every prompt, having collected the other
    groups' rows (dflash.parallel.GroupShares); `on_prompt` gets there every group's rows so far. `cfg.time_budget` and
    `cfg.min_prompts` count per group. The other processes return their own share's report.
    """

    if drafters is None:
        drafters = ["untrained"] if cfg.untrained else cfg.drafter
    if not drafters and not cfg.prompt_lookup:
        raise DflashError("nothing to evaluate: give --drafter, --untrained or --prompt-lookup N")
    for drafter in drafters.values() if isinstance(drafters, dict) else drafters:  # before naming them by method
        if isinstance(drafter, (str, Path)) and drafter != "untrained" and not Path(drafter).is_dir():
            what = "is a file, not a folder" if Path(drafter).exists() else "does not exist"
            raise DflashError(f"drafter folder {drafter} {what}; pass --drafter an exported drafter folder")
    named = drafters if isinstance(drafters, dict) else drafter_names(drafters)
    drafters = list(named.values())
    target_config = check_target_folder(cfg.model)
    text_config = target_config.get("text_config") or target_config
    folders = [str(d) for d in drafters if isinstance(d, (str, Path)) and d != "untrained"]
    target = TargetIdentity.of_checkpoint(cfg.model) if folders else None
    for drafter in folders:  # the shapes and the target's weights, from the files alone: before the target is loaded
        config = read_drafter_config(drafter)
        check_drafter_fits(config, text_config, None, drafter, str(cfg.model))
        check_trained_for(config, target, drafter, str(cfg.model), cfg.allow_other_target_weights)
    records = answerable_prompts(cfg.data, "eval measures")[: cfg.num_prompts]
    group = open_group(
        cfg.model, cfg.tensor_parallel, local_device(cfg.device), shares_work=True, expert_parallel=cfg.expert_parallel
    )
    with shared_work(group, "eval") as shares:
        if shares is not None:
            if share is not None:
                raise ValueError(
                    "evaluate(share=...) with several tensor-parallel groups: each group runs its own share"
                )
            share = (group.layout.group, group.layout.groups)
        report = _evaluate(cfg, named, records, resume, on_prompt, progress, share or (0, 1), shares)
    return report


def _evaluate(
    cfg: EvalConfig, named: dict, records: list, resume, on_prompt, progress: bool, share: tuple[int, int], shares
) -> EvalReport:
    """`evaluate` once its inputs are checked (and the tensor-parallel group is set up): the prompts of `share`;
    `shares`, with several groups: their hand-off (GroupShares)."""
    from tqdm import tqdm

    drafters = list(named.values())
    try:
        target, tokenizer = load_target(
            cfg.model, cfg.device, cfg.dtype, cfg.tensor_parallel, cfg.experts, cfg.expert_parallel
        )
    except (OSError, ValueError, RuntimeError, KeyError) as exc:  # e.g. weights of other shapes than config.json's
        last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1].strip()
        raise DflashError(
            f"cannot load the target {cfg.model} ({type(exc).__name__}: {last[:300]}); pass --model a complete "
            "transformers checkpoint folder whose weights match its config.json"
        ) from None
    eos_ids = eos_token_ids(target, tokenizer)
    encoded = [torch.tensor(encode_prompt(tokenizer, r), device=target.device) for r in records]
    check_positions(encoded, cfg.max_new_tokens, target.config.get_text_config())
    compiled = drafter_compiled(cfg, target.device) and bool(named)
    graphed = drafting_graphed(cfg, target.device, compiled)
    methods = _methods(cfg, target, tokenizer, named, eos_ids, compiled, graphed)
    trained = [name for name, drafter in named.items() if drafter != "untrained"]
    generator = torch.Generator(target.device).manual_seed(cfg.seed)

    def report(rows: list[dict], compare: bool = False) -> EvalReport:
        plain_tokens = sum(row["plain"]["new_tokens"] for row in rows)
        plain_seconds = sum(row["plain"]["seconds"] for row in rows)
        plain_tokens_per_s = plain_tokens / plain_seconds if plain_seconds else 0.0
        summaries = {name: summarise(name, method, rows, plain_tokens_per_s) for name, method in methods.items()}
        return EvalReport(
            target=str(cfg.model),
            drafter=", ".join(drafter_label(d) for d in drafters) or None,
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            device=str(target.device),
            dtype=str(target.dtype).removeprefix("torch."),
            prompt_lookup_tokens=cfg.prompt_lookup,
            block_size=cfg.block_size if "untrained" in drafters else None,
            seed=cfg.seed,
            plain_tokens_per_s=plain_tokens_per_s,
            methods=summaries,
            prompts=rows,
            comparisons=compare_drafters(summaries, rows, trained) if compare else {},
            baseline=baseline_name(cfg.temperature),
            drafter_compiled=compiled,
            drafting_cuda_graph=graphed,
        )

    def run_all(prompt: torch.Tensor, budget: int) -> tuple[Generation, dict[str, Run]]:
        plain = plain_decode(target, prompt, budget, eos_ids, cfg.temperature, generator)
        return plain, {name: m.run(target, prompt, budget, plain, eos_ids, generator) for name, m in methods.items()}

    empty = report([])
    rows = resumed_rows(resume, empty, encoded) if resume else []
    done = {row["index"] for row in rows}  # every share's: each group resumes from the whole report
    todo = [i for i in range(len(encoded)) if i not in done and share_of(i, share)]
    collects = shares is not None and shares.collects
    if share[1] > 1:
        mine = sum(share_of(i, share) for i in range(len(encoded)))
        logger.info("eval: share %d of %d, %d of the %d prompts, %d to run", *share, mine, len(encoded), len(todo))
    theirs: list[dict] = []  # the first process of several groups: the other groups' rows

    def take(new: list[dict]) -> None:
        theirs.extend(resumed_rows({**asdict(empty), "prompts": new}, empty, encoded))

    def everyone() -> list[dict]:
        return merge_reports([{"prompts": rows}, {"prompts": theirs}])["prompts"]

    def saved(new: list[dict]) -> None:
        take(new)
        if on_prompt is not None:
            on_prompt(report(everyone()))

    if cfg.warmup and todo:
        # First calls pay for allocations and kernel selection: keep them out of the timings.
        run_all(encoded[todo[0]], min(cfg.max_new_tokens, 8))
    start, ran = time.perf_counter(), 0
    for index in tqdm(todo, desc="eval", unit="prompt", disable=not progress):
        if cfg.time_budget is not None and ran >= cfg.min_prompts and time.perf_counter() - start > cfg.time_budget:
            break
        plain, runs = run_all(encoded[index], cfg.max_new_tokens)
        plain_summary = {"new_tokens": len(plain.tokens), "seconds": plain.seconds}
        identity = {"prompt_tokens": encoded[index].numel(), "prompt_sha256": token_hash(encoded[index])}
        rows.append({"index": index, **identity, "plain": plain_summary, "runs": runs})
        ran += 1
        if shares is not None:
            shares.post({**rows[-1], "runs": {name: asdict(run) for name, run in runs.items()}})
        if collects:
            take(shares.collect())
        if on_prompt is not None:
            on_prompt(report(everyone()))
        if collects:
            shares.check_failure()  # another group failed: stop here too, its rows and this one's are saved
    if collects:
        shares.wait(saved)
    return report(everyone(), compare=True)


def _methods(cfg: EvalConfig, target, tokenizer, named: dict, eos_ids: set[int], compiled: bool, graphed: bool):
    methods = {}
    if named:
        how = (
            "compiled (torch.compile, dynamic context length"
            f"{'; the drafting from the block replayed from CUDA graphs' if graphed else ''})"
            if compiled
            else "eager (--compile-drafter: off)"
        )
        logger.info("eval: the drafters run %s", how)
    for name, drafter in named.items():
        model, config = drafter_and_config(drafter, target, tokenizer, cfg.block_size, cfg.seed)
        options = DecodingOptions(confidence_cut=cfg.confidence_cut)
        proposer = drafter_methods.of_config(config).proposer_cls(model, config, target, options, compiled, graphed)
        methods[name] = SpeculativeMethod(proposer, config.drafts_per_block, cfg.temperature, config.block_size)
    if cfg.prompt_lookup:
        proposer = PromptLookupProposer(cfg.prompt_lookup, eos_ids=eos_ids)
        methods["prompt-lookup"] = SpeculativeMethod(proposer, cfg.prompt_lookup, cfg.temperature)
        # transformers refuses assisted generation on stateful (hybrid) models; it decodes greedily, so it has no
        # place in a table of sampled methods.
        if cfg.temperature > 0:
            logger.info(
                "prompt-lookup-generate (transformers' prompt lookup) decodes greedily: left out at temperature %g",
                cfg.temperature,
            )
        elif not getattr(target, "_is_stateful", False):
            methods["prompt-lookup-generate"] = GenerateLookupMethod(cfg.prompt_lookup)
    return methods


def drafter_compiled(cfg: EvalConfig, device: torch.device) -> bool:
    """--compile-drafter, by default on for CUDA."""
    return device.type == "cuda" if cfg.compile_drafter is None else cfg.compile_drafter


def drafting_graphed(cfg: EvalConfig, device: torch.device, compiled: bool) -> bool:
    """--drafting-cuda-graph: on CUDA with the compiled drafting unless turned off (CUDA graphs exist on CUDA only)."""
    return compiled and device.type == "cuda" and cfg.drafting_cuda_graph is not False
