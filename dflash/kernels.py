"""The kernels a target runs, named for the log: its attention; an MoE target's experts, set to the fastest
implementation for the device (or the user's); a hybrid (Gated-DeltaNet) target's sequence functions, patched
where transformers' choice falls short (fla's kernels kept off CPU tensors; fla's Triton conv when causal-conv1d
is missing).
"""

import inspect
import sys

import torch

from dflash.config import EXPERTS_IMPLEMENTATIONS
from dflash.errors import DflashError

# The one install advice for the GPU's kernels; causal-conv1d builds from source, so it is not in the extra.
FAST_KERNELS_INSTALL = "pip install 'dflash[gpu]' (flash-linear-attention) and, for the conv, pip install causal-conv1d"
# The module globals of transformers' hybrid modeling files (qwen3_5, qwen3_5_moe, qwen3_next) that the layers
# look up at call time: patching them changes the kernel a layer runs. A forward over a sequence (the harvest,
# prefill, verify forward) runs the first two; decoding one token at a time with a cache runs the last two.
GATED_DELTA_RULE = "torch_chunk_gated_delta_rule"
CAUSAL_CONV1D = "causal_conv1d_fn"
SEQUENCE_FUNCTIONS = {"gated_delta_rule": GATED_DELTA_RULE, "causal_conv1d": CAUSAL_CONV1D}
DECODE_FUNCTIONS = {
    "recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
    "causal_conv1d_update": "causal_conv1d_update",
}


def select_kernels(
    model: torch.nn.Module, device: torch.device, allow_slow: bool, generation: bool = False, experts: str = "auto"
) -> dict[str, str]:
    """Name the attention, set and name an MoE target's experts implementation (`experts`: "auto", the fastest
    for `device`, or a name of EXPERTS_IMPLEMENTATIONS), name the kernel of each hybrid-layer function and patch
    transformers' choice where it falls short.

    On CPU: the reference code (fla, if installed, is kept for CUDA tensors only). On CUDA: fla's Triton conv
    when causal-conv1d is missing, and a DflashError when a sequence function would run on the reference code
    (unless `allow_slow`). `generation`: the target also decodes with a cache: the one-token functions are
    reported too, and transformers' conv is not replaced (fla's conv wrapper is checked on cacheless forwards
    only). The patches are module globals, so they hold for the whole process: generation after a harvest in
    the same process keeps the harvest's conv (and reports it).
    """
    kernels = {"attention": model.config._attn_implementation, **_set_experts(model, device, experts)}
    modeling = sys.modules[type(model).__module__]
    is_hybrid = "linear_attention" in (getattr(model.config, "layer_types", None) or [])
    if not (is_hybrid and all(hasattr(modeling, name) for name in SEQUENCE_FUNCTIONS.values())):
        return kernels
    reported = {**SEQUENCE_FUNCTIONS, **(DECODE_FUNCTIONS if generation else {})}
    reported = {role: name for role, name in reported.items() if hasattr(modeling, name)}
    if device.type != "cuda":
        # transformers binds fla's Triton kernels whatever the device, and they take CUDA tensors only.
        for name in {**SEQUENCE_FUNCTIONS, **DECODE_FUNCTIONS}.values():
            function = getattr(modeling, name, None)
            if function is not None and _kernel_name(function) != "torch-reference" and not hasattr(function, "fast"):
                setattr(modeling, name, _cuda_only(function, function.__wrapped__))
        return {**kernels, **{role: "torch-reference" for role in reported}}
    kernels.update({role: _kernel_name(getattr(modeling, name)) for role, name in reported.items()})
    if kernels["causal_conv1d"] == "torch-reference" and kernels["gated_delta_rule"] == "fla" and not generation:
        # causal-conv1d is missing (it builds from source only): fla's Triton conv is the next best.
        setattr(modeling, CAUSAL_CONV1D, _cuda_only(_fla_causal_conv1d_fn, getattr(modeling, CAUSAL_CONV1D)))
        kernels["causal_conv1d"] = "fla-triton"
    slow = [role for role in SEQUENCE_FUNCTIONS if kernels[role] == "torch-reference"]
    if slow and not allow_slow:
        raise DflashError(
            f"the target's {' and '.join(slow)} would run on PyTorch reference code, more than 10x slower on GPU: "
            f"flash-linear-attention is not installed; run {FAST_KERNELS_INSTALL}, "
            "or pass --allow-slow-kernels to accept the slow path"
        )
    return kernels


