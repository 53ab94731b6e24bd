"""The store checked against its target: stored documents re-run alone and unpadded through the target, every
stored value compared with the fresh forward encoded as the store encodes it (`dflash inspect --reforward`, and
a few documents at the end of every harvest). A document that fails is named, with the tapped layer its features
match instead when one does: the commonest silent bugs (padding, batching, off-by-one layers) show up here.
A store with a teacher has its teacher arrays compared too: the final hidden state by relative error, the top-k
by the total variation between the stored and the fresh distributions (ids matched, tails included), so a
reordering of near-equal probabilities is no failure but a distribution of another position is.
"""

import logging
from pathlib import Path

import numpy as np
import torch

from dflash import features, manifest, store
from dflash.device import DTYPES, local_device
from dflash.errors import DflashError
from dflash.target import TappedTarget

logger = logging.getLogger("dflash")

# Relative error allowed per slice (norm of the difference / norm of the fresh features) on top of the encoding's
# own error, by the dtype the target computes in: the fresh forward runs one document alone, the harvest ran it
# batched with others, so the last bits of the computation differ. In float32 only a bf16 rounding can flip (one
# ulp, 2^-7 at most); bf16 / fp16 compute differs more, but far less than two neighbouring layers do.
COMPUTE_NOISE = {torch.float32: 2.0**-7, torch.float16: 2.0**-6, torch.bfloat16: 2.0**-5}
FP8_ERROR = 2.0**-4  # e4m3 rounding relative to a value (dflash.features.fp8_error_bound)
FP16_ERROR = 2.0**-11  # the float16 rounding of a stored top-k probability, relative to it
TOP_K_ROWS = 1024  # positions compared at once: [positions, k, k] id matches


def check_tolerance(spec: manifest.FeatureSpec, *dtypes: torch.dtype) -> float:
    """The encoding's error plus the larger compute noise of the harvest's and the check's dtypes."""
    return (FP8_ERROR if spec.precision == "fp8" else 0.0) + max(COMPUTE_NOISE.get(d, 2.0**-5) for d in dtypes)


def run_reforward(path: Path, documents: int, seed: int = 0, device: str | None = None, model: str | None = None):
    """`dflash inspect --reforward`: load the store's target (its layers and their neighbours) and check."""
    opened = store.Store.open(path)
    m = opened.manifest
    model = model or store.target_path(path, m)
    if Path(model).is_absolute() and not (Path(model) / "config.json").is_file():
        raise DflashError(
            f"{path} was harvested from {model}, which is not a model folder any more; pass the target's folder "
            "with --model"
        )
    dtype = DTYPES.get(m.fingerprint.get("dtype", "bfloat16"), torch.bfloat16)
    device = str(local_device(device))
    if torch.device(device).type == "cpu" and dtype != torch.float32:
        dtype = torch.float32  # the CPU's bf16 matmuls are slow and no closer to the GPU's than float32 is
    layers = check_layers(m.layer_ids, m.target.num_layers)
    target = TappedTarget(model, layers, device, dtype, True, m.teacher.kind if m.teacher else None)
    return reforward_check(path, target, documents, seed)


def check_layers(layer_ids, num_layers: int) -> list[int]:
    """The layers a check against the target taps: the stored ones and each one's neighbours (off-by-one)."""
    return sorted({i + d for i in layer_ids for d in (-1, 0, 1) if 0 <= i + d < num_layers})


def _relative(stored: torch.Tensor, fresh: torch.Tensor) -> float:
    return ((stored - fresh).norm() / fresh.norm().clamp_min(1e-30)).item()


