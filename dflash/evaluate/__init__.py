"""`dflash eval`: plain decoding against speculative decoding with each method, prompt by prompt, and the
report of acceptance length, tokens/s and speedup; a partial report can be resumed.

The baseline every speedup is measured against is plain decoding at the eval's temperature: greedy at 0, sampled
at `--temperature` otherwise (the report's `baseline` names it). transformers' prompt lookup
(`prompt-lookup-generate`) decodes greedily, so it runs at temperature 0 only; sampled evals leave it out.

Acceptance length tau = mean over rounds of the tokens a round commits (accepted drafts + the bonus token),
cut at EOS like the public DFlash benchmark; the first token, from the prefill, belongs to no round, so
`tau = (new tokens - 1) / rounds`. At temperature 0 every method's output is compared with plain greedy
decoding's; a mismatch is reported with the plain target's top-2 logit gap there (a tiny gap is a numerical tie).
"""

import hashlib
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash import methods as drafter_methods
from dflash.config import EvalConfig
from dflash.device import local_device
from dflash.drafter.proposers import DecodingOptions, PromptLookupProposer, Proposer
from dflash.errors import DflashError, describe_differences
from dflash.evaluate.decoding import Generation, generate_prompt_lookup, plain_decode, speculative_generate
from dflash.evaluate.drafters import (
    check_drafter_fits,
    check_trained_for,
    drafter_and_config,
    drafter_label,
    drafter_names,
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

# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One method on one prompt."""

    new_tokens: int
    seconds: float
    rounds: int  # verify forwards after the prefill (speculative); target forwards (prompt-lookup-generate)
    tau: float | None
    accepted: list[int]  # accepted drafts per round ([] when not observable)
    mismatch_at: int | None = None  # temperature 0: first position differing from plain greedy decoding
    plain_margin_at_mismatch: float | None = None  # the plain target's top-2 logit gap there (tiny = a numerical tie)
    overlaps: list[list[list[float]]] = field(default_factory=list)  # temperature > 0: Generation.overlaps


@dataclass
class Method:
    """One method over all prompts."""

    name: str
    tau: float | None
    tau_definition: str
    accepted_histogram: list[int]  # [i] = rounds that accepted exactly i drafts
    rounds: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float  # its tokens/s over the baseline's (plain decoding at the same temperature), in the same run
    mismatches: int | None  # temperature 0: prompts whose output differs from plain greedy decoding
    first_mismatch: dict | None
    block_size: int | None = None  # a drafter's block (its config's); None for prompt lookup
    # temperature > 0: per draft position, the mean over the rounds that reached it of sum min(p, q), the chance
    # that verification accepts the draft there, of the target's mass on q's support, its cap, and of q's fit to
    # the target's shape on that support (dflash.evaluate.decoding.draft_overlap)
    acceptance_by_position: list[float] = field(default_factory=list)
    support_by_position: list[float] = field(default_factory=list)
    shape_by_position: list[float] = field(default_factory=list)


@dataclass
class EvalReport:
    target: str
    drafter: str | None
    temperature: float
    max_new_tokens: int
    device: str
    dtype: str
    prompt_lookup_tokens: int
    block_size: int | None  # --block-size, of the untrained drafter; None without one (each method has its own)
    seed: int
    plain_tokens_per_s: float
    methods: dict[str, Method]
    prompts: list[
        dict
    ]  # per prompt: index, prompt_tokens, prompt_sha256, plain {new_tokens, seconds}, runs {method: Run}
    # Several drafters: each one's tau against the first one's, paired over the prompts (`compare_drafters`).
    comparisons: dict[str, dict] = field(default_factory=dict)
    baseline: str = "plain greedy"  # what every speedup is measured against (`baseline_name`)
    # The drafters ran compiled (--compile-drafter), their drafting from CUDA graphs (--drafting-cuda-graph): each
    # changes the speed, not the drafts.
    drafter_compiled: bool = False
    drafting_cuda_graph: bool = False

    def table(self) -> str:
        w = max(22, *(len(name) + 2 for name in self.methods))
        lines = [
            f"target {self.target}  drafter {self.drafter}  temperature {self.temperature}  "
            f"max_new_tokens {self.max_new_tokens}  {self.device} {self.dtype}  prompts {len(self.prompts)}",
            f"{'method':<{w}}{'tau':>7}{'tokens/s':>11}{'speedup':>9}{'mismatches':>12}  accepted drafts per round (0, 1, ...)",
            f"{self.baseline:<{w}}{'-':>7}{self.plain_tokens_per_s:>11.1f}{'1.00x':>9}{'-':>12}",
        ]
        for m in self.methods.values():
            tau = f"{m.tau:.2f}" if m.tau is not None else "-"
            mismatches = "-" if m.mismatches is None else str(m.mismatches)
            histogram = " ".join(map(str, m.accepted_histogram)) or "-"
            lines.append(f"{m.name:<{w}}{tau:>7}{m.tokens_per_s:>11.1f}{m.speedup:>8.2f}x{mismatches:>12}  {histogram}")
        for m in self.methods.values():
            if m.first_mismatch:
                lines.append(f"{m.name}: first mismatch {m.first_mismatch}")
        for name, c in self.comparisons.items():
            low, high = c["difference_95"]
            lines.append(
                f"{name} - {c['reference']}: tau {c['difference']:+.3f} (95 %: {low:+.3f} to {high:+.3f}), "
                f"{c['relative']:+.1%} ({low / c['reference_tau']:+.1%} to {high / c['reference_tau']:+.1%}), "
                f"paired bootstrap over {c['prompts']} prompts"
            )
        return "\n".join(lines)

    def prompt_table(self) -> str:
        """A row per prompt: its plain decoding, then each method's tau and speedup (`!` marks a mismatch)."""
        names = list(self.methods)
        # Two spaces at least before each header, however long the method's name: they never run together.
        headers = {name: f"  {name} tau, speedup" for name in names}
        widths = {name: max(34, len(header)) for name, header in headers.items()}
        lines = [
            f"{'prompt':>6}{'tokens':>8}{'plain tok/s':>13}" + "".join(f"{headers[n]:>{widths[n]}}" for n in names)
        ]
        for row in self.prompts:
            plain = row["plain"]
            plain_rate = plain["new_tokens"] / plain["seconds"] if plain["seconds"] else 0.0
            cells = []
            for name in names:
                run = row["runs"][name]
                rate = run.new_tokens / run.seconds if run.seconds else 0.0
                tau = f"{run.tau:.2f}" if run.tau is not None else "-"
                mark = "!" if run.mismatch_at is not None else ""
                cells.append(f"{tau + mark:>{widths[name] - 8}}{rate / plain_rate if plain_rate else 0.0:>7.2f}x")
            lines.append(f"{row['index']:>6}{plain['new_tokens']:>8}{plain_rate:>13.1f}" + "".join(cells))
        return "\n".join(lines)


def baseline_name(temperature: float) -> str:
    return "plain greedy" if temperature == 0 else f"plain sampling T={temperature:g}"


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


def tau_interval(
    prompts: list[tuple[list[int], ...]], statistic=lambda tau: tau[0], draws: int = 5000, seed: int = 0
) -> list[float]:
    """95 % percentile-bootstrap interval over prompts of statistic(tau), tau the taus of the methods.

    prompts: per prompt, the drafts accepted in each round by each method (in the same order on every prompt). A
    draw takes as many prompts as there are, with replacement, and computes every method's tau over the drawn
    prompts' rounds, as the report does (1 + accepted / rounds); `statistic` gets the [methods, draws] array and
    returns one value per draw, so that a ratio or difference of two methods pairs them on the same prompts: the
    interval says how far it could move on other prompts like these."""
    counts = np.array([[x for accepted in row for x in (len(accepted), sum(accepted))] for row in prompts], np.float64)
    drawn = counts[np.random.default_rng(seed).integers(0, len(prompts), size=(draws, len(prompts)))].sum(axis=1)
    tau = 1 + drawn[:, 1::2] / drawn[:, 0::2]
    return np.percentile(statistic(tau.T), [2.5, 97.5]).tolist()


def tau_ratio_interval(pairs: list[tuple[list[int], list[int]]], draws: int = 5000, seed: int = 0) -> list[float]:
    """95 % percentile-bootstrap interval of tau(a) / tau(b) over prompts; pairs: per prompt, (a's, b's) accepted
    drafts per round (`tau_interval`)."""
    return tau_interval(pairs, lambda tau: tau[0] / tau[1], draws, seed)


def tau_difference_interval(pairs: list[tuple[list[int], list[int]]], draws: int = 5000, seed: int = 0) -> list[float]:
    """The same of tau(a) - tau(b)."""
    return tau_interval(pairs, lambda tau: tau[0] - tau[1], draws, seed)


def _summarise(name: str, method, rows: list[dict], plain_tokens_per_s: float) -> Method:
    """One method over the prompt rows (in prompt order) of a report."""
    runs = [row["runs"][name] for row in rows]
    new_tokens = sum(r.new_tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    accepted = [a for r in runs for a in r.accepted]
    tokens_per_s = new_tokens / seconds if seconds else 0.0
    mismatched = [(row["index"], row["runs"][name]) for row in rows if row["runs"][name].mismatch_at is not None]
    first = None
    if mismatched:
        i, r = mismatched[0]
        first = {"prompt": i, "position": r.mismatch_at, "plain_margin": r.plain_margin_at_mismatch}
    rounds = [round for r in runs for round in r.overlaps]  # draft_overlap's columns, per draft position
    acceptance, support, shape = (_mean_by_position([[o[c] for o in round] for round in rounds]) for c in range(3))
    return Method(
        name=name,
        tau=method.overall_tau(runs),
        tau_definition=method.tau_definition,
        accepted_histogram=[accepted.count(i) for i in range(max(accepted) + 1)] if accepted else [],
        rounds=sum(r.rounds for r in runs),
        new_tokens=new_tokens,
        seconds=seconds,
        tokens_per_s=tokens_per_s,
        speedup=tokens_per_s / plain_tokens_per_s if plain_tokens_per_s else 0.0,
        mismatches=len(mismatched) if method.checks_greedy else None,
        first_mismatch=first,
        block_size=method.block_size,
        acceptance_by_position=acceptance,
        support_by_position=support,
        shape_by_position=shape,
    )


def _mean_by_position(rows: list[list[float]]) -> list[float]:
    """The mean of each position over the rows long enough to have it."""
    width = max(map(len, rows), default=0)
    return [float(np.mean([row[i] for row in rows if len(row) > i])) for i in range(width)]


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
    graphed = compiled and cfg.drafting_cuda_graph and target.device.type == "cuda"
    methods = _methods(cfg, target, tokenizer, named, eos_ids, compiled, graphed)
    trained = [name for name, drafter in named.items() if drafter != "untrained"]
    generator = torch.Generator(target.device).manual_seed(cfg.seed)

    def report(rows: list[dict], compare: bool = False) -> EvalReport:
        plain_tokens = sum(row["plain"]["new_tokens"] for row in rows)
        plain_seconds = sum(row["plain"]["seconds"] for row in rows)
        plain_tokens_per_s = plain_tokens / plain_seconds if plain_seconds else 0.0
        summaries = {name: _summarise(name, method, rows, plain_tokens_per_s) for name, method in methods.items()}
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
    rows = _resumed_rows(resume, empty, encoded) if resume else []
    done = {row["index"] for row in rows}  # every share's: each group resumes from the whole report
    todo = [i for i in range(len(encoded)) if i not in done and share_of(i, share)]
    collects = shares is not None and shares.collects
    if share[1] > 1:
        mine = sum(share_of(i, share) for i in range(len(encoded)))
        logger.info("eval: share %d of %d, %d of the %d prompts, %d to run", *share, mine, len(encoded), len(todo))
    theirs: list[dict] = []  # the first process of several groups: the other groups' rows

    def take(new: list[dict]) -> None:
        theirs.extend(_resumed_rows({**asdict(empty), "prompts": new}, empty, encoded))

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
        identity = {"prompt_tokens": encoded[index].numel(), "prompt_sha256": _token_hash(encoded[index])}
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


def compare_drafters(methods: dict[str, Method], rows: list[dict], names: list[str]) -> dict[str, dict]:
    """Each of the methods `names[1:]` against `names[0]` (the trained drafters, in the order given): the tau
    difference, relative to the first's tau, with its 95 % percentile-bootstrap interval over the prompts, both
    drafters' rounds drawn on the same prompts (`tau_difference_interval`)."""
    if len(names) < 2 or not rows:
        return {}
    reference = names[0]
    comparisons = {}
    for name in names[1:]:
        ref_tau, tau = methods[reference].tau, methods[name].tau
        if ref_tau is None or tau is None:
            continue
        pairs = [(row["runs"][name].accepted, row["runs"][reference].accepted) for row in rows]
        comparisons[name] = {
            "reference": reference,
            "reference_tau": ref_tau,
            "difference": tau - ref_tau,
            "difference_95": tau_difference_interval(pairs),
            "relative": (tau - ref_tau) / ref_tau,
            "prompts": len(rows),
        }
    return comparisons


def _resumed_rows(earlier: dict, empty: EvalReport, encoded: list[torch.Tensor]) -> list[dict]:
    """The prompts of an earlier report, checked to belong to this evaluation, with their runs as `Run`s."""
    required = (
        "target",
        "drafter",
        "temperature",
        "max_new_tokens",
        "device",
        "dtype",
        "prompt_lookup_tokens",
        "block_size",
        "seed",
    )
    defaults = {"drafter_compiled": False, "drafting_cuda_graph": False}  # absent from older reports: not used then
    missing = [key for key in (*required, "methods", "prompts") if key not in earlier]
    if missing:
        raise DflashError(
            f"the earlier report lacks {', '.join(missing)}: it was written by an older dflash or is not "
            "an eval report; start a new report"
        )
    keys = (*required, *defaults)
    differences = describe_differences(
        {k: earlier.get(k, defaults.get(k)) for k in keys},
        {k: getattr(empty, k) for k in keys},
        "earlier report",
        "this eval",
    )
    if set(earlier["methods"]) != set(empty.methods):
        differences += f"; methods: earlier report {sorted(earlier['methods'])}, this eval {sorted(empty.methods)}"
    if differences:
        raise DflashError(
            f"cannot resume an eval of other settings ({differences.strip('; ')}); "
            "start a new report or give the same settings"
        )
    rows, seen = [], set()
    try:
        for row in earlier["prompts"]:
            index = row["index"]
            if index in seen:
                raise DflashError(f"the earlier report holds prompt {index} twice; start a new report")
            seen.add(index)
            if not 0 <= index < len(encoded):
                raise DflashError(
                    f"the earlier report holds prompt {index}, this eval has {len(encoded)} prompts; resume with at "
                    "least as many prompts (--num-prompts), or start a new report"
                )
            if row["prompt_sha256"] != _token_hash(encoded[index]):
                raise DflashError(
                    f"the earlier report's prompt {index} is not this prompt file's prompt {index} (other tokens); "
                    "resume with the same prompts, or start a new report"
                )
            if set(row["runs"]) != set(empty.methods) or {"new_tokens", "seconds"} - set(row["plain"]):
                raise KeyError("runs or plain")
            rows.append({**row, "runs": {name: Run(**run) for name, run in row["runs"].items()}})
    except (KeyError, TypeError) as exc:
        raise DflashError(
            f"the earlier report is not a dflash eval report of this version ({exc!r}); start a new report"
        ) from None
    return rows


def _token_hash(tokens: torch.Tensor) -> str:
    return hashlib.sha256(tokens.to("cpu", torch.int64).numpy().tobytes()).hexdigest()


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
