"""bench/train.py's tables: the drafters' rows, the ranks' rows and the scaling line, with the machine and versions."""

import datetime

import torch

from bench.step_profile import profile_table


def versions(device: torch.device) -> dict:
    import numcodecs
    import transformers
    import zarr

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU)"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "zarr": zarr.__version__,
        "numcodecs": numcodecs.__version__,
        "gpu": gpu,
    }


def fmt(value, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{unit}"


HEADER = (
    "| drafter | context / anchors / block tokens | ctx tok/s | drafted tok/s | MFU | step ms "
    "| peak alloc / reserved GB | alloc / reserved spread (B) | recompiles | data wait "
    "| ungraphed step ms | ungraphed MFU | ungraphed peak alloc GB |"
)


def table_row(r: dict) -> str:
    if "error" in r:
        return f"| {r['drafter']} | failed: {r['error']} |"
    u, row = r["ungraphed"], r["row"]
    spread = "-" if "allocated_spread" not in r else f"{r['allocated_spread']} / {r['reserved_spread']}"
    peak = "-" if "peak_allocated_GB" not in r else f"{r['peak_allocated_GB']:.1f} / {r['peak_reserved_GB']:.1f}"
    return (
        f"| {r['drafter']} | {row['context']} / {row['anchors']} / {row['block_tokens']} "
        f"| {fmt(r['context_tok_s'], ',.0f')} | {fmt(r['drafted_tok_s'], ',.0f')} | {fmt(r['mfu'], '.1f', 100, ' %')} "
        f"| {r['step_ms']:.1f} | {peak} | {spread} | {r['recompiles'] + u.get('recompiles', 0)} "
        f"| {fmt(r['data_wait'], '.2f', 100, ' %')} "
        f"| {u['error'] if 'error' in u else fmt(u.get('step_ms'), '.1f')} | {fmt(u.get('mfu'), '.1f', 100, ' %')} "
        f"| {fmt(u.get('peak_allocated_GB'), '.1f')} |"
    )


RANK_HEADER = (
    "| rank | ctx tok/s | MFU | step ms | peak alloc / reserved GB | alloc / reserved spread (B) | recompiles "
    "| data wait | ungraphed step ms | weights max abs diff vs rank 0 | weights checksum |"
)


def rank_row(label: str, context: str, r: dict, checksum: str) -> str:
    """A row of the rank table; `r` is one rank's summary or the aggregate (same keys)."""
    peak = "-" if r["peak_allocated_GB"] is None else f"{r['peak_allocated_GB']:.1f} / {r['peak_reserved_GB']:.1f}"
    spread = "-" if r["allocated_spread"] is None else f"{r['allocated_spread']} / {r['reserved_spread']}"
    return (
        f"| {label} | {context} | {fmt(r['mfu'], '.1f', 100, ' %')} | {r['step_ms']:.1f} | {peak} | {spread} "
        f"| {r['recompiles']} | {fmt(r['data_wait'], '.2f', 100, ' %')} | {fmt(r['ungraphed_step_ms'], '.1f')} "
        f"| {r['weights_max_abs_diff']:g} | {checksum} |"
    )


def rank_table(r: dict):
    agg = r["aggregate"]
    print(f"\nPer rank, drafter {r['drafter']}, window steps {r['window'][0]}-{r['window'][1]}:")
    print("\n" + RANK_HEADER)
    print("|" + "---|" * RANK_HEADER.count(" |"))
    for rank in r["ranks"]:
        print(rank_row(str(rank["rank"]), fmt(rank["context_tok_s"], ",.0f"), rank, f"{rank['weights_checksum']:.17g}"))
    context = f"{agg['context_tok_s']:,.0f} ({agg['context_tok_s_per_gpu']:,.0f} per GPU)"
    checksums = "all equal" if agg["weights_checksums_equal"] else "DIFFER"
    print(rank_row(f"all {agg['world_size']}", context, agg, checksums))


def scaling_line(r: dict) -> str:
    s = r["scaling"]
    if "error" in s:
        return f"scaling of {r['drafter']}: {s['error']}"
    return (
        f"scaling of {r['drafter']} against {s['baseline']}: {s['per_gpu_context_tok_s']:,.0f} ctx tok/s per GPU "
        f"at {s['world_size']} ranks / {s['one_gpu_context_tok_s']:,.0f} on one GPU = efficiency "
        f"{100 * s['efficiency']:.1f} % (bar >= 90 %); MFU per GPU {fmt(s['mfu_per_gpu'], '.1f', 100, ' %')} vs "
        f"{fmt(s['one_gpu_mfu'], '.1f', 100, ' %')} on one GPU ({fmt(s['mfu_ratio'], '.1f', 100, ' %')})"
    )


def report(info: dict, results: list[dict], args, world: int):
    script = "bench/train.py" if world == 1 else f"torchrun --nproc-per-node {world} bench/train.py"
    print(
        f"\n## {script} {'--tiny ' if args.tiny else ''}--drafter {args.drafter} --encoding {args.encoding} "
        f"--methods {','.join(args.methods)} --steps {args.steps}"
        + (f" --row-shapes {args.row_shapes}" if args.row_shapes else "")
        + (f" --profile {args.profile}" if args.profile else "")
        + (f" --flex-options '{args.flex_options}'" if args.flex_options else "")
    )
    print(", ".join(f"{k} {v}" for k, v in info.items()))
    for r in results:
        if "error" not in r:
            print(
                f"{r['drafter']}: {r['params_M']:.1f} M trainable parameters, loss chunk {r['loss_chunk']}, "
                f"token embeddings on the {r['embedding']}, memory estimate {r['memory_estimate_GB']:.1f} GB, "
                f"window steps {r['window'][0]}-{r['window'][1]}, data built in {r['data_build_s']:.1f} s, "
                f"warmup + capture {r['warmup_capture_s']:.1f} s, "
                f"loss {r['loss_first_last'][0]:.3f} -> {r['loss_first_last'][1]:.3f}; "
                f"step-time model (dflash.drafter.step_time, drafter {r['model_step_ms']['rates_of']}'s rates at head_dim "
                f"{r['model_step_ms']['head_dim']}): "
                f"{r['model_step_ms']['ms']:.1f} ms, {r['model_step_ms']['ms'] / r['step_ms']:.1%} of the measured step"
            )
    print("\n" + HEADER)
    print("|" + "---|" * HEADER.count(" |"))
    for r in results:
        print(table_row(r))
    for r in results:
        if "profile" in r:
            print(profile_table(r["drafter"], r["profile"], r["step_tflop"]))
    for r in results:
        if "error" not in r and world > 1:
            rank_table(r)
        if "scaling" in r:
            print("\n" + scaling_line(r))
