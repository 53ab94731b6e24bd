"""Harvest throughput on the GPU: the real harvest pipeline (forward, device->host copy, compression, disk)
against the bare forward of the same target, measured in the same process.

The target has the Qwen3.5-27B-like shapes of shared/DEVICE.md (hidden 5120, FFN 17408, 24 / 4 heads of 256,
Gated-DeltaNet 48 value / 16 key heads of 128, 3 linear layers per full-attention layer) with random bf16
weights, built on the GPU. Only the layers up to the last tapped one exist, as in a real harvest. Documents are
random token ids, 3072 tokens each (DFlash's max length), packed 4 to a 12288-token row.

    python bench/harvest.py --layers 64 --groups 16         # full depth: the bar (a 34 GB store on disk)
    python bench/harvest.py --layers 8 --groups 6           # truncated depth: where writing becomes the limit

harvest/bare compares the whole pipeline run, from buffer allocation to the last commit, with the bare forward;
steady/bare leaves out the once-per-run parts a harvest of hours amortises (allocating the pinned buffers, the
last writes after the last forward), as timed by the pipeline itself (`harvest.PipelineStalls`, printed too).
At full depth those parts took 7 s (2026-11-29), so harvest/bare depends on the run's length: 89.3 % over 12
groups (70 s), 91.8 % over 16 (88 s; the whole call took 230 s), still short next to a real harvest of hours.

Dense MFU = 2 * (non-embedding parameters run) * tokens / time / 792 TFLOP/s (the bf16 matmul rate measured on
the machine); attention FLOPs are not counted, as in the baseline of shared/DEVICE.md.
"""

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from dflash import harvest, store
from dflash.data import Document
from dflash.target import TappedTarget, default_layer_ids

PEAK_FLOPS = 792e12


def qwen35_27b_like(num_layers: int):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=num_layers,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_value_heads=48,
        linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
    )  # fmt: skip


def build_target(num_layers: int, device: str) -> TappedTarget:
    from transformers import AutoModel

    config = qwen35_27b_like(num_layers)
    layer_ids = default_layer_ids(num_layers)
    config.num_hidden_layers = max(layer_ids) + 1  # a harvest never builds the layers after the last tap
    config.layer_types = config.layer_types[: config.num_hidden_layers]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModel.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return TappedTarget.from_model(model, layer_ids, num_layers=num_layers, name=f"qwen35-27b-like-{num_layers}L")


def documents(count: int, length: int, vocab: int) -> list[Document]:
    rng = np.random.default_rng(0)
    return [
        Document(i, 0, rng.integers(0, vocab, length, dtype=np.int32), np.ones(length, np.uint8)) for i in range(count)
    ]


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bare_forward(plan: harvest.PartPlan, target: TappedTarget, cfg: harvest.HarvestConfig, groups: int) -> float:
    """Seconds for the forward batches of `groups` row groups, features kept on the GPU and dropped."""
    rows_per_group = cfg.forward_tokens // cfg.token_budget

    def run():
        for g in range(groups):
            for batch in harvest.forward_batches(plan, g * rows_per_group, (g + 1) * rows_per_group, cfg.forward_tokens):
                ids = np.stack([plan.docs[d].input_ids for _, d in batch]).astype(np.int64)
                target.features(torch.from_numpy(ids).pin_memory().to(target.device, non_blocking=True))

    return timed(run)


