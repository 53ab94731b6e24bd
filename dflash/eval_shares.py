"""An eval spread over shares of its prompts, merged into the one report of all of them.

A share is every `count`-th prompt from `part` on (`share_of`): tensor-parallel group g of G under torchrun
(`dflash eval --tensor-parallel T` with G*T processes), or a benchmark's worker. Each share's rows keep the
prompts' own indices, so the shares' partial reports merge by their rows alone (`merge_reports`); `evaluate`
rebuilds the report from the merged rows (totals, histogram, tau, comparisons) as for one process.

The groups of one launch hand their rows to the first process through torchrun's TCP store (`GroupShares`), not
through files beside the report: the store is already there (the groups' own worlds are set up on it), reaches
every node of the launch, leaves nothing behind to clean up or go stale after a success or a failure, and lets a
group's failure reach the first process at once, as a message, instead of a missing file it would wait on. The
first process alone writes the report, after every prompt with every group's rows so far: `--resume` goes on from
it with any layout.
"""

import json
import os
import time
from datetime import timedelta

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


class GroupShares:
    """The hand-off of the tensor-parallel groups' rows to the first process through torchrun's store: the leader
    of each other group posts each row it runs (as JSON) and then its end; the first process collects them.

    `store` is the launch's store; the keys carry torchrun's restart count, so that a restarted launch (the agent's
    store outlives its workers) does not read an earlier attempt's rows."""

    def __init__(self, store, group: int, groups: int, leader: bool, timeout: timedelta):
        import torch.distributed as dist

        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = dist.PrefixStore(f"dflash-eval-shares-{restart}/", store)
        self.group, self.groups, self.timeout = group, groups, timeout
        self.posts = leader and group > 0
        self.collects = leader and group == 0
        self.posted = 0
        self.taken = {g: 0 for g in range(1, groups)}  # the first process: rows taken of each other group
        self.ended: set[int] = set()
        self.failure: tuple[int, str] | None = None

    def post(self, row: dict) -> None:
        """A row this group ran (a JSON object); the leaders of other groups than the first only."""
        if self.posts:
            self.store.set(f"{self.group}/row{self.posted}", json.dumps(row))
            self.posted += 1
            self.store.add(f"{self.group}/rows", 1)

    def end(self, error: str | None = None) -> None:
        """This group's share is done (or failed with `error`): posted after its last row."""
        if self.posts:
            self.store.set(f"{self.group}/end", json.dumps({"rows": self.posted, "error": error}))

    def collect(self) -> list[dict]:
        """The first process takes the rows posted since its last look. A group that failed is kept for
        `check_failure`, once its rows before the failure are taken."""
        new = []
        for g in sorted(set(self.taken) - self.ended):
            ended = self.store.check([f"{g}/end"])  # before the count: an ended group's rows are all counted
            count = self.store.add(f"{g}/rows", 0)
            while self.taken[g] < count:
                new.append(json.loads(self.store.get(f"{g}/row{self.taken[g]}")))
                self.taken[g] += 1
            if ended:
                self.ended.add(g)
                error = json.loads(self.store.get(f"{g}/end"))["error"]
                if error and self.failure is None:
                    self.failure = (g, error)
        return new

    def check_failure(self) -> None:
        """Raise the first failure of another group that `collect` saw."""
        if self.failure is not None:
            group, error = self.failure
            raise DflashError(
                f"tensor-parallel group {group} stopped ({error}); the report holds every group's prompts finished "
                "before: fix that and rerun the same launch with --resume to go on after them"
            )

    def wait(self, on_new) -> None:
        """The first process, its own share done: collects until every group has ended, calling `on_new(rows)`
        with new rows. A group that posts nothing for the group timeout is taken for gone."""
        last = time.monotonic()
        while True:
            if new := self.collect():
                last = time.monotonic()
                on_new(new)
            self.check_failure()
            if len(self.ended) == len(self.taken):
                return
            if time.monotonic() - last > self.timeout.total_seconds():
                missing = sorted(set(self.taken) - self.ended)
                raise DflashError(
                    f"tensor-parallel group(s) {missing} posted no prompt for {self.timeout}: a process of theirs is "
                    "gone or stuck; the report holds the prompts finished so far: rerun the launch with --resume"
                )
            time.sleep(0.2)