def reforward_check(path: Path, target: TappedTarget, documents: int, seed: int = 0) -> manifest.SelfCheck:
    """Re-run `documents` stored documents drawn at random (seeded) through `target`, each alone and unpadded, and
    compare every stored value with the fresh forward's, encoded as the store encodes (bf16 rounding; fp8; P h).

    `target` must tap at least the store's layers; a failing slice is matched against every layer it taps.
    """
    opened = store.Store.open(path)
    m = opened.manifest
    if target.info.config_hash != m.target.config_hash:
        raise DflashError(
            f"the target loaded for the check ({target.info.name}) is not the one {path} was harvested from (its "
            "config.json differs); give the store's target"
        )
    missing = [layer for layer in m.layer_ids if layer not in target.layer_ids]
    if missing:
        raise DflashError(f"the check's target does not tap the store's layers {missing}")
    if m.teacher is not None and target.teacher != m.teacher.kind:
        raise DflashError(f"the check's target does not compute the store's teacher ({m.teacher.kind})")
    spec, H = m.features, m.target.hidden_size
    slot = {layer: i for i, layer in enumerate(target.layer_ids)}
    projection = None if opened.projection is None else torch.from_numpy(opened.projection)
    harvest_dtype = DTYPES.get(m.fingerprint.get("dtype"), torch.bfloat16)
    tolerance = check_tolerance(spec, harvest_dtype, target.dtype)
    table = opened.documents()
    rng = np.random.default_rng(seed)
    picked = np.sort(rng.choice(len(table), size=min(documents, len(table)), replace=False))
    teacher_tolerance = max(COMPUTE_NOISE.get(d, 2.0**-5) for d in (harvest_dtype, target.dtype)) + FP16_ERROR
    worst, equal, total, failures = 0.0, 0, 0, []
    teacher_worst, teacher_failures = 0.0, []
    for k in picked.tolist():
        doc_id, piece, row, start, length = table[k].tolist()
        stored = opened.read_row(row)
        span = slice(start, start + length)
        ids = torch.from_numpy(stored["input_ids"][span].astype(np.int64))[None]
        out, final = target.forward(ids)
        out = out[0].to(torch.bfloat16).cpu()  # what the harvest rounds to before encoding
        if m.teacher is not None:
            stored_teacher = {name: value[span] for name, value in opened.read_teacher(row).items()}
            error = _teacher_error(m.teacher, stored_teacher, final[0], target)
            teacher_worst = max(teacher_worst, error)
            if error > teacher_tolerance:
                teacher_failures.append(manifest.CheckFailure(doc_id, piece, row, None, error))
        by_layer = {layer: out[:, i * H : (i + 1) * H] for layer, i in slot.items()}
        fresh = torch.cat([by_layer[layer] for layer in m.layer_ids], -1)
        if projection is not None:
            fresh = features.project(fresh, projection)
        if spec.precision == "fp8":
            bits = torch.from_numpy(stored["hidden"][span].copy())
            values = features.dequantize_fp8(bits, torch.from_numpy(stored["scales"][span].copy()), torch.float32)
            expected = features.quantize_fp8(fresh, spec.scale_groups)[0]
        else:
            bits = torch.from_numpy(stored["hidden"][span].view(np.int16).copy())
            values = bits.view(torch.bfloat16).float()
            expected = fresh.view(torch.int16)
        equal += int((bits == expected).sum())
        total += bits.numel()
        slices = [(None, slice(0, spec.width))] if projection is not None else []
        slices = slices or [(layer, slice(i * H, (i + 1) * H)) for i, layer in enumerate(m.layer_ids)]
        for layer, columns in slices:
            error = _relative(values[:, columns], fresh[:, columns].float())
            worst = max(worst, error)
            if error <= tolerance:
                continue
            match = None
            if layer is not None:
                others = {other: _relative(values[:, columns], h.float()) for other, h in by_layer.items()}
                best = min(others, key=others.get)
                # Named only when that layer really matches (within the tolerance): a slice that matches no layer
                # (another target's weights, damaged rows) is closer to some layer by chance, which blames nothing.
                match = best if best != layer and others[best] <= tolerance else None
            failures.append(manifest.CheckFailure(doc_id, piece, row, layer, error, match))
    teacher = None
    if m.teacher is not None:
        teacher = manifest.TeacherCheck(teacher_tolerance, teacher_worst, tuple(teacher_failures))
    return manifest.SelfCheck(
        passed=not failures and not teacher_failures,
        documents=len(picked),
        seed=seed,
        tolerance=tolerance,
        worst_relative_error=worst,
        bit_equal=equal / max(1, total),
        failures=tuple(failures),
        teacher=teacher,
    )