def harvest_rows(plan, target, cfg, out: Path) -> tuple[float, harvest.PipelineStalls]:
    """Seconds for the real pipeline over every row of the plan, until the last row is committed on disk, and
    where its forward thread waited."""
    shutil.rmtree(out, ignore_errors=True)
    store.create_store(out, {"bench": True})
    part = store.PartWriter(out, store.PartSpec(
        0, len(plan.rows), cfg.token_budget, len(target.layer_ids) * target.info.hidden_size,
        plan.documents_table(), plan.counts(),
    ))  # fmt: skip
    stalls = []
    seconds = timed(lambda: stalls.append(harvest._run_rows(cfg, plan, target, part)))
    return seconds, stalls[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=64, help="target depth (the harvest runs up to the last tap)")
    parser.add_argument("--groups", type=int, default=8, help="row groups timed in the harvest")
    parser.add_argument("--doc-length", type=int, default=3072)
    parser.add_argument("--token-budget", type=int, default=12288)
    parser.add_argument("--forward-tokens", type=int, default=49152)
    parser.add_argument("--out", default="/tmp/dflash-bench-store")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    target = build_target(args.layers, "cuda")
    cfg = harvest.HarvestConfig(
        model="bench", data="bench", out=args.out, token_budget=args.token_budget, forward_tokens=args.forward_tokens,
        device="cuda", rank=0, world_size=1,
    )  # fmt: skip
    rows_per_group = args.forward_tokens // args.token_budget
    docs_per_row = args.token_budget // args.doc_length
    plan = harvest.PartPlan.build(
        documents((args.groups + 1) * rows_per_group * docs_per_row, args.doc_length, target.info.vocab_size),
        0, 1, args.token_budget,
    )  # fmt: skip
    params = sum(p.numel() for n, p in target.model.named_parameters() if "embed_tokens" not in n)
    group_tokens = rows_per_group * docs_per_row * args.doc_length

    warm = bare_forward(plan, target, cfg, 1)  # Triton autotuning happens here; never timed
    bare = bare_forward(plan, target, cfg, min(3, args.groups)) / (min(3, args.groups) * group_tokens)
    torch.cuda.reset_peak_memory_stats()
    seconds, stalls = harvest_rows(plan, target, cfg, Path(args.out))  # every row of the plan, all shapes already warm
    tokens = plan.counts()["tokens"]
    steady_s = seconds - stalls.setup_s - stalls.drain_s
    written = tokens * len(target.layer_ids) * target.info.hidden_size * 2
    on_disk = store.disk_bytes(Path(args.out))
    result = {
        "layers": args.layers, "layers_run": len(target.model.layers), "tapped": target.layer_ids,
        "params_run_B": params / 1e9, "kernels": target.kernels, "first_forward_s": warm,
        "bare_tok_s": 1 / bare, "bare_mfu": 2 * params / bare / PEAK_FLOPS,
        "harvest_tok_s": tokens / seconds, "harvest_mfu": 2 * params * tokens / seconds / PEAK_FLOPS,
        "harvest_vs_bare": (tokens / seconds) * bare, "tokens": tokens,
        # Without the once-per-run parts (buffer setup; the last groups' writes after the last forward), which a
        # harvest of hours amortises: the steady rate of the pipeline.
        "steady_tok_s": tokens / steady_s, "steady_vs_bare": (tokens / steady_s) * bare,
        "GB_s_features": written / seconds / 1e9, "compression_ratio": written / on_disk,
        "GB_s_disk": on_disk / seconds / 1e9, "peak_mem_GB": torch.cuda.max_memory_allocated() / 1e9,
        "codec": [c.to_dict() for c in store.hidden_compressors()], "harvest_s": seconds,
        "stalls": dataclasses.asdict(stalls),
    }  # fmt: skip
    shutil.rmtree(args.out, ignore_errors=True)
    print("\n| depth | layers run | bare tok/s | bare MFU | harvest tok/s | harvest MFU | harvest/bare | steady/bare | features GB/s | on-disk GB/s | ratio | peak GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    r = result
    print(
        f"| {r['layers']} | {r['layers_run']} | {r['bare_tok_s']:,.0f} | {100 * r['bare_mfu']:.1f} % | "
        f"{r['harvest_tok_s']:,.0f} | {100 * r['harvest_mfu']:.1f} % | {100 * r['harvest_vs_bare']:.1f} % | "
        f"{100 * r['steady_vs_bare']:.1f} % | "
        f"{r['GB_s_features']:.2f} | {r['GB_s_disk']:.2f} | {r['compression_ratio']:.3f} | {r['peak_mem_GB']:.1f} |"
    )
    print(f"harvest: {seconds:.1f} s, {stalls.describe()}")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