def check_experts(experts: str) -> None:
    """Refuse an experts implementation transformers does not know, before anything loads."""
    if experts not in ("auto", *EXPERTS_IMPLEMENTATIONS):
        raise DflashError(
            f"unknown experts implementation {experts!r}: choose auto (the fastest for the device) or one of "
            f"{', '.join(EXPERTS_IMPLEMENTATIONS)}"
        )


def fastest_experts(device: torch.device) -> str:
    """grouped_mm where torch's grouped-matmul kernel runs on `device`, else eager. The rule is transformers' own
    (`integrations.moe._can_use_grouped_mm`; elsewhere its grouped_mm runs a loop over the experts): torch >= 2.9
    on CUDA sm80+ and on the CPU, or an older torch on Hopper (sm90). batched_mm is never the pick: it gathers a
    copy of the expert weights per token, memory that grows with a forward's tokens (a harvest's do not fit)."""
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return "eager"
    recent = torch.torch_version.TorchVersion(torch.__version__) >= "2.9"
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        runs = capability >= (8, 0) if recent else capability[0] == 9
    else:
        runs = recent or device.type != "cpu"
    return "grouped_mm" if runs else "eager"


def _set_experts(model: torch.nn.Module, device: torch.device, experts: str) -> dict[str, str]:
    """{"experts": the implementation set} for a model whose experts transformers can switch (MoE), else {}."""
    if not model._can_set_experts_implementation():
        return {}
    chosen = fastest_experts(device) if experts == "auto" else experts
    model.set_experts_implementation(chosen)
    return {"experts": chosen}


def describe_kernels(kernels: dict[str, str], device: torch.device) -> str:
    """The log line's `role kernel, ...`, saying why the reference code runs where it does."""
    line = ", ".join(f"{role} {kernel}" for role, kernel in kernels.items())
    reference = [role for role, kernel in kernels.items() if "reference" in kernel]
    if reference and device.type != "cuda":
        line += (
            " (PyTorch reference code: the right path on a CPU, where fla's Triton kernels cannot run, so "
            "transformers' advice to install flash-linear-attention does not apply there)"
        )
    elif reference:
        missing = "causal-conv1d" if all("conv" in role for role in reference) else "flash-linear-attention"
        line += (
            f" (PyTorch reference code for {', '.join(reference)} on the GPU: {missing} is not installed; "
            f"run {FAST_KERNELS_INSTALL})"
        )
    return line


def _kernel_name(function) -> str:
    """Which implementation transformers' kernel-with-fallback wrapper (or our patch) dispatches to on CUDA."""
    function = getattr(function, "fast", function)
    if function is _fla_causal_conv1d_fn:
        return "fla-triton"
    try:
        bound = inspect.getclosurevars(function).nonlocals
    except TypeError:
        return "unknown"
    implementation = bound.get("implementation")
    if implementation is None:
        return "unknown"
    if implementation is bound.get("torch_function"):
        return "torch-reference"
    return implementation.__module__.split(".")[0].replace("_", "-")


def _cuda_only(fast, reference):
    """A module-global replacement that sends CUDA tensors to `fast` and any other to the reference code."""

    def routed(*args, **kwargs):
        return (fast if args[0].is_cuda else reference)(*args, **kwargs)

    routed.fast, routed.__wrapped__ = fast, reference
    return routed


def _fla_causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **_kwargs):
    """transformers' causal_conv1d_fn contract ([B, D, T] in and out) on fla's Triton conv ([B, T, D])."""
    from fla.modules.causal_conv1d import causal_conv1d

    # transformers hands in a transposed view of a contiguous [B, T, D]: transposing back costs no copy.
    output, _ = causal_conv1d(x=hidden_states.transpose(1, 2), weight=weight, bias=bias, activation=activation)
    return output.transpose(1, 2)
