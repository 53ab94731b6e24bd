"""The frozen target: tapped for the harvest, or whole for generation (`load_target`).

For the harvest, `TappedTarget` is loaded truncated after its last tapped layer and yields the drafter's context
features; `default_layer_ids` is the DFlash rule for which layers to tap.

Only the embedding and layers 0..max(layer_ids) are loaded (no later layer, final norm or LM head); forward
hooks copy each tapped layer's output into one preallocated [B, T, n*H] tensor, so nothing else is kept. A target
that also yields the teacher (`--teacher`: the target's own next-token distribution) keeps every layer and the
final norm, and for top-k the LM head: `forward` then returns the final-normed last hidden state too.
Rows are right-padded documents run with no attention mask: the model is causal, so a real token never sees
padding or another document, and its features equal those of a standalone forward of its document.
"""

import hashlib
import logging
import numbers
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash.device import local_device, resolve_dtype
from dflash.errors import DflashError
from dflash.kernels import FAST_KERNELS_INSTALL, check_experts, describe_kernels, select_kernels
from dflash.target_files import config_hash, load_config, load_head

if TYPE_CHECKING:
    from dflash.parallel import Group

logger = logging.getLogger("dflash")


@dataclass(frozen=True)
class TargetInfo:
    name: str
    model_type: str
    config_hash: str  # sha256 of config.json, canonical (sorted keys, no whitespace)
    hidden_size: int
    num_layers: int  # of the whole target, not of the truncated copy
    vocab_size: int


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
    """Frozen, eval, only layers 0..max(layer_ids) kept (every layer with a teacher); features() concatenates the
    tapped layers' outputs. `teacher` ("topk" | "hidden" | None): also run the final norm (and load the LM head for
    "topk", as `lm_head` [V, H]). `experts`: an MoE target's experts implementation (dflash.kernels);
    `expert_parallel`: split over a group, its experts by transformers' expert-parallel plan (`split_options`)."""

    def __init__(
        self,
        path: str,
        layer_ids: list[int] | None,
        device,
        dtype,
        allow_slow_kernels: bool = False,
        teacher: str | None = None,
        experts: str = "auto",
        expert_parallel: bool = False,
        group: "Group | None" = None,
    ):
        check_experts(experts)
        config = load_config(path)
        text_config = config.get_text_config()
        if quantization_method(config) is not None:  # a VL checkpoint's sits on the outer config
            text_config.quantization_config = config.quantization_config
        num_layers = text_config.num_hidden_layers
        layer_ids = default_layer_ids(num_layers) if layer_ids is None else check_layer_ids(layer_ids, num_layers)
        info = TargetInfo(
            name=Path(path).name if Path(path).is_dir() else str(path),
            model_type=config.model_type,
            config_hash=config_hash(path),
            hidden_size=text_config.hidden_size,
            num_layers=num_layers,
            vocab_size=text_config.vocab_size,
        )
        keep = num_layers if teacher else max(layer_ids) + 1
        split = group.layout.size if group else 1
        expert_parallel = expert_parallel and split > 1
        model = _load_truncated(
            path, text_config, keep, dtype, teacher is not None, tensor_parallel=split, expert_parallel=expert_parallel
        )
        self._attach(
            model, info, layer_ids, torch.device(device), dtype, allow_slow_kernels, experts, split, expert_parallel
        )
        self.teacher, self.group = teacher, group
        if teacher == "topk" and (group is None or group.layout.leader):  # the leader alone encodes the teacher
            self.lm_head = load_head(path).to(self.device, dtype)

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        layer_ids: list[int],
        num_layers: int,
        name: str,
        allow_slow_kernels: bool = False,
        experts: str = "auto",
    ) -> "TappedTarget":
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
        target._attach(
            model.eval().requires_grad_(False),
            info,
            check_layer_ids(layer_ids, num_layers),
            weight.device,
            weight.dtype,
            allow_slow_kernels,
            experts,
        )
        return target

    def _attach(
        self,
        model,
        info: TargetInfo,
        layer_ids: list[int],
        device,
        dtype,
        allow_slow_kernels: bool,
        experts: str,
        split: int = 1,
        expert_parallel: bool = False,
    ):
        self.info, self.layer_ids, self.device, self.dtype = info, layer_ids, device, dtype
        # Before a long copy to the GPU: a refusal comes at once.
        self.kernels = select_kernels(model, self.device, allow_slow_kernels, experts=experts)
        weights = describe_weights(model, dtype)
        self.model = model.to(self.device)
        self._features = None
        self.teacher, self.lm_head, self.group = None, None, None
        where = describe_split(self.device, split, model, expert_parallel)
        layers = self.model.layers
        for slot, layer_id in enumerate(self.layer_ids):
            layers[layer_id].register_forward_hook(partial(self._capture, slot))
        logger.info(
            "target %s (%s): tapping layers %s of %d, %d layers loaded, on %s; %skernels: %s",
            self.info.name,
            self.info.model_type,
            self.layer_ids,
            info.num_layers,
            len(layers),
            where,
            weights,
            describe_kernels(self.kernels, self.device),
        )

    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] right-padded rows, one document each -> [B, T, n*H], the tapped outputs in layer_ids order."""
        return self.forward(input_ids)[0]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T] right-padded rows -> (features [B, T, n*H], the final-normed last hidden state [B, T, H], the LM
        head's input, for a target with a teacher, else None)."""
        batch, length = input_ids.shape
        width = len(self.layer_ids) * self.info.hidden_size
        self._features = torch.empty(batch, length, width, dtype=self.dtype, device=self.device)
        if self.group is not None and self.group.layout.leader:
            self.group.share_ids(input_ids)  # the followers run their shards of this forward with it
        try:
            # No attention mask: causality alone keeps each real token from seeing the padding after it.
            output = self.model(input_ids=input_ids.to(self.device), use_cache=False)
            return self._features, output.last_hidden_state if self.teacher else None
        finally:
            self._features = None

    def _capture(self, slot: int, _module, _args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        size = self.info.hidden_size
        self._features[..., slot * size : (slot + 1) * size] = hidden


# ---- loading ------------------------------------------------------------------------------------------------


def quantization_method(config) -> str | None:
    """The quantization a checkpoint declares (its config's `quantization_config.quant_method`), or None."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    return quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method


def describe_weights(model: torch.nn.Module, dtype) -> str:
    """The log's words for a quantized checkpoint's weights (`fp8 weights, dequantized ...; `), else ''. transformers
    dequantizes where the format has no kernels (fine-grained FP8 on a CPU) and then drops the model's
    quantization_config; it logs that as a warning, which the load's silenced logging would hide."""
    declared = getattr(model, "_declared_quantization", None)
    if declared is None:
        return ""
    if getattr(model, "is_quantized", False):
        return f"{declared} weights, run quantized; "
    return f"{declared} weights, dequantized to {str(dtype).removeprefix('torch.')} at load; "


def _from_pretrained(auto_class, path, declared: str | None, **options) -> torch.nn.Module:
    """`auto_class.from_pretrained`, a checkpoint of the quantization format `declared` that does not load here
    refused naming it; the model remembers the format (for describe_weights)."""
    try:
        model = auto_class.from_pretrained(path, **options)
    except (ImportError, RuntimeError, ValueError) as exc:
        if declared is None:
            raise
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DflashError(
            f"cannot load the {declared}-quantized checkpoint {path} here ({why}); README, 'Quantized "
            "checkpoints', lists the formats that load"
        ) from exc
    loaded = model[0] if isinstance(model, tuple) else model
    loaded._declared_quantization = declared
    return model


def split_options(tensor_parallel: int, expert_parallel: bool = False) -> dict:
    """`from_pretrained`'s arguments that split the target over the `tensor_parallel` processes of the
    torch.distributed world (dflash.parallel.Group) when above 1: transformers' tensor-parallel plan, and with
    `expert_parallel` its expert-parallel plan for the experts (`ep_size` = the group: each process holds 1/T of
    the experts whole; its EP rules replace the TP rules on the experts, the rest stays tensor-parallel). With the
    EP group the TP group, transformers' "auto" EP implementation runs AllReduceEP at inference: every process runs
    its own experts on the whole batch, the routes to the others' masked, and an all-reduce sums the outputs
    (transformers 5.24, distributed/expert_parallel.py)."""
    from transformers.distributed import DistributedConfig

    if tensor_parallel <= 1:
        return {}
    if not expert_parallel:
        return {"distributed_config": DistributedConfig(tp_size=tensor_parallel)}
    try:
        return {"distributed_config": DistributedConfig(tp_size=tensor_parallel, ep_size=tensor_parallel)}
    except TypeError as exc:  # a transformers before DistributedConfig had ep_size
        raise DflashError(
            f"--expert-parallel needs a transformers whose DistributedConfig takes ep_size ({exc}); upgrade it "
            "(5.24 is tested) or leave --expert-parallel out"
        ) from exc


def describe_split(device, tensor_parallel: int, model: torch.nn.Module, expert_parallel: bool = False) -> str:
    """Where the target runs, for the log's target line: with `expert_parallel`, how many experts each process
    holds (a DflashError if transformers split none)."""
    if tensor_parallel <= 1:
        return str(device)
    how = "tensor-parallel plan"
    if expert_parallel:
        # transformers' `grouped_gemm` style marks the experts modules it splits and sets their local count
        split = [m.num_experts for m in model.modules() if getattr(m, "_is_expert_parallel", False)]
        if not split:
            raise DflashError(
                f"transformers split no experts of the target {type(model).__name__} by its expert-parallel plan; "
                "drop --expert-parallel (--tensor-parallel alone splits the experts by the tensor-parallel plan)"
            )
        how += f", its experts by the expert-parallel plan ({split[0]} of {split[0] * tensor_parallel} per process)"
    return f"{device}, split over {tensor_parallel} processes by transformers' {how}"


def _load_truncated(
    path: str,
    text_config,
    keep: int,
    dtype,
    final_norm: bool = False,
    tensor_parallel: int = 1,
    expert_parallel: bool = False,
) -> torch.nn.Module:
    """The base model (no LM head) with only its first `keep` layers loaded, its final norm removed unless asked
    for (the teacher's hidden state is the final norm's output); split over the `tensor_parallel` processes of the
    torch.distributed world when above 1 (`split_options`)."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    split = split_options(tensor_parallel, expert_parallel)

    text_config.num_hidden_layers = keep
    if getattr(text_config, "layer_types", None) is not None:
        text_config.layer_types = text_config.layer_types[:keep]
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # silence the report listing every weight of the layers left out
    try:
        model, loading = _from_pretrained(
            AutoModel,
            path,
            quantization_method(text_config),
            config=text_config,
            dtype=dtype,
            attn_implementation="sdpa",
            output_loading_info=True,
            **split,
        )
    except (OSError, ValueError) as exc:
        raise DflashError(f"cannot load the target from {path}: {exc}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    if loading["missing_keys"]:
        raise DflashError(
            f"the checkpoint {path} lacks weights {sorted(loading['missing_keys'])[:5]}...; is it complete?"
        )
    if not isinstance(getattr(model, "layers", None), torch.nn.ModuleList):
        raise DflashError(f"unsupported target {type(model).__name__}: dflash needs a decoder with a `layers` list")
    if final_norm and not isinstance(getattr(model, "norm", None), torch.nn.Module):
        raise DflashError(f"the target {type(model).__name__} has no final norm `norm`; --teacher needs it: use none")
    if hasattr(model, "norm") and not final_norm:
        model.norm = torch.nn.Identity()  # the features are the layers' raw outputs; the final norm is unused
    return model.eval().requires_grad_(False)


def load_target(
    path: str | Path,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype = "float32",
    tensor_parallel: int = 1,
    experts: str = "auto",
    expert_parallel: bool = False,
):
    """The full target (with LM head) for generation, frozen, and its tokenizer; split over the `tensor_parallel`
    processes of the torch.distributed world when above 1, its experts too by the expert-parallel plan with
    `expert_parallel` (`split_options`); `experts`: an MoE target's experts implementation (dflash.kernels)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (Path(path) / "config.json").is_file():
        raise DflashError(f"{path} is not a model folder (no config.json); pass the target's local folder")
    check_experts(experts)
    device = local_device(device)
    expert_parallel = expert_parallel and tensor_parallel > 1
    split = split_options(tensor_parallel, expert_parallel)
    dtype = resolve_dtype(dtype, device)
    model = _from_pretrained(AutoModelForCausalLM, path, quantization_method(load_config(path)), dtype=dtype, **split)
    kernels = select_kernels(model, device, allow_slow=True, generation=True, experts=experts)
    model = model.to(device).eval()
    model.requires_grad_(False)
    logger.info(
        "target %s on %s; %skernels: %s",
        path,
        describe_split(device, tensor_parallel, model, expert_parallel),
        describe_weights(model, dtype),
        describe_kernels(kernels, device),
    )
    # The convolutions' reference code is a small op: the delta rules are the ones that cost.
    slow = [
        role
        for role in ("gated_delta_rule", "recurrent_gated_delta_rule")
        if device.type == "cuda" and kernels.get(role) == "torch-reference"
    ]
    if slow:
        logger.warning(
            "the target's %s run on PyTorch reference code on the GPU: correct but slow; run %s for the fast kernels",
            " and ".join(slow),
            FAST_KERNELS_INSTALL,
        )
    return model, AutoTokenizer.from_pretrained(path)
