"""Feature encodings of the compact store: a fixed subspace (P h) and FP8 values with power-of-two scales.

Both run on the device that holds the features: the harvest encodes each row group on the GPU before its copy
to the host, and the trainer decodes inside its captured step, so only the compact bytes cross PCIe.

FP8: each token's stored vector is cut into `groups` equal slices; a slice of amax a gets the scale 2**e with
e = ceil(log2(a / 448)), so its largest value lands in (224, 448]: the top binade of float8 e4m3fn, or the top
of the one below (224, 240). Decoding multiplies by 2**e, which is exact, so the only error is e4m3's rounding: at
most 2**-4 of a value (3 mantissa bits, round to nearest even) for scaled values of at least 2**-6, and
2**-10 * 2**e below that (subnormals): about 2**-14 of the slice's largest value.

Subspace: P [k, n*H] holds the top-k eigenvectors of the uncentered second moment E[h h^T] of the target's own
features; the store holds P h, the trainer lifts it back to P^T P h for a full-width fc, and the export folds
fc <- fc P^T P, so at inference the drafter computes from full features exactly what it saw in training. What is
lost is the energy of h outside the subspace.

Teacher top-k (`--teacher topk:K`): the target's next-token distribution reduced to its K most probable tokens
and the mass of the rest, computed on the device a chunk of tokens at a time, so that the [tokens x vocab] logits
of a whole batch never exist at once.
"""

import math

import torch

from dflash.topk import vocab_top_k

E4M3_MAX = 448.0
LOGITS_BYTES = 512 << 20  # float32 logits of one chunk of tokens in next_token_top_k
SCALE_MIN, SCALE_MAX = -127, 127  # the int8 exponents a scale may take


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., W] -> (uint8 [..., W] float8 e4m3fn bits, int8 [..., groups] exponents)."""
    grouped = x.float().unflatten(-1, (groups, x.shape[-1] // groups))
    amax = grouped.abs().amax(-1)
    # A slice of zeros (padding) gets the smallest exponent; its values stay 0.
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(SCALE_MIN, SCALE_MAX)
    scaled = (grouped * torch.exp2(-exponent).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    bits = scaled.to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)
    return bits, exponent.to(torch.int8)


def dequantize_fp8(bits: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_fp8` up to e4m3 rounding: uint8 [..., W] and int8 [..., G] -> dtype [..., W]."""
    groups = exponents.shape[-1]
    values = bits.view(torch.float8_e4m3fn).float().unflatten(-1, (groups, bits.shape[-1] // groups))
    return (values * torch.exp2(exponents.float()).unsqueeze(-1)).flatten(-2).to(dtype)


def fp8_error_bound(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The largest error quantize-dequantize may make on each value of x (float64): see the module docstring."""
    grouped = x.double().unflatten(-1, (groups, x.shape[-1] // groups))
    amax = grouped.abs().amax(-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(SCALE_MIN, SCALE_MAX)
    bound = torch.maximum(grouped.abs() * 2.0**-4, torch.exp2(exponent - 10).expand_as(grouped))
    return bound.flatten(-2)


class SecondMoment:
    """Accumulates the uncentered second moment sum(h h^T) of feature vectors on their device: float64 on the
    CPU, float32 on a GPU (matmul rate; the sum of a few hundred thousand outer products loses ~1e-6)."""

    def __init__(self, width: int, device: torch.device):
        dtype = torch.float64 if device.type == "cpu" else torch.float32
        self.sum = torch.zeros(width, width, dtype=dtype, device=device)
        self.tokens = 0

    def add(self, h: torch.Tensor) -> None:
        """h [n, W]: n feature vectors (padding excluded by the caller)."""
        h = h.to(self.sum.dtype)
        self.sum.addmm_(h.T, h)
        self.tokens += h.shape[0]


def top_subspace(moment: torch.Tensor, width: int) -> tuple[torch.Tensor, float]:
    """(P [width, W] float32 with orthonormal rows, share of the trace inside): the top eigenvectors of `moment`.

    Eigenvectors are defined up to sign; each row is flipped so that its largest-magnitude entry is positive,
    which makes P a function of the moment matrix alone.
    """
    values, vectors = torch.linalg.eigh(moment.double())  # ascending; on the moment's device (GPU: seconds at 25600)
    top = vectors[:, -width:].flip(-1).T.contiguous()  # [width, W], largest eigenvalue first
    signs = torch.sign(top.gather(1, top.abs().argmax(1, keepdim=True)))
    top = top * signs
    total = values.clamp_min(0).sum().item()
    captured = values[-width:].clamp_min(0).sum().item() / total if total > 0 else 1.0
    return top.float().cpu(), captured


def project(features: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """features [..., n*H] -> [..., k] = P h, computed in the features' dtype (bf16 on the GPU: tensor cores)."""
    return features @ projection.to(features.dtype).T


def default_scale_groups(features_width: int, num_layers: int, subspace: bool) -> int:
    """One scale per token and tapped layer for full features (each layer's outliers stay its own); one per
    token for a subspace, whose coordinates mix every layer."""
    return 1 if subspace else math.gcd(features_width, num_layers)


def next_token_top_k(final: torch.Tensor, lm_head: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """final [N, H] (the final-normed hidden state), lm_head [V, H] -> the top-k of softmax(lm_head(final)):
    (float32 probabilities [N, k] largest first, int64 ids [N, k], float32 tail mass [N]).

    The logits are the LM head's in the target's dtype (what the target samples from), normalised in float32.
    The tail is the log-sum-exp of the other tokens' log-probabilities, not 1 - sum, which cancels to noise when
    the top k hold almost all the mass."""
    chunk = max(1, LOGITS_BYTES // (4 * lm_head.shape[0]))
    probs, ids, tails = [], [], []
    for h in final.split(chunk):
        logp = torch.nn.functional.linear(h, lm_head).float()
        logp -= logp.logsumexp(-1, keepdim=True)
        top, index = vocab_top_k(logp, k)
        probs.append(top.exp())
        ids.append(index)
        tails.append(logp.scatter_(-1, index, float("-inf")).logsumexp(-1).exp())
    return torch.cat(probs), torch.cat(ids), torch.cat(tails)
