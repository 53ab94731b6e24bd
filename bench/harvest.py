"""Harvest throughput on the GPU: the real harvest pipeline (forward, device->host copy, compression, disk)
against the bare forward of the same target, measured in the same process; under torchrun, on every GPU at once.

The target (--target) has random bf16 weights, built on the GPU: `dense`, the Qwen3.5-27B-like shapes of
shared/DEVICE.md (hidden 5120, FFN 17408, 24 / 4 heads of 256, Gated-DeltaNet 48 value / 16 key heads of 128, 3
linear layers per full-attention layer); `moe`, Qwen3-Next-80B-A3B's shapes (hidden 2048, 16 / 2 heads of 256,
Gated-DeltaNet 32 value / 16 key heads of 128, 512 experts of 512 with 10 routed per token and a shared expert
of 512, 3 linear layers per full one), its experts run by --experts (auto: what the harvest picks, grouped_mm on
an H200). Only the layers up to the last tapped one exist, as in a real harvest. Documents are random token
ids, 3072 tokens each (DFlash's max length; --doc-length), packed 4 to a 12288-token row.

    python bench/harvest.py --layers 64 --groups 16         # full depth: the bar (a 34 GB store on disk)
    python bench/harvest.py --layers 8 --groups 6           # truncated depth: where writing becomes the limit
    python bench/harvest.py --target moe --layers 8 --groups 32  # the MoE harvest against its bare forward (~23 GB on disk)
    python bench/harvest.py --target moe --layers 8 --groups 2 --experts eager   # transformers' slow experts path
    python bench/harvest.py --tiny                          # toy shapes on the CPU: checks the script
    python bench/harvest.py --tiny --target moe             # the MoE one on the CPU (tiny Qwen3-Next)

Long documents (issue 24's bar: harvest/bare >= 90 % at 32768-token documents, full depth), one document a row:

    python bench/harvest.py --layers 64 --groups 8 --doc-length 32768 --token-budget 32768 --forward-tokens 65536
    python bench/harvest.py --tiny --doc-length 384 --token-budget 384  # the same layout on the CPU

Several GPUs (weak scaling: every rank harvests as many rows as the one-GPU run, into its own part of one store,
from its own GPU cuda:LOCAL_RANK; ranks start each timed phase together, sharing the host's disk and cores):

    python bench/harvest.py --layers 16 --groups 6 --json one.json
    torchrun --standalone --nproc-per-node 2 bench/harvest.py --layers 16 --groups 6 --compare-to one.json
    torchrun --standalone --nproc-per-node 2 bench/harvest.py --tiny     # the same on the CPU (gloo)

Rank 0 prints one table row per rank and one for all of them: tok/s and GB/s summed, MFU averaged, the peak
memory of the fullest GPU. --compare-to names the JSON of a one-GPU run of the same shapes and prints the scaling
efficiency: tok/s per GPU at N ranks / tok/s of the one-GPU run, for the bare forward and for the harvest.

harvest/bare compares the whole pipeline run, from buffer allocation to the last commit, with the bare forward;
steady/bare leaves out the once-per-run parts a harvest of hours amortises (allocating the pinned buffers, the
last writes after the last forward), as timed by the pipeline itself (`harvest.PipelineStalls`, printed too).
Those parts take seconds whatever the run's length, so harvest/bare rises with --groups; measured values are in
docs/benchmarks.md.

MFU = 2 * (active non-embedding parameters run) * tokens / time / 792 TFLOP/s (the bf16 matmul rate measured on
the machine); attention FLOPs are not counted, as in the baseline of shared/DEVICE.md. An MoE's routed experts
count for the share of them a token runs (num_experts_per_tok / num_experts), its router and shared expert whole.
"""

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's dflash

