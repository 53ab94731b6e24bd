"""Top-k over the vocabulary on the GPU: torch.topk against dflash.topk.vocab_top_k at several segment sizes, on
the logits of DFlash 2's loss chunk (2048 rows x 248320 bf16, k = 16), next to the LM-head matmul that makes them.

    source bench/device_setup.sh && python3 bench/topk.py          # on the H200
    python bench/topk.py --tiny                                    # toy shapes on the CPU: checks the script

Prints one row per way: ms per call (mean of --reps after one warm-up call, eager and compiled) and whether its
values equal torch.topk's (they must: vocab_top_k is exact; ids may differ among tied values).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's dflash

from bench.harvest import timed  # noqa: E402
from dflash.topk import vocab_top_k  # noqa: E402


def ms_per_call(fn, reps: int, device: torch.device) -> float:
    fn()  # warm-up (and the compile of a compiled way)
    return 1000 * timed(lambda: [fn() for _ in range(reps)], device) / reps


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--segments", default="64,128,256,512,1024")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="256 rows of 8192 on the CPU")
    args = parser.parse_args()
    if args.tiny:
        args.rows, args.vocab, args.hidden, args.reps = 256, 8192, 64, 3
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, generator=g, device=device, dtype=dtype)
    head = torch.randn(args.vocab, args.hidden, generator=g, device=device, dtype=dtype) * 0.02
    logits = hidden @ head.T
    reference = logits.topk(args.k, dim=-1).values

    print(f"{args.rows} x {args.vocab} {str(dtype).removeprefix('torch.')} logits, k = {args.k}, {device}")
    print("| way | ms per call | values equal torch.topk's |\n|---|---|---|")
    print(f"| LM-head matmul that makes them | {ms_per_call(lambda: hidden @ head.T, args.reps, device):.3f} | - |")
    print(f"| torch.topk | {ms_per_call(lambda: logits.topk(args.k, dim=-1), args.reps, device):.3f} | yes |")
    for segment in (int(s) for s in args.segments.split(",")):
        ways = {"eager": lambda s=segment: vocab_top_k(logits, args.k, s)}
        if device.type == "cuda":
            ways["compiled"] = torch.compile(ways["eager"])
        for how, fn in ways.items():
            same = torch.equal(fn()[0], reference)
            print(
                f"| vocab_top_k, segment {segment}, {how} | {ms_per_call(fn, args.reps, device):.3f} | {'yes' if same else 'NO'} |"
            )


if __name__ == "__main__":
    main()
