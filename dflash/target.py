"""The frozen target: loaded truncated after its last tapped layer, it yields the drafter's context features.

Only the embedding and layers 0..max(layer_ids) are loaded (no later layer, final norm or LM head); forward
hooks copy each tapped layer's output into one preallocated [B, T, n*H] tensor, so nothing else is kept.
Rows are right-padded documents run with no attention mask: the model is causal, so a real token never sees
padding or another document, and its features equal those of a standalone forward of its document.
"""

import hashlib
import inspect
import json
import logging
import numbers
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from dflash.errors import DflashError

logger = logging.getLogger("dflash")

GPU_EXTRA = "pip install 'dflash[gpu]'"
EMBEDDING_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")
HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight")
# The module globals of transformers' hybrid modeling files (qwen3_5, qwen3_5_moe, qwen3_next) that the layers
# look up at call time: patching them changes the kernel a layer runs. A forward over a sequence (the harvest,
# prefill, verify) runs the first two; decoding one token at a time with a cache runs the last two.
GATED_DELTA_RULE = "torch_chunk_gated_delta_rule"
CAUSAL_CONV1D = "causal_conv1d_fn"
SEQUENCE_FUNCTIONS = {"gated_delta_rule": GATED_DELTA_RULE, "causal_conv1d": CAUSAL_CONV1D}
DECODE_FUNCTIONS = {"recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule", "causal_conv1d_update": "causal_conv1d_update"}
MASK_TOKEN = "<|MASK|>"  # the token of the target's vocabulary that fills a drafter block after its first slot
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class TargetInfo:
    name: str
    model_type: str
    config_hash: str  # sha256 of config.json, canonical (sorted keys, no whitespace)
    hidden_size: int
    num_layers: int  # of the whole target, not of the truncated copy
    vocab_size: int


def local_device(requested: str | None) -> torch.device:
    """This process's device: the requested one, else cuda:$LOCAL_RANK when CUDA is there, else the CPU. A bare
    "cuda" also means this process's own GPU (LOCAL_RANK under torchrun), never GPU 0 for every rank."""
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))
    device = torch.device("cuda", local) if device.type == "cuda" and device.index is None else device
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise DflashError(
            f"device {device} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s) "
            f"(torch {torch.__version__}); use --device cpu, or fewer processes per node"
        )
    return device


