"""Cold-compile time of the trainer's BlockMask builder (blocks.block_attention_mask), with inductor's default
options and with blocks.MASK_COMPILE_OPTIONS, at the quality run's shape and at bench/train.py's.

Each case runs in a fresh process with empty inductor and Triton caches, so every compile is cold, and under a
time limit (a case that hits it is reported as "> limit"). Per case: seconds to the first mask (compile
included), then the mean time of a built mask over 20 more calls, and whether the mask equals the uncompiled
create_block_mask's (its dense form).

    source bench/device_setup.sh && python3 bench/mask_compile.py --json $OUT/mask_compile.json
    .venv/bin/python bench/mask_compile.py --device cpu --limit 120    # CPU: checks the script
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # rows per step, token budget, anchors per row (block size 16)
    "quality": (2, 4096, 683),  # bench/quality: 86 query x 118 key tiles of 128 (172 x 235 of 64, the default)
    "train-a": (1, 12288, 2048),  # bench/train.py: 256 query x 352 key tiles of 128 (512 x 704 of 64)
}


def run_case(shape: str, tuned: bool, device: str) -> dict:
    import torch

    from dflash.drafter import blocks, graph

    rows, T, A = SHAPES[shape]
    doc_ids = (torch.arange(T, device=device) // 700).int().expand(rows, T).contiguous()  # documents of 700
    loss_mask = torch.ones(rows, T, dtype=torch.int32, device=device)
    anchors, valid = blocks.sample_anchors(loss_mask, doc_ids, A, 16, torch.Generator(device).manual_seed(0))
    options = blocks.MASK_COMPILE_OPTIONS if tuned else None
    build = graph.compile_fn(blocks.block_attention_mask, True, options=options)

    def synced(fn):
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    start = time.perf_counter()
    mask = synced(lambda: build(anchors, valid, doc_ids, 16))
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(20):
        synced(lambda: build(anchors, valid, doc_ids, 16))
    build_ms = (time.perf_counter() - start) / 20 * 1e3
    reference = blocks.block_attention_mask(anchors, valid, doc_ids, 16)
    equal = bool(torch.equal(mask.to_dense(), reference.to_dense()))
    return {"first_call_s": round(first_s, 1), "build_ms": round(build_ms, 3), "equals_eager": equal}


def spawn(shape: str, tuned: bool, device: str, limit: float) -> dict:
    """One case in a fresh process with its own empty compile caches."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor", TRITON_CACHE_DIR=f"{cache}/triton")
        cmd = [sys.executable, __file__, "--case", shape, "--device", device] + (["--tuned"] if tuned else [])
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return {"first_call_s": None, "timed_out_after_s": round(time.perf_counter() - start)}
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--limit", type=float, default=150.0, help="seconds a case may take before it is cut")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    parser.add_argument("--tuned", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.case:
        print(json.dumps(run_case(args.case, args.tuned, args.device)))
        return

    import torch

    results = []
    print(f"{'shape':<9} {'options':<34} {'first call s':>12} {'build ms':>9} {'= eager':>8}")
    for shape in args.shapes.split(","):
        for tuned in (False, True):
            r = spawn(shape, tuned, args.device, args.limit)
            options = "MASK_COMPILE_OPTIONS" if tuned else "inductor defaults"
            results.append({"shape": shape, "rows_tokens_anchors": SHAPES[shape], "options": options, **r})
            first = r.get("first_call_s") or f"> {r.get('timed_out_after_s')}" if "error" not in r else r["error"]
            print(
                f"{shape:<9} {options:<34} {str(first):>12} {str(r.get('build_ms', '-')):>9} "
                f"{str(r.get('equals_eager', '-')):>8}",
                flush=True,
            )
    if args.json:
        from bench.train_report import versions

        meta = {**versions(torch.device(args.device)), "limit_s": args.limit}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