from bench.ranks import gather_ranks  # noqa: E402
from dflash import features, harvest, packing, store  # noqa: E402
from dflash.config import EXPERTS_IMPLEMENTATIONS, HarvestConfig  # noqa: E402
from dflash.data import Document  # noqa: E402
from dflash.manifest import Manifest, TargetSpec, TokenizerSpec  # noqa: E402
from dflash.target import TappedTarget, default_layer_ids  # noqa: E402
from dflash.tiny import tiny_config  # noqa: E402
from dflash.train.setup import Env, init_distributed  # noqa: E402

PEAK_FLOPS = 792e12
TINY = dict(layers=8, groups=2, doc_length=96, token_budget=384, forward_tokens=768, out="/tmp/dflash-bench-store-tiny")
SHAPE_KEYS = (
    "target",
    "layers",
    "groups",
    "doc_length",
    "token_budget",
    "forward_tokens",
)  # equal for a scaling comparison
HEADER = (
    "| depth | layers run | bare tok/s | bare MFU | harvest tok/s | harvest MFU | harvest/bare | steady/bare "
    "| features GB/s | on-disk GB/s | raw bf16 / disk | peak GB |"
)


def qwen35_27b_like(num_layers: int):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=num_layers,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_value_heads=48,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
    )


def qwen3_next_80b_a3b_like(num_layers: int):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_value_heads=32,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
    )


# --target: (the tiny architecture of --tiny, the real shapes, the name)
TARGETS = {
    "dense": ("qwen3_5", qwen35_27b_like, "qwen35-27b-like"),
    "moe": ("qwen3_next", qwen3_next_80b_a3b_like, "qwen3-next-80b-a3b-like"),
}


def build_target(kind: str, num_layers: int, device: torch.device, tiny: bool, experts: str) -> TappedTarget:
    from transformers import AutoModel

    tiny_arch, real_shapes, real_name = TARGETS[kind]
    config = tiny_config(tiny_arch, 1024, num_layers) if tiny else real_shapes(num_layers)
    layer_ids = default_layer_ids(num_layers)
    config.num_hidden_layers = max(layer_ids) + 1  # a harvest never builds the layers after the last tap
    config.layer_types = config.layer_types[: config.num_hidden_layers]
    torch.manual_seed(0)
    with device:
        model = AutoModel.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    name = f"{f'tiny-{tiny_arch}' if tiny else real_name}-{num_layers}L"
    return TappedTarget.from_model(model, layer_ids, num_layers=num_layers, name=name, experts=experts)


def active_parameters(model: torch.nn.Module) -> float:
    """Non-embedding parameters one token runs through: a routed expert's weights count for the share of the
    experts a token is routed to (the router and a shared expert run whole)."""
    config = model.config
    routed = getattr(config, "num_experts_per_tok", 1) / getattr(config, "num_experts", 1)
    return sum(
        p.numel() * (routed if ".experts." in name else 1)
        for name, p in model.named_parameters()
        if "embed_tokens" not in name
    )


def documents(count: int, length: int, vocab: int) -> list[Document]:
    rng = np.random.default_rng(0)
    return [
        Document(i, 0, rng.integers(0, vocab, length, dtype=np.int32), np.ones(length, np.uint8)) for i in range(count)
    ]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier() -> None:
    """Line the ranks up before a timed phase: they share the host's disk and cores, so they must overlap."""
    if dist.is_initialized():
        dist.barrier()


