"""Where a train step's time goes: torch.profiler over the compiled step without its CUDA graph (a replayed graph
is one opaque launch to the profiler), each GPU kernel put into one part by its name, and the matmuls split by
shape into the frozen LM head's (a dimension equal to the vocabulary) and the drafter's, with their achieved
TFLOP/s (2 x M x K x N per call, from the recorded input shapes) against the machine's matmul ceiling.

Parts, first matching rule wins (kernel names as inductor, cuBLAS and PyTorch give them):
    attention      flex_attention's Triton templates (`triton_tem_*`; no other template is compiled here); on the
                   CPU the dense-mask SDPA operators
    matmul         cuBLAS / CUTLASS kernels (gemm, nvjet, xmma, cutlass, sm90_)
    top-k / sort   torch.topk and sort kernels (DFlash 2's candidates, anchors drawn by topk)
    optimizer      AdamW's fused and foreach kernels
    fused          the rest of inductor's Triton kernels: norms, activations, the loss's softmax, rope, ...
    copy / fill    memcpy and memset
    other          anything else
On the CPU (no kernels) the same rules are applied to the ATen operators' own time."""

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

PARTS = (
    ("attention", ("triton_tem", "flex_attention", "scaled_dot_product")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "aten::mm", "aten::addmm", "aten::bmm")),
    ("top-k / sort", ("topk", "sort", "radix")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("fused", ("triton_",)),
    ("copy / fill", ("memcpy", "memset", "copy_", "fill_")),
)
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")
PEAK_TFLOPS = 792.0  # bf16 8192^3 matmul on the H200 (shared/DEVICE.md)


def part_of(name: str) -> str:
    lowered = name.lower()
    for part, needles in PARTS:
        if any(n in lowered for n in needles):
            return part
    return "other"


def _matmul_flops(op: str, shapes: list) -> float:
    """FLOPs of one call from its input shapes: mm [M,K]x[K,N]; addmm(_) (bias, [M,K], [K,N]); bmm [B,M,K]x[B,K,N]."""
    a, b = (shapes[1], shapes[2]) if op.startswith("aten::addmm") else (shapes[0], shapes[1])
    if len(a) < 2 or len(b) < 2:
        return 0.0
    batch = a[0] if op == "aten::bmm" else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def _matmul_calls(prof, steps: int, cuda: bool) -> list[dict]:
    """Every matmul operator by input shapes: its kernels' own time per step (self time: an operator nested in
    another, as inductor's extern calls can be, is not counted twice) and achieved TFLOP/s, largest first."""
    calls = []
    for evt in prof.key_averages(group_by_input_shape=True):
        if evt.key not in MATMUL_OPS or not evt.input_shapes:
            continue
        us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        flops = _matmul_flops(evt.key, evt.input_shapes) * evt.count
        calls.append(
            {
                "op": evt.key,
                "shapes": [list(shape) for shape in evt.input_shapes if shape],
                "calls": evt.count / steps,
                "ms": us / 1000 / steps,
                "flops": flops / steps,
                "tflops": flops / max(us, 1e-9) / 1e6,
            }
        )
    return sorted(calls, key=lambda c: -c["ms"])


def _matmul_split(calls: list[dict], vocab: int) -> dict:
    """{"LM head" | "drafter": {"ms": per step, "tflops": achieved}}: a call with a dimension equal to the
    vocabulary is the LM head's (DSpark: every product over the vocabulary)."""
    out = {}
    for c in calls:
        dims = [d for shape in c["shapes"] for d in shape]
        side = out.setdefault("LM head" if vocab in dims else "drafter", {"ms": 0.0, "flops": 0.0})
        side["ms"] += c["ms"]
        side["flops"] += c["flops"]
    return {name: {"ms": s["ms"], "tflops": s["flops"] / max(s["ms"], 1e-9) / 1e9} for name, s in out.items()}


