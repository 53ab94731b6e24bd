"""The harvest's packing plan: which document goes to which rank, row and offset, fixed before any forward by a
deterministic first-fit-decreasing packing of whole documents into rows of the token budget, and the forward
batches of a run of rows (documents sorted by length, one per batch row, right-padded to a multiple of 64). The
store's arrays are preallocated from it, so a rerun resumes after the committed rows.
"""

import itertools
from dataclasses import dataclass, field

import numpy as np

from dflash import manifest, store
from dflash.data import Document

PAD_MULTIPLE = 64  # forward lengths are rounded up to this: few distinct shapes for the kernels


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of item indices: items longest first (ties by index), each into the first row with room.

    A max-tree over the free space of rows finds the first row with room in O(log n). Items of one length come
    one after another, so a row found takes as many of them as fit at once; and all rows past the used ones are
    empty, so once a run of one length reaches them, the rest of the run fills new rows in bulk.
    """
    longest = max(lengths, default=0)
    if longest > capacity:
        raise ValueError(f"an item of {longest} does not fit a row of {capacity}")
    size = 1
    while size < len(lengths):
        size *= 2
    free = [capacity] * (2 * size)  # node i holds the largest free space below it; leaves are rows
    rows: list[list[int]] = []
    order = np.argsort(-np.asarray(lengths, np.int64), kind="stable").tolist()
    for length, group in itertools.groupby(order, key=lengths.__getitem__):
        run, placed = list(group), 0
        per_row = capacity // length if length else len(run)  # items of this length an empty row takes
        while placed < len(run):
            node = 1
            while node < size:
                node = 2 * node if free[2 * node] >= length else 2 * node + 1
            row = node - size
            if row == len(rows):  # the first unused row
                new = [run[i : i + per_row] for i in range(placed, len(run), per_row)]
                rows.extend(new)
                _set_free(free, size, row, [capacity - length * len(items) for items in new])
                break
            take = min(len(run) - placed, free[node] // length if length else len(run))
            rows[row].extend(run[placed : placed + take])
            placed += take
            _set_free(free, size, row, [free[node] - take * length])
    return rows


def _set_free(free: list[int], size: int, first_row: int, values: list[int]) -> None:
    """Set the free space of rows first_row.. and update their ancestors, one level at a time, up to the level
    where nothing changes."""
    lo = size + first_row
    hi = lo + len(values)
    free[lo:hi] = values
    while lo > 1:
        lo, hi = lo // 2, (hi - 1) // 2 + 1
        changed = False
        for node in range(lo, hi):
            largest = max(free[2 * node], free[2 * node + 1])
            changed |= largest != free[node]
            free[node] = largest
        if not changed:
            return


@dataclass
class PartPlan:
    """One rank's documents packed into rows; starts[r][k] is the offset of document rows[r][k] in row r."""

    docs: list[Document]
    rows: list[list[int]]
    token_budget: int
    starts: list[list[int]] = field(init=False)

    def __post_init__(self):
        # Whole-plan numpy arrays, not Python loops per document: a resume replans a million documents fast.
        self.lengths = np.fromiter((len(d.input_ids) for d in self.docs), np.int64, len(self.docs))
        sizes = np.fromiter(map(len, self.rows), np.int64, len(self.rows))
        firsts = np.cumsum(sizes) - sizes  # each row's first position in the documents in row order, `_flat`
        self._flat = np.fromiter(itertools.chain.from_iterable(self.rows), np.int64, int(sizes.sum()))
        self._flat_rows = np.repeat(np.arange(len(self.rows)), sizes)
        before = np.cumsum(self.lengths[self._flat]) - self.lengths[self._flat]  # tokens before, over all rows
        used = sizes > 0
        self._flat_starts = before - np.repeat(before[firsts[used]], sizes[used])
        starts = self._flat_starts.tolist()
        self.starts = [starts[first : first + n] for first, n in zip(firsts.tolist(), sizes.tolist())]
        self._counts: dict | None = None

    @classmethod
    def build(cls, documents: list[Document], rank: int, world_size: int, token_budget: int) -> "PartPlan":
        docs = documents[rank::world_size]  # document i goes to rank i % world_size
        return cls(docs, first_fit_decreasing([len(d.input_ids) for d in docs], token_budget), token_budget)

    def documents_table(self) -> np.ndarray:
        doc_ids = np.fromiter((d.doc_id for d in self.docs), np.int64, len(self.docs))
        pieces = np.fromiter((d.piece for d in self.docs), np.int64, len(self.docs))
        f = self._flat
        return np.stack([doc_ids[f], pieces[f], self._flat_rows, self._flat_starts, self.lengths[f]], axis=1)

    def counts(self) -> dict:
        if self._counts is None:  # asked for by the part's spec, the log line and the progress bar
            tokens = int(self.lengths.sum())
            self._counts = {
                "documents": len(self.docs),
                "tokens": tokens,
                "loss_tokens": int(sum(map(np.count_nonzero, (d.loss_mask for d in self.docs)))),  # masks are 0 / 1
                "padding_tokens": len(self.rows) * self.token_budget - tokens,
            }
        return dict(self._counts)

    def token_arrays(self, first: int, last: int) -> dict[str, np.ndarray]:
        """The per-token arrays of rows [first, last); padding has doc id -1 and everything else 0."""
        n, T = last - first, self.token_budget
        arrays = {name: np.zeros((n, T), dtype) for name, dtype in store.TOKEN_ARRAYS.items()}
        arrays["doc_ids"][:] = -1
        for r in range(first, last):
            for d, start in zip(self.rows[r], self.starts[r]):
                doc, span = self.docs[d], slice(start, start + len(self.docs[d].input_ids))
                arrays["input_ids"][r - first, span] = doc.input_ids
                arrays["position_ids"][r - first, span] = np.arange(len(doc.input_ids))
                arrays["doc_ids"][r - first, span] = doc.doc_id
                arrays["loss_mask"][r - first, span] = doc.loss_mask
        return arrays

    def part_spec(
        self, rank: int, features: manifest.FeatureSpec, teacher: manifest.TeacherSpec | None = None
    ) -> store.PartSpec:
        """What the store's part of this plan holds, fixed before any forward."""
        return store.PartSpec(
            rank, len(self.rows), self.token_budget, features, self.documents_table(), self.counts(), teacher
        )

    def row_tokens(self, first: int, last: int) -> int:
        return sum(len(self.docs[d].input_ids) for row in self.rows[first:last] for d in row)


def forward_batches(plan: PartPlan, first: int, last: int, forward_tokens: int) -> list[list[tuple[int, int]]]:
    """(row, document) pairs of rows [first, last) in batches of similar length: batch x padded length <= budget."""
    items = [(r, d) for r in range(first, last) for d in plan.rows[r]]
    items.sort(key=lambda rd: -len(plan.docs[rd[1]].input_ids))
    batches: list[list[tuple[int, int]]] = []
    for item in items:
        if batches:
            width = batch_shape(plan, batches[-1])[1]
            if (len(batches[-1]) + 1) * width <= forward_tokens:
                batches[-1].append(item)
                continue
        batches.append([item])
    return batches


def batch_shape(plan: PartPlan, batch: list[tuple[int, int]]) -> tuple[int, int]:
    """(documents, padded length) of a batch of forward_batches: its first document is its longest."""
    return len(batch), round_up(len(plan.docs[batch[0][1]].input_ids), PAD_MULTIPLE)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