def timed(fn, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def bare_forward(plan: packing.PartPlan, target: TappedTarget, cfg: HarvestConfig, groups: int) -> float:
    """Seconds for the forward batches of `groups` row groups, features kept on the device and dropped."""
    rows_per_group = cfg.forward_tokens // cfg.token_budget

    def run():
        for g in range(groups):
            for batch in packing.forward_batches(
                plan, g * rows_per_group, (g + 1) * rows_per_group, cfg.forward_tokens
            ):
                ids = torch.from_numpy(np.stack([plan.docs[d].input_ids for _, d in batch]).astype(np.int64))
                if target.device.type == "cuda":  # as the harvest does: a pageable source waits for the GPU
                    ids = ids.pin_memory()
                target.features(ids.to(target.device, non_blocking=True))

    barrier()
    return timed(run, target.device)


def store_header(target: TappedTarget, cfg: HarvestConfig) -> Manifest:
    """A harvest.json for the benchmark's store in the encoding of --precision / --subspace."""
    feature_dim = len(target.layer_ids) * target.info.hidden_size
    return store.new_manifest(
        target=TargetSpec(**dataclasses.asdict(target.info)),
        layer_ids=target.layer_ids,
        token_budget=cfg.token_budget,
        tokenizer=TokenizerSpec("bench", target.info.vocab_size, {}),
        fingerprint={"model": "bench", "world_size": cfg.world_size},
        features=harvest.feature_encoding(cfg, len(target.layer_ids), feature_dim),
    )


def open_part(plan: packing.PartPlan, header: Manifest, cfg: HarvestConfig, out: Path) -> store.PartWriter:
    """This rank's part of a fresh store at `out`; rank 0 clears the folder before any rank creates its part."""
    if cfg.rank == 0:
        shutil.rmtree(out, ignore_errors=True)
        store.create_store(out, header)
    barrier()
    return store.PartWriter(out, plan.part_spec(cfg.rank, header.features))


def random_projection(header: Manifest, device: torch.device) -> torch.Tensor | None:
    """A random orthonormal P of the subspace's shape (the calibration is timed apart: `calibration`)."""
    if header.features.subspace is None:
        return None
    g = torch.Generator(device).manual_seed(0)
    basis = torch.randn(header.feature_dim, header.features.width, device=device, generator=g)
    return torch.linalg.qr(basis)[0].T.contiguous()


def calibration(plan: packing.PartPlan, target: TappedTarget, cfg: HarvestConfig, width: int) -> dict:
    """The one-off cost of a subspace harvest's calibration: the features' second moment over
    --calibration-tokens tokens, then the eigendecomposition."""
    moment = []
    forward_s = timed(
        lambda: moment.append(
            harvest.calibration.second_moment(plan.docs, target, cfg.calibration_tokens, cfg.forward_tokens)
        ),
        target.device,
    )
    captured = []
    eigh_s = timed(lambda: captured.append(features.top_subspace(moment[0][0].sum, width)[1]), target.device)
    return {
        "calibration_tokens": moment[0][0].tokens,
        "calibration_forward_s": forward_s,
        "eigh_s": eigh_s,
        "captured": captured[0],
    }


def harvest_rows(
    plan, target, cfg, part: store.PartWriter, header: Manifest, projection
) -> tuple[float, harvest.PipelineStalls]:
    """Seconds for the real pipeline over every row of the plan, until the last row is committed on disk, and
    where its forward thread waited."""
    stalls = []
    barrier()
    run = lambda: stalls.append(harvest.pipeline.run_rows(cfg, plan, target, part, header, projection))  # noqa: E731
    seconds = timed(run, target.device)
    return seconds, stalls[0]


def peak_memory_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def measure(args, env: Env) -> dict:
    """This rank's run: bare forward, then the harvest of its own rows into its own part of the store."""
    target = build_target(args.target, args.layers, env.device, args.tiny, args.experts)
    cfg = HarvestConfig(
        model="bench",
        data="bench",
        out=args.out,
        token_budget=args.token_budget,
        forward_tokens=args.forward_tokens,
        device=str(env.device),
        rank=env.rank,
        world_size=env.world_size,
        precision=args.precision,
        subspace=args.subspace,
        calibration_tokens=args.calibration_tokens,
    )
    header = store_header(target, cfg)
    rows_per_group = args.forward_tokens // args.token_budget
    docs_per_row = args.token_budget // args.doc_length
    docs_per_rank = (args.groups + 1) * rows_per_group * docs_per_row
    plan = packing.PartPlan.build(
        documents(env.world_size * docs_per_rank, args.doc_length, target.info.vocab_size),
        env.rank,
        env.world_size,
        args.token_budget,
    )
    stored = sum(p.numel() for n, p in target.model.named_parameters() if "embed_tokens" not in n)
    params = active_parameters(target.model)
    group_tokens = rows_per_group * docs_per_row * args.doc_length

    warm = bare_forward(plan, target, cfg, 1)  # Triton autotuning happens here; never timed
    bare = bare_forward(plan, target, cfg, min(3, args.groups)) / (min(3, args.groups) * group_tokens)
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    projection = random_projection(header, env.device)
    if projection is not None:  # warm the encoding's kernels too, untimed
        warm_encoder = harvest.RowEncoder(header.features, projection, (1, args.token_budget), env.device)
        rows = torch.randn(1, args.token_budget, header.feature_dim, device=env.device).to(torch.bfloat16)
        warm_encoder.encode(rows, warm_encoder.buffers(device=env.device))
    part = open_part(plan, header, cfg, Path(args.out))
    seconds, stalls = harvest_rows(plan, target, cfg, part, header, projection)  # every row, all shapes warm
    calibrated = calibration(plan, target, cfg, header.features.width) if projection is not None else {}
    tokens = plan.counts()["tokens"]
    steady_s = seconds - stalls.setup_s - stalls.drain_s
    written = tokens * len(target.layer_ids) * target.info.hidden_size * 2  # the features, as raw bf16
    on_disk = store.disk_bytes(part.folder)
    return {
        "layers": args.layers,
        "layers_run": len(target.model.layers),
        "tapped": target.layer_ids,
        "params_run_B": stored / 1e9,
        "active_params_run_B": params / 1e9,
        "kernels": target.kernels,
        "first_forward_s": warm,
        "bare_tok_s": 1 / bare,
        "bare_mfu": 2 * params / bare / PEAK_FLOPS,
        "harvest_tok_s": tokens / seconds,
        "harvest_mfu": 2 * params * tokens / seconds / PEAK_FLOPS,
        "harvest_vs_bare": (tokens / seconds) * bare,
        "tokens": tokens,
        # Without the once-per-run parts (buffer setup; the last groups' writes after the last forward), which a
        # harvest of hours amortises: the steady rate of the pipeline.
        "steady_tok_s": tokens / steady_s,
        "steady_vs_bare": (tokens / steady_s) * bare,
        "GB_s_features": written / seconds / 1e9,
        "compression_ratio": written / on_disk,
        "GB_s_disk": on_disk / seconds / 1e9,
        "peak_mem_GB": peak_memory_gb(env.device),
        "codec": [c.to_dict() for c in store.hidden_compressors(header.features)],
        "harvest_s": seconds,
        "precision": args.precision,
        "subspace": args.subspace,
        "stored_width": header.features.width,
        "of_raw_bf16": on_disk / written,
        **calibrated,
        "stalls": dataclasses.asdict(stalls),
        "rank": env.rank,
        "world_size": env.world_size,
        "device": str(env.device),
        "tiny": args.tiny,
        **{key: getattr(args, key) for key in SHAPE_KEYS if key != "layers"},
        "features_bytes": written,
        "disk_bytes": on_disk,
    }


def aggregate(results: list[dict]) -> dict:
    """All ranks as one harvest: rates and bytes summed, MFU averaged (the per-GPU MFU), the fullest GPU's memory."""
    first, world = results[0], len(results)

    def total(key):
        return sum(r[key] for r in results)

    bare, harvested, steady = total("bare_tok_s"), total("harvest_tok_s"), total("steady_tok_s")
    peaks = [r["peak_mem_GB"] for r in results if r["peak_mem_GB"] is not None]
    slowest = max(r["harvest_s"] for r in results)
    return {
        "layers": first["layers"],
        "layers_run": first["layers_run"],
        "world_size": world,
        "bare_tok_s": bare,
        "bare_mfu": total("bare_mfu") / world,
        "harvest_tok_s": harvested,
        "harvest_mfu": total("harvest_mfu") / world,
        "harvest_vs_bare": harvested / bare,
        "steady_tok_s": steady,
        "steady_vs_bare": steady / bare,
        "bare_tok_s_per_gpu": bare / world,
        "harvest_tok_s_per_gpu": harvested / world,
        "GB_s_features": total("GB_s_features"),
        "GB_s_disk": total("GB_s_disk"),
        "compression_ratio": total("features_bytes") / total("disk_bytes"),
        "peak_mem_GB": max(peaks, default=None),
        "tokens": total("tokens"),
        "harvest_s": slowest,
        # The job's rate as its slowest rank sets it; equals the sum of the rates when the ranks finish together.
        "wall_tok_s": total("tokens") / slowest,
    }


def load_one_gpu_run(path: str, args) -> dict:
    """The one-GPU result to compare with, refused unless it ran the same shapes (checked before any work)."""
    one = json.loads(Path(path).read_text())
    if "ranks" in one or one.get("world_size", 1) != 1:
        raise SystemExit(f"--compare-to {path} is not a one-GPU run (it ran {one.get('world_size')} ranks)")
    here = {key: getattr(args, key) for key in SHAPE_KEYS}
    differ = [f"{key} {one.get(key)} there, {value} here" for key, value in here.items() if one.get(key) != value]
    if differ:
        raise SystemExit(f"--compare-to {path} ran other shapes ({'; '.join(differ)}); per-GPU rates would not compare")
    return one


def table_cells(r: dict) -> str:
    peak = "-" if r["peak_mem_GB"] is None else f"{r['peak_mem_GB']:.1f}"
    return (
        f"| {r['layers']} | {r['layers_run']} | {r['bare_tok_s']:,.0f} | {100 * r['bare_mfu']:.1f} % | "
        f"{r['harvest_tok_s']:,.0f} | {100 * r['harvest_mfu']:.1f} % | {100 * r['harvest_vs_bare']:.1f} % | "
        f"{100 * r['steady_vs_bare']:.1f} % | "
        f"{r['GB_s_features']:.2f} | {r['GB_s_disk']:.2f} | {r['compression_ratio']:.3f} | {peak} |"
    )


def report_one(result: dict) -> dict:
    kernels = ", ".join(f"{role} {kernel}" for role, kernel in result["kernels"].items())
    print(
        f"\ntarget {result['target']}, {result['active_params_run_B']:.3g} B active parameters run of "
        f"{result['params_run_B']:.3g} B; kernels: {kernels}"
    )
    print(
        f"store encoding: {result['precision']}, subspace {result['subspace']} ({result['stored_width']} values per "
        f"token), on disk {result['of_raw_bf16']:.4f} of raw bf16"
    )
    print(HEADER)
    print("|---" * HEADER.count("|", 1) + "|")
    print(table_cells(result))
    print(f"harvest: {result['harvest_s']:.1f} s, {harvest.PipelineStalls(**result['stalls']).describe()}")
    if "eigh_s" in result:
        print(
            f"calibration (once per store): {result['calibration_tokens']} tokens' second moment in "
            f"{result['calibration_forward_s']:.1f} s, eigendecomposition {result['eigh_s']:.1f} s, captured "
            f"{result['captured']:.2%} (random weights)"
        )
    return result


def report_ranks(results: list[dict]) -> dict:
    summary = aggregate(results)
    print(f"\n| rank {HEADER}")
    print("|---" * (HEADER.count("|", 1) + 1) + "|")
    for r in results:
        print(f"| {r['rank']} ({r['device']}) {table_cells(r)}")
    print(f"| all {len(results)} {table_cells(summary)}")
    for r in results:
        print(f"rank {r['rank']} harvest: {r['harvest_s']:.1f} s, {harvest.PipelineStalls(**r['stalls']).describe()}")
    print(
        f"all {len(results)} ranks: {summary['tokens']:,} tokens, the slowest rank in {summary['harvest_s']:.1f} s "
        f"({summary['wall_tok_s']:,.0f} tok/s); per GPU: bare {summary['bare_tok_s_per_gpu']:,.0f} tok/s, "
        f"harvest {summary['harvest_tok_s_per_gpu']:,.0f} tok/s"
    )
    return {"world_size": len(results), "ranks": results, "aggregate": summary}


def report_scaling(summary: dict, one: dict) -> dict:
    """Weak-scaling efficiency: tok/s per GPU at N ranks / tok/s of the one-GPU run."""
    world, efficiency = summary["world_size"], {}
    for what in ("bare", "harvest", "steady"):
        per_gpu = summary[f"{what}_tok_s"] / world
        efficiency[what] = per_gpu / one[f"{what}_tok_s"]
        print(
            f"scaling efficiency, {what}: {per_gpu:,.0f} tok/s per GPU at {world} GPUs vs "
            f"{one[f'{what}_tok_s']:,.0f} on one GPU: {100 * efficiency[what]:.1f} %"
        )
    return efficiency


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=sorted(TARGETS), default="dense", help="the target's shapes (above)")
    parser.add_argument(
        "--experts", choices=["auto", *EXPERTS_IMPLEMENTATIONS], default="auto", help="the MoE target's experts"
    )
    parser.add_argument("--layers", type=int, default=64, help="target depth (the harvest runs up to the last tap)")
    parser.add_argument("--groups", type=int, default=8, help="row groups timed in the harvest")
    parser.add_argument("--doc-length", type=int, default=3072, help="tokens per document (one per row at 32768)")
    parser.add_argument("--token-budget", type=int, default=12288, help="tokens per row: whole documents packed")
    parser.add_argument("--forward-tokens", type=int, default=49152, help="tokens per forward: whole rows")
    parser.add_argument("--out", default="/tmp/dflash-bench-store")
    parser.add_argument("--precision", choices=["bf16", "fp8"], default="bf16", help="the store's feature precision")
    parser.add_argument("--subspace", default="none", help="the store's subspace width (K, 1/4, or none)")
    parser.add_argument("--calibration-tokens", type=int, default=32768, help="tokens of the timed calibration")
    parser.add_argument("--json", help="also write the results here (rank 0)")
    parser.add_argument("--compare-to", metavar="ONE.json", help="a one-GPU run's --json: print the scaling efficiency")
    parser.add_argument("--device", help="default: cuda:$LOCAL_RANK when CUDA is there, else the CPU")
    parser.add_argument("--tiny", action="store_true", help=f"toy shapes (defaults {TINY}) for a check on the CPU")
    if parser.parse_known_args()[0].tiny:  # toy defaults; options given explicitly still win
        parser.set_defaults(**TINY)
    args = parser.parse_args()
    if not 1 <= args.doc_length <= args.token_budget <= args.forward_tokens:
        parser.error(
            f"--doc-length {args.doc_length}, --token-budget {args.token_budget} and --forward-tokens "
            f"{args.forward_tokens} must grow in that order (a row holds whole documents, a forward whole rows)"
        )
    return args


def main():
    args = parse_args()
    env = init_distributed(args.device)
    one = load_one_gpu_run(args.compare_to, args) if args.compare_to and env.main else None
    results = gather_ranks(measure(args, env), env)  # returns once every rank has measured: the store can go
    if env.main:
        shutil.rmtree(args.out, ignore_errors=True)
        report = report_one(results[0]) if env.world_size == 1 else report_ranks(results)
        if one is not None:
            report["scaling_efficiency"] = report_scaling(aggregate(results), one)
        print(json.dumps(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