def _annotation(evt) -> bool:
    """A range on the GPU timeline that spans kernels (`## Call CompiledFxGraph ... ##`, `Optimizer.step#...`):
    counting it beside its kernels would count their time twice."""
    return bool(getattr(evt, "is_user_annotation", False)) or "#" in evt.key


def profile_step(step_fn, steps: int, vocab: int, device: torch.device) -> dict:
    """Profile `steps` calls of `step_fn` (already warm): per part and per kernel, ms per step."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step_fn()
        if cuda:
            torch.cuda.synchronize(device)
    kernels, counts = {}, {}
    for evt in prof.key_averages():
        if cuda and (evt.device_type != DeviceType.CUDA or _annotation(evt)):
            continue
        if not cuda and not evt.key.startswith("aten::"):
            continue
        us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        if us > 0:
            kernels[evt.key] = kernels.get(evt.key, 0.0) + us / 1000 / steps
            counts[evt.key] = counts.get(evt.key, 0) + evt.count / steps
    parts = {}
    for name, ms in kernels.items():
        parts[part_of(name)] = parts.get(part_of(name), 0.0) + ms
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])
    fused = [(n, ms) for n, ms in ranked if part_of(n) == "fused"][:15]
    calls = _matmul_calls(prof, steps, cuda)
    return {
        "steps": steps,
        "total_ms": sum(kernels.values()),
        "parts": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
        "matmuls": _matmul_split(calls, vocab),
        "matmul_calls": calls[:12],
        "top_kernels": [{"name": n[:120], "ms": ms, "part": part_of(n)} for n, ms in ranked[:15]],
        # The fused part is many small kernels: its largest ones by name, with their launches per step.
        "fused_kernels": [{"name": n[:160], "ms": ms, "calls": counts[n]} for n, ms in fused],
    }


def profile_table(label: str, p: dict, step_tflop: dict | None = None) -> str:
    """The markdown table of one profile: parts by time (with `step_tflop`, the counted TFLOP of a step by kind,
    dflash.drafter.flops.step_flops_by_kind: the FLOPs of the parts that run them and their rate against the matmul
    ceiling), the matmul split, the largest kernels."""
    total = max(p["total_ms"], 1e-9)
    lines = [
        f"\nProfile of {label} ({p['steps']} ungraphed steps; kernel time per step {p['total_ms']:.1f} ms):",
        "",
        "| part | ms per step | share | counted TFLOP per step | TFLOP/s | of the matmul ceiling |",
        "|---|---|---|---|---|---|",
    ]
    for part, ms in p["parts"].items():
        tflop = (step_tflop or {}).get(part)
        rate = (
            f"{tflop:.3g} | {tflop / ms * 1e3:.3g} | {100 * tflop / ms * 1e3 / PEAK_TFLOPS:.2g} %"
            if tflop
            else "- | - | -"
        )
        lines.append(f"| {part} | {ms:.1f} | {100 * ms / total:.1f} % | {rate} |")
    for side, m in p["matmuls"].items():
        lines.append(
            f"| of matmul: {side} | {m['ms']:.1f} | {m['tflops']:.0f} TFLOP/s "
            f"({100 * m['tflops'] / PEAK_TFLOPS:.0f} % of {PEAK_TFLOPS:.0f}) |"
        )
    lines += ["", "| kernel | part | ms per step |", "|---|---|---|"]
    lines += [f"| `{k['name']}` | {k['part']} | {k['ms']:.2f} |" for k in p["top_kernels"]]
    lines += ["", "| fused kernel | calls per step | ms per step |", "|---|---|---|"]
    lines += [f"| `{k['name']}` | {k['calls']:g} | {k['ms']:.2f} |" for k in p.get("fused_kernels", [])]
    lines += ["", "| matmul | input shapes | calls per step | ms per step | TFLOP/s |", "|---|---|---|---|---|"]
    lines += [
        f"| `{c['op']}` | {' x '.join(str(s) for s in c['shapes'])} | {c['calls']:g} | {c['ms']:.2f} | {c['tflops']:.0f} |"
        for c in p.get("matmul_calls", [])
    ]
    return "\n".join(lines)