def default_layer_ids(num_layers: int, n: int = 5) -> list[int]:
    """The DFlash rule: n layers evenly between layer 1 and layer L-3 (L=36, n=5 -> 1, 9, 17, 25, 33)."""
    if n < 1:
        raise DflashError(f"the number of tapped layers must be at least 1, got {n}")
    if n == 1:  # the public DFlash code's choice when the spread is undefined
        return [num_layers // 2]
    ids = [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]
    if num_layers < 4 or len(set(ids)) < n:
        raise DflashError(
            f"the target has {num_layers} layers, too few to tap {n} distinct layers by the DFlash rule; "
            f"pass --layers with increasing ids in 0..{num_layers - 1}"
        )
    return ids


def check_layer_ids(layer_ids, num_layers: int) -> list[int]:
    """A user's layer list, validated: distinct integers in 0..L-1 in increasing order."""
    valid = f"layer ids must be distinct integers in 0..{num_layers - 1}, in increasing order"
    default = _default_hint(num_layers)
    ids = list(layer_ids)
    if not ids or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
        raise DflashError(f"bad --layers {ids}: {valid} {default}")
    ids = [int(i) for i in ids]
    outside = [i for i in ids if not 0 <= i < num_layers]
    if outside:
        raise DflashError(f"bad --layers {ids}: {outside} outside the target's {num_layers} layers; {valid} {default}")
    if len(set(ids)) < len(ids):
        raise DflashError(f"bad --layers {ids}: duplicates; {valid} {default}")
    if ids != sorted(ids):
        raise DflashError(f"bad --layers {ids}: not in increasing order; {valid} {default}")
    return ids


def _default_hint(num_layers: int) -> str:
    try:
        return f"(the default for this target is {','.join(map(str, default_layer_ids(num_layers)))})"
    except DflashError:
        return ""


class TappedTarget:
    """Frozen, eval, only layers 0..max(layer_ids) kept; features() concatenates the tapped layers' outputs."""

    def __init__(self, path: str, layer_ids: list[int] | None, device, dtype, allow_slow_kernels: bool = False):
        config = load_config(path)
        text_config = config.get_text_config()
        num_layers = text_config.num_hidden_layers
        layer_ids = default_layer_ids(num_layers) if layer_ids is None else check_layer_ids(layer_ids, num_layers)
        info = TargetInfo(
            name=Path(path).name if Path(path).is_dir() else str(path),
            model_type=config.model_type,
            config_hash=_config_hash(path),
            hidden_size=text_config.hidden_size,
            num_layers=num_layers,
            vocab_size=text_config.vocab_size,
        )
        model = _load_truncated(path, text_config, max(layer_ids) + 1, dtype)
        self._attach(model, info, layer_ids, torch.device(device), dtype, allow_slow_kernels)

    @classmethod
    def from_model(cls, model: torch.nn.Module, layer_ids: list[int], num_layers: int, name: str,
                   allow_slow_kernels: bool = False) -> "TappedTarget":
        """Wrap an already-built base model that holds layers 0..max(layer_ids) of a `num_layers` target.

        For benchmarks, which build random weights on the GPU instead of saving and loading tens of GB.
        """
        config = model.config
        info = TargetInfo(
            name=name,
            model_type=config.model_type,
            config_hash=hashlib.sha256(config.to_json_string().encode()).hexdigest(),
            hidden_size=config.hidden_size,
            num_layers=num_layers,
            vocab_size=config.vocab_size,
        )
        weight = next(model.parameters())
        target = cls.__new__(cls)
        target._attach(model.eval().requires_grad_(False), info, check_layer_ids(layer_ids, num_layers),
                       weight.device, weight.dtype, allow_slow_kernels)  # fmt: skip
        return target

    def _attach(self, model, info: TargetInfo, layer_ids: list[int], device, dtype, allow_slow_kernels: bool):
        self.info, self.layer_ids, self.device, self.dtype = info, layer_ids, device, dtype
        self.kernels = select_kernels(model, self.device, allow_slow_kernels)  # refuse before a long copy to GPU
        self.model = model.to(self.device)
        self._features = None
        layers = self.model.layers
        for slot, layer_id in enumerate(self.layer_ids):
            layers[layer_id].register_forward_hook(partial(self._capture, slot))
        logger.info(
            "target %s (%s): tapping layers %s of %d, %d layers loaded, on %s; kernels: %s",
            self.info.name, self.info.model_type, self.layer_ids, info.num_layers, len(layers), self.device,
            describe_kernels(self.kernels),
        )  # fmt: skip

    @torch.inference_mode()
    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] right-padded rows, one document each -> [B, T, n*H], the tapped outputs in layer_ids order."""
        batch, length = input_ids.shape
        width = len(self.layer_ids) * self.info.hidden_size
        self._features = torch.empty(batch, length, width, dtype=self.dtype, device=self.device)
        try:
            # No attention mask: causality alone keeps each real token from seeing the padding after it.
            self.model(input_ids=input_ids.to(self.device), use_cache=False)
            return self._features
        finally:
            self._features = None

    def _capture(self, slot: int, _module, _args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        size = self.info.hidden_size
        self._features[..., slot * size : (slot + 1) * size] = hidden


def load_embedding_and_head(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embed_tokens [V, H] and lm_head [V, H] weights, read alone from its safetensors files."""
    from safetensors import safe_open

    file_of = _tensor_files(path)
    embed_key = _find_key(file_of, EMBEDDING_KEYS, "embed_tokens.weight", path)
    # Tying is a property of the whole checkpoint, so the top-level config decides (not a VL text_config).
    tied = bool(getattr(load_config(path, "--target"), "tie_word_embeddings", False))
    head_key = embed_key if tied else _find_key(file_of, HEAD_KEYS, "lm_head.weight", path)
    tensors = {}
    for key in {embed_key, head_key}:
        with safe_open(_checkpoint_file(path, file_of[key]), framework="pt") as shard:
            tensors[key] = shard.get_tensor(key)
    return tensors[embed_key], tensors[head_key]


