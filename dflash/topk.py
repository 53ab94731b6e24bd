"""Top-k over a vocabulary-wide last dimension: exact, and several times faster than torch.topk there.

On the H200, torch.topk of 16 over 2048 rows of 248320 bf16 logits takes 3.7 ms, longer than the LM-head matmul
that made them (3.3 ms); DFlash 2's candidates took 59 ms of its 503 ms train step that way (docs/benchmarks.md).
`vocab_top_k` takes 0.9 ms: it cuts each row into segments of `segment` columns, keeps the k segments with the
largest maxima and the columns past the last whole segment, and takes the top-k of those. It is exact: if t is the
row's k-th largest value, fewer than k values exceed t, so fewer than k segments have a maximum above t and all of
them are kept, and the kept segments whose maximum equals t hold at least as many values equal to t as the top-k
needs. Among tied values the ids chosen may differ from torch.topk's (which leaves that choice unspecified too).
"""

from typing import NamedTuple

import torch
from torch import Tensor

SEGMENT = 512  # the fastest of 64..1024 for k = 16 over 248320 columns on the H200


def vocab_top_k(x: Tensor, k: int, segment: int = SEGMENT) -> tuple[Tensor, Tensor]:
    """(values [N, k] largest first, int64 ids [N, k]) of x [N, V] along its last dimension."""
    n, v = x.shape
    whole = v - v % segment
    if whole // segment <= k:  # too few segments to skip any
        return x.topk(k, dim=-1)
    return _top_k_of_segments(x, x[:, :whole].view(n, whole // segment, segment).amax(dim=-1), k, segment)


class VocabReductions(NamedTuple):
    lse: Tensor  # [N] logsumexp in math_dtype
    argmax: Tensor  # [N] int64, the first index of the row's maximum (as torch.argmax)
    values: Tensor  # [N, k] vocab_top_k's
    ids: Tensor  # [N, k]


def vocab_reductions(x: Tensor, k: int, math_dtype: torch.dtype, segment: int = SEGMENT) -> VocabReductions:
    """logsumexp, argmax and top-k of x [N, V] from one read of it.

    Per segment, one pass gives its maximum, its sum of exp(x - maximum) and its first argmax (the columns past
    the last whole segment are one more segment); the row's logsumexp, argmax and vocab_top_k's kept segments
    follow from those [N, V / segment] values. Compiled, the three reductions over V are one kernel instead of
    three passes over the logits."""
    n, v = x.shape
    whole = v - v % segment
    if whole // segment <= k:
        values, ids = x.topk(k, dim=-1)
        return VocabReductions(x.to(math_dtype).logsumexp(dim=-1), x.argmax(dim=-1), values, ids)
    parts = [x[:, :whole].view(n, whole // segment, segment)]
    if whole < v:
        parts.append(x[:, whole:, None].transpose(1, 2))  # [N, 1, V - whole]
    maxima = torch.cat([p.amax(dim=-1) for p in parts], dim=1)
    sums = torch.cat([(p.to(math_dtype) - p.amax(dim=-1, keepdim=True).to(math_dtype)).exp().sum(-1) for p in parts], 1)
    local = torch.cat([p.argmax(dim=-1) for p in parts], dim=1)
    best = maxima.argmax(dim=-1, keepdim=True)  # the first segment holding the maximum holds its first index
    argmax = (best * segment + local.gather(1, best))[:, 0]
    lse = (maxima.to(math_dtype) + sums.log()).logsumexp(dim=-1)
    values, ids = _top_k_of_segments(x, maxima[:, : whole // segment], k, segment)
    return VocabReductions(lse, argmax, values, ids)


def _top_k_of_segments(x: Tensor, maxima: Tensor, k: int, segment: int) -> tuple[Tensor, Tensor]:
    """The top-k of x [N, V] from its whole segments' maxima [N, S]: the columns of the k segments with the
    largest maxima and those past the last whole segment (the module docstring says why that is exact)."""
    n, v = x.shape
    whole = maxima.shape[1] * segment
    kept = maxima.topk(k, dim=-1).indices
    columns = (kept[:, :, None] * segment + torch.arange(segment, device=x.device)).view(n, k * segment)
    if whole < v:
        columns = torch.cat([columns, torch.arange(whole, v, device=x.device).expand(n, v - whole)], dim=1)
    values, picked = x.gather(1, columns).topk(k, dim=-1)
    return values, columns.gather(1, picked)
