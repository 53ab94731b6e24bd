"""An eval spread over shares of its prompts, merged into the one report of all of them.

A share is every `count`-th prompt from `part` on (`share_of`): tensor-parallel group g of G under torchrun
(`dflash eval --tensor-parallel T` with G*T processes), or a benchmark's worker. Each share's rows keep the
prompts' own indices, so the shares' partial reports merge by their rows alone (`merge_reports`); `evaluate`
rebuilds the report from the merged rows (totals, histogram, tau, comparisons) as for one process.

The groups of one launch hand their rows to the first process through torchrun's store (dflash.parallel's
`GroupShares`, which says why not through files); the first process alone writes the report, after every prompt
with every group's rows so far, so that `--resume` goes on from it with any layout.
"""

from dflash.errors import DflashError


def share_of(index: int, share: tuple[int, int]) -> bool:
    """Whether prompt `index` belongs to share `share` = (part, count)."""
    return index % share[1] == share[0]


def merge_reports(reports: list[dict]) -> dict:
    """Partial reports (JSON objects) of one evaluation over disjoint prompts as one, for `evaluate(resume=...)`
    to rebuild: the first one's settings, every report's rows in prompt order. A prompt in two reports is refused."""
    if not reports:
        raise DflashError("no report to merge: no share of the eval was run")
    rows, seen = [], {}
    for number, report in enumerate(reports):
        for row in report["prompts"]:
            if row["index"] in seen:
                raise DflashError(
                    f"prompt {row['index']} is in two shares of the eval (reports {seen[row['index']]} and {number}): "
                    "they are not shares of one evaluation; start the eval again"
                )
            seen[row["index"]] = number
            rows.append(row)
    return {**reports[0], "prompts": sorted(rows, key=lambda row: row["index"])}
