"""The eval's report: a `Run` per method and prompt, each method's summary over the prompts (`Method`: tau,
accepted-drafts histogram, speedup, acceptance per draft position), the paired bootstrap intervals that compare
drafters, and the checks that an earlier report belongs to this eval before `--resume` goes on from it."""

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash.errors import DflashError, describe_differences


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
        diagnosed = [m for m in self.methods.values() if m.acceptance_by_position]
        if diagnosed:
            lines.append(
                "per draft position 1, 2, ...: accepted = sum min(p, q), the chance verification accepts the draft; "
                "cap = the target's mass on q's candidates"
            )
        for m in diagnosed:
            lines.append(f"{m.name}: accepted {_positions(m.acceptance_by_position)}")
            lines.append(f"{m.name}: cap      {_positions(m.support_by_position)}")
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


def _positions(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def baseline_name(temperature: float) -> str:
    return "plain greedy" if temperature == 0 else f"plain sampling T={temperature:g}"


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


def summarise(name: str, method, rows: list[dict], plain_tokens_per_s: float) -> Method:
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


def resumed_rows(earlier: dict, empty: EvalReport, encoded: list[torch.Tensor]) -> list[dict]:
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
            if row["prompt_sha256"] != token_hash(encoded[index]):
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


def token_hash(tokens: torch.Tensor) -> str:
    return hashlib.sha256(tokens.to("cpu", torch.int64).numpy().tobytes()).hexdigest()