def _tensor_files(path: str) -> dict[str, str]:
    """Tensor name -> the checkpoint file (name within the checkpoint) that holds it."""
    from safetensors import safe_open

    index = _checkpoint_file(path, "model.safetensors.index.json")
    if index is not None:
        return json.loads(Path(index).read_text())["weight_map"]
    single = _checkpoint_file(path, "model.safetensors")
    if single is None:
        raise DflashError(f"{path} holds no model.safetensors nor model.safetensors.index.json; save the target as safetensors")
    with safe_open(single, framework="pt") as shard:
        return dict.fromkeys(shard.keys(), "model.safetensors")


def _find_key(file_of: dict[str, str], preferred: tuple[str, ...], suffix: str, path: str) -> str:
    """The first preferred name present, else the one text-model tensor whose name ends with `suffix`."""
    for key in preferred:
        if key in file_of:
            return key
    candidates = [k for k in file_of if k.endswith(suffix) and not any(part in k for part in ("mtp", "visual", "vision"))]
    if len(candidates) == 1:
        return candidates[0]
    found = f"candidates {candidates}" if candidates else "no tensor of that name"
    raise DflashError(f"cannot find the target's {suffix} in {path} ({found}); is this a complete causal-LM checkpoint?")


# ---- loading ------------------------------------------------------------------------------------------------


def load_config(path: str, flag: str = "--model"):
    """The checkpoint's transformers config; `flag` names the option that takes the checkpoint, for the error."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise DflashError(f"cannot load a model config from {path}: {exc}; pass {flag} a transformers checkpoint folder") from exc


def _checkpoint_file(path: str, filename: str) -> str | None:
    """Local path of a checkpoint file (downloaded when `path` is a hub name), None when there is none."""
    from transformers.utils import cached_file

    try:
        return cached_file(path, filename, _raise_exceptions_for_missing_entries=False)
    except OSError as exc:
        raise DflashError(f"cannot read {filename} of {path}: {exc}; pass --model a transformers checkpoint folder") from exc


def _config_hash(path: str) -> str:
    config = json.loads(Path(_checkpoint_file(path, "config.json")).read_text())
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _load_truncated(path: str, text_config, keep: int, dtype) -> torch.nn.Module:
    """The base model (no LM head) with only its first `keep` layers loaded, its final norm removed."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    text_config.num_hidden_layers = keep
    if getattr(text_config, "layer_types", None) is not None:
        text_config.layer_types = text_config.layer_types[:keep]
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # silence the report listing every weight of the layers left out
    try:
        model, loading = AutoModel.from_pretrained(
            path, config=text_config, dtype=dtype, attn_implementation="sdpa", output_loading_info=True
        )
    except (OSError, ValueError) as exc:
        raise DflashError(f"cannot load the target from {path}: {exc}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    if loading["missing_keys"]:
        raise DflashError(f"the checkpoint {path} lacks weights {sorted(loading['missing_keys'])[:5]}...; is it complete?")
    if not isinstance(getattr(model, "layers", None), torch.nn.ModuleList):
        raise DflashError(f"unsupported target {type(model).__name__}: dflash needs a decoder with a `layers` list")
    if hasattr(model, "norm"):
        model.norm = torch.nn.Identity()  # the features are the layers' raw outputs; the final norm is unused
    return model.eval().requires_grad_(False)


# ---- kernels ------------------------------------------------------------------------------------------------


def select_kernels(model: torch.nn.Module, device: torch.device, allow_slow: bool, generation: bool = False) -> dict[str, str]:
    """Name the kernel of each hybrid-layer function and patch transformers' choice where it falls short.

    On CPU: the reference code (fla, if installed, is kept for CUDA tensors only). On CUDA: fla's Triton conv
    when causal-conv1d is missing, and a DflashError when a sequence function would run on the reference code
    (unless `allow_slow`). `generation`: the target also decodes with a cache: the one-token functions are
    reported too, and transformers' conv is not replaced (fla's conv wrapper is checked on cacheless forwards
    only). The patches are module globals, so they hold for the whole process: generation after a harvest in
    the same process keeps the harvest's conv (and reports it).
    """
    kernels = {"attention": model.config._attn_implementation}
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
            f"flash-linear-attention is not installed; run {GPU_EXTRA} (and optionally pip install causal-conv1d), "
            "or pass --allow-slow-kernels to accept the slow path"
        )
    return kernels


def describe_kernels(kernels: dict[str, str]) -> str:
    """The log line's `role kernel, ...`."""
    return ", ".join(f"{role} {kernel}" for role, kernel in kernels.items())


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
