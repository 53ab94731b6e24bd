"""The harvest's forwards against the GPU's memory: the part's largest batch runs first when a later row group holds
it (dflash.harvest.pipeline.probe_largest_forward), and an out-of-memory error of a forward names what to change."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash.data import Document
from dflash.errors import DflashError
from dflash.harvest.pipeline import forward_fits, probe_largest_forward
from dflash.packing import PartPlan, batch_shape, forward_batches


class RecordingTarget:
    """TappedTarget's forward interface: records each batch's shape; out of memory past `limit` tokens."""

    def __init__(self, limit: int | None = None):
        self.info = SimpleNamespace(vocab_size=100)
        self.device = torch.device("cpu")
        self.shapes, self.limit = [], limit

    def forward(self, ids: torch.Tensor):
        self.shapes.append(tuple(ids.shape))
        if self.limit is not None and ids.numel() > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return None, None


def plan_of(lengths: list[int], budget: int) -> PartPlan:
    docs = [Document(i, 0, np.ones(n, np.int32), np.ones(n, np.uint8)) for i, n in enumerate(lengths)]
    return PartPlan.build(docs, 0, 1, budget)


def groups_of(plan: PartPlan, rows_per_group: int) -> list[tuple[int, int]]:
    return [(r, min(r + rows_per_group, len(plan.rows))) for r in range(0, len(plan.rows), rows_per_group)]


def largest_batch(plan: PartPlan, groups, forward_tokens: int) -> tuple[int, int]:
    """By brute force: every batch of every group, the most padded tokens, then the longest."""
    shapes = [batch_shape(plan, b) for g in groups for b in forward_batches(plan, *g, forward_tokens)]
    return max(shapes, key=lambda s: (s[0] * s[1], s[1]))


def test_a_later_group_s_larger_batch_runs_first_and_the_first_group_s_largest_is_not_repeated():
    # Packed longest first: row 0 holds the 600-token document alone in its forward (640 padded tokens) and seven
    # of 60; row 1 holds seventeen of 60, sixteen of which share a forward of 1024 padded tokens.
    plan = plan_of([600] + [60] * 24, budget=1024)
    groups = groups_of(plan, 1)
    target = RecordingTarget()
    probe_largest_forward(plan, groups, 1024, target)
    assert target.shapes == [(16, 64)] == [largest_batch(plan, groups, 1024)]

    target = RecordingTarget()
    probe_largest_forward(plan, groups_of(plan, 2), 1024, target)  # one group holds both rows: nothing to probe
    assert target.shapes == []


def test_a_probe_out_of_memory_is_refused_naming_forward_tokens():
    plan = plan_of([600] + [60] * 24, budget=1024)
    with pytest.raises(
        DflashError,
        match=r"forward of 16 documents of up to 64 tokens .*rerun with a lower --forward-tokens \(now 1024\)",
    ):
        probe_largest_forward(plan, groups_of(plan, 1), 1024, RecordingTarget(limit=640))


def test_one_document_too_long_names_tensor_parallel_and_max_length():
    with pytest.raises(DflashError) as info:
        with forward_fits((1, 262144), 32768, torch.device("cpu")):
            raise torch.OutOfMemoryError("CUDA out of memory")
    message = str(info.value)
    assert "one document of 262144 tokens ran out of memory" in message
    assert "--tensor-parallel under torchrun (the rows committed so far are kept" in message
    assert "a new --out with a --max-length below 262144" in message
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


def test_other_errors_pass_through_unchanged():
    with pytest.raises(ValueError, match="not memory"):
        with forward_fits((2, 64), 1024, torch.device("cpu")):
            raise ValueError("not memory")
