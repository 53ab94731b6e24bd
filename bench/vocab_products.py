"""DSpark's products over the vocabulary on the GPU, one loss chunk's worth: each [c, V] product its loss makes
(dflash.methods.distill._TeacherHeadLoss) timed alone at several chunk sizes, next to the joint [head | W2] forms that
would read the [c, V] operand once (issue 23; the loss now takes the joint forward, after this script and
bench/step_profile.py's per-shape table: docs/benchmarks.md, "Drafter methods").

    source bench/device_setup.sh && python3 bench/vocab_products.py        # on the H200
    python bench/vocab_products.py --tiny                                  # toy shapes on the CPU: checks the script

Rows c: 1022 is the trainer's default chunk for DSpark at V = 248320 (half of dflash.drafter.loss.default_chunk_size,
cut to whole blocks of 7), 1024 the same without the cut, 896 and 1792 multiples of both 7 and 128, 2044 the 2048-row
chunk cut to blocks. Each row: ms per call (mean of --reps after one warm-up call) and TFLOP/s (2 x the product's
multiply-adds); the joint rows also say how far their result is from the separate products' (it must be rounding).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's dflash

from bench.topk import ms_per_call  # noqa: E402


def products(h, e, head, w2, grad_z, joint_weight) -> dict:
    """name -> (the call, multiply-adds per call, what the separate products give for a joint form, else None)."""
    (c, H), r, V = h.shape, e.shape[1], head.shape[0]
    joint_input = torch.cat([h, e], dim=1)
    logits = (h @ head.T).addmm_(e, w2.T)
    grads = torch.cat([grad_z @ head, grad_z @ w2], dim=1)
    return {
        "z = h @ head.T": (lambda: h @ head.T, c * H * V, None),
        "z = h @ head.T, then += e @ W2.T (addmm_)": (lambda: (h @ head.T).addmm_(e, w2.T), c * (H + r) * V, None),
        "z = [h, e] @ [head, W2].T (joint)": (lambda: joint_input @ joint_weight.T, c * (H + r) * V, logits),
        "grad h = grad z @ head": (lambda: grad_z @ head, c * V * H, None),
        "grad e = grad z @ W2": (lambda: grad_z @ w2, c * V * r, None),
        "grad W2 = grad z.T @ e": (lambda: grad_z.T @ e, c * V * r, None),
        "[grad h, grad e] = grad z @ [head, W2] (joint)": (lambda: grad_z @ joint_weight, c * V * (H + r), grads),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1022,1024,896,1792,2044", help="chunk sizes c, comma-separated")
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--hidden", type=int, default=2560, help="the 4B-class drafter's (bench/train.py's b)")
    parser.add_argument("--rank", type=int, default=256, help="the Markov head's rank r")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="chunks of 100 and 128 rows of a 4096 vocabulary, CPU")
    args = parser.parse_args()
    if args.tiny:
        args.rows, args.vocab, args.hidden, args.rank, args.reps = "100,128", 4096, 64, 16, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype) * scale

    V, H, r = args.vocab, args.hidden, args.rank
    head, w2 = randn(V, H, scale=0.02), randn(V, r, scale=0.02)
    joint_weight = torch.cat([head, w2], dim=1)
    print(f"V = {V}, H = {H}, r = {r}, {str(dtype).removeprefix('torch.')}, {device}")
    print("| rows c | product | ms per call | TFLOP/s | joint vs separate (max abs) |\n|---|---|---|---|---|")
    for c in (int(s) for s in args.rows.split(",")):
        h, e, grad_z = randn(c, H), randn(c, r), randn(c, V, scale=1e-4)
        for name, (fn, macs, separate) in products(h, e, head, w2, grad_z, joint_weight).items():
            ms = ms_per_call(fn, args.reps, device)
            gap = "-" if separate is None else f"{(fn() - separate).abs().max().item():.2e}"
            print(f"| {c} | {name} | {ms:.3f} | {2 * macs / ms / 1e9:,.0f} | {gap} |")


if __name__ == "__main__":
    main()