def _teacher_error(spec: manifest.TeacherSpec, stored: dict, final: torch.Tensor, target: TappedTarget) -> float:
    """One document's stored teacher against the fresh forward's final hidden state [n, H]: relative error of the
    hidden state, or the mean over positions of the top-k distributions' total variation."""
    if spec.kind == "hidden":
        values = torch.from_numpy(stored["teacher_hidden"].view(np.int16).copy()).view(torch.bfloat16).float()
        return _relative(values, final.to(torch.bfloat16).float().cpu())
    probs, ids, tail = (t.cpu() for t in features.next_token_top_k(final, target.lm_head, spec.k))
    distance = top_k_distance(
        torch.from_numpy(stored["teacher_ids"].astype(np.int64)),
        torch.from_numpy(stored["teacher_probs"].astype(np.float32)),
        torch.from_numpy(stored["teacher_tail"].astype(np.float32)),
        ids,
        probs,
        tail,
    )
    return distance.mean().item()


def top_k_distance(ids_a, probs_a, tail_a, ids_b, probs_b, tail_b) -> torch.Tensor:
    """Per position, the total variation between two top-k distributions with their tails ([n, k], [n, k], [n]
    each): an id both hold differs by its two probabilities, an id one side lacks counts its whole probability
    there (the other side has it in its tail), and the tails differ by their masses."""
    distances = []
    for rows in torch.arange(len(ids_a)).split(TOP_K_ROWS):
        same = ids_a[rows, :, None] == ids_b[rows, None, :]  # [n, k, k]
        b_of_a = (same * probs_b[rows, None, :]).sum(-1)  # b's probability of each of a's ids, 0 when b lacks it
        only_b = (probs_b[rows] * ~same.any(-2)).sum(-1)
        l1 = (probs_a[rows] - b_of_a).abs().sum(-1) + only_b + (tail_a[rows] - tail_b[rows]).abs()
        distances.append(l1 / 2)
    return torch.cat(distances)


def describe_failure(failure: manifest.CheckFailure) -> str:
    where = f"document {failure.doc_id}" + (f" piece {failure.piece}" if failure.piece else "")
    what = f"layer {failure.layer}" if failure.layer is not None else "the projected features"
    text = f"{where} (row {failure.row}): {what} off by {failure.relative_error:.2e} relative"
    if failure.matches_layer is not None:
        text += f"; it matches layer {failure.matches_layer} of the fresh forward better"
    elif failure.layer is not None:
        text += "; it matches no tapped layer of the fresh forward"
    return text


def no_layer_matches(check: manifest.SelfCheck) -> bool:
    """Every failing slice matches no layer of the fresh forward: not an off-by-one, another model (or damage)."""
    return bool(check.failures) and all(f.matches_layer is None for f in check.failures)


NO_LAYER_MATCHES = (
    "no failing slice matches any tapped layer of the fresh forward: the target checked is not the model that "
    "wrote the store (its weights changed since the harvest, or another checkpoint of the same config), or the "
    "rows are damaged (`dflash inspect --verify`)"
)


def log_check(check: manifest.SelfCheck, out: Path) -> None:
    if check.passed:
        logger.info("self-check against the target %s", check.describe())
        return
    for failure in check.failures[:10]:
        logger.error("self-check: %s", describe_failure(failure))
    if no_layer_matches(check):
        logger.error("self-check: %s", NO_LAYER_MATCHES)
    raise DflashError(
        f"self-check against the target {check.describe()}: the stored features of {out} are not the target's "
        "(recorded in its manifest, so training can refuse the store); report this with the harvest's command line"
    )
