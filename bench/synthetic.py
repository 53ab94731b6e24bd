"""The synthetic data of bench/train.py (and bench/reader.py): a fake target folder holding only config.json and the
embedding / LM head, and a store of random features written through the real store writer."""

import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dflash import features, store
from dflash.drafter.step_time import bench_target_config
from dflash.errors import DflashError
from dflash.harvest import RowEncoder, store_bits
from dflash.manifest import FeatureSpec, Manifest, SubspaceSpec, TargetSpec, TokenizerSpec, teacher_spec
from dflash.target import default_layer_ids
from dflash.train.setup import Env


def fake_target(folder: Path, s: dict, device: torch.device):
    """A target folder with only config.json and the embedding / LM head (all the trainer reads of a target)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    bench_target_config(s).save_pretrained(folder)
    g = torch.Generator(device).manual_seed(0)

    def weight():
        w = torch.randn(s["vocab"], s["hidden"], device=device, generator=g, dtype=torch.bfloat16)
        return (w * 0.02).cpu()

    save_file({"model.embed_tokens.weight": weight(), "lm_head.weight": weight()}, folder / "model.safetensors")


# --encoding: name -> (precision, the stored width's share of the feature width: 1, or 1/D for a subspace of D)
ENCODINGS = {
    "bf16": ("bf16", 1),
    "fp8": ("fp8", 1),
    "sub1/4": ("bf16", 4),
    "sub1/8": ("bf16", 8),
    "sub1/4+fp8": ("fp8", 4),
}


def store_header(target: Path, s: dict, encoding: str, teacher: str | None = None) -> Manifest:
    """harvest.json as a harvest of the fake target would write it, in the store `encoding`, with `teacher`
    arrays (a --teacher value) when given."""
    layers = default_layer_ids(s["target_layers"])
    feature_dim = len(layers) * s["hidden"]
    precision, divisor = ENCODINGS[encoding]
    width = feature_dim // divisor
    fp8 = precision == "fp8"
    groups = features.default_scale_groups(width, len(layers), divisor > 1) if fp8 else 0
    subspace = SubspaceSpec(width, 1.0, 0, 0) if divisor > 1 else None
    return store.new_manifest(
        target=TargetSpec(
            name=str(target),
            model_type="qwen3",
            config_hash="synthetic",
            num_layers=s["target_layers"],
            hidden_size=s["hidden"],
            vocab_size=s["vocab"],
            intermediate_size=s["ffn"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"],
            head_dim=s["head_dim"],
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            max_position_embeddings=40960,
        ),
        layer_ids=layers,
        token_budget=s["doc_len"] * s["docs_per_row"],
        tokenizer=TokenizerSpec(str(target), s["vocab"], {"mask": s["vocab"] - 1}),
        fingerprint={"model": str(target), "layers": layers, "world_size": 1},
        features=FeatureSpec("fp8" if fp8 else "bf16", width, groups, subspace),
        teacher=teacher_of(teacher, s),
    )


def teacher_of(teacher: str | None, s: dict):
    if teacher is None:
        return None
    kind, _, k = teacher.partition(":")
    return teacher_spec(kind, int(k or 0), s["hidden"])


def teacher_row(spec, T: int, vocab: int, rng: np.random.Generator) -> dict:
    """Random teacher arrays of one row: a top-k distribution (distinct ids, probabilities falling) or a bf16
    final hidden state, as a harvest stores them."""
    if spec is None:
        return {}
    if spec.kind == "hidden":
        values = torch.randn(T, spec.width, dtype=torch.bfloat16)
        return {"teacher_hidden": values.view(torch.int16).numpy().view(np.uint16)}
    probs = np.sort(rng.dirichlet(np.ones(spec.k + 1), T)[:, : spec.k], axis=1)[:, ::-1]
    ids = np.stack([rng.choice(vocab - 1, spec.k, replace=False) for _ in range(T)]).astype(np.int32)
    tail = 1 - probs.sum(1)
    return {"teacher_ids": ids, "teacher_probs": probs.astype(np.float16), "teacher_tail": tail.astype(np.float16)}


def synthetic_store(
    out: Path, target: Path, s: dict, rows: int, device: torch.device, encoding: str, teacher: str | None = None
):
    """`rows` rows of `docs_per_row` whole documents each, random bf16 features encoded as a harvest would
    (a random orthonormal projection for a subspace), written through the real part writer."""
    header = store_header(target, s, encoding, teacher)
    T, F, L, D = header.token_budget, header.feature_dim, s["doc_len"], s["docs_per_row"]
    g = torch.Generator(device).manual_seed(1)
    rng = np.random.default_rng(1)
    projection = None
    if header.features.subspace is not None:
        basis = torch.randn(F, header.features.width, device=device, generator=g, dtype=torch.float32)
        projection = torch.linalg.qr(basis)[0].T.contiguous()
    encoder = RowEncoder(header.features, projection, (1, T), device)
    encoded = None if encoder.identity else encoder.buffers(device=device)

    def row(r: int):
        hidden = torch.randn(1, T, F, device=device, generator=g, dtype=torch.bfloat16)
        stored = {name: store_bits(t[0].cpu()) for name, t in encoder.encode(hidden, encoded).items()}
        tokens = {
            "input_ids": rng.integers(0, s["vocab"] - 1, T, dtype=np.int32),  # never the mask token
            "position_ids": (np.arange(T) % L).astype(np.int32),
            "doc_ids": (r * D + np.arange(T) // L).astype(np.int32),
            "loss_mask": np.ones(T, np.uint8),
        }
        return stored.pop("hidden"), {**stored, **tokens, **teacher_row(header.teacher, T, s["vocab"], rng)}

    documents = np.array([[r * D + d, 0, r, d * L, L] for r in range(rows) for d in range(D)], np.int64)
    counts = {"documents": rows * D, "tokens": rows * T, "loss_tokens": rows * T, "padding_tokens": 0}
    content = store.PartContent(rows, documents, counts, row)
    store.write_store(out, header, [content], None if projection is None else projection.cpu().numpy())


def prepare_data(root: Path, s: dict, rows: int, device: torch.device, encoding: str, teacher=None) -> float:
    """Fake target + store under `root`, reused when a previous run made them with the same shapes."""
    spec = {**s, "rows": rows, "encoding": encoding, "teacher": teacher, "format_version": store.FORMAT_VERSION}
    done = root / "spec.json"
    if done.exists() and json.loads(done.read_text()) == spec:
        return 0.0
    t0 = time.perf_counter()
    shutil.rmtree(root, ignore_errors=True)
    fake_target(root / "target", s, device)
    synthetic_store(root / "store", root / "target", s, rows, device, encoding, teacher)
    done.write_text(json.dumps(spec))  # last: marks both complete
    return time.perf_counter() - t0


def shared_data(root: Path, s: dict, rows: int, env: Env, encoding: str, teacher: str | None = None) -> float:
    """Rank 0 builds the data and empties the run folder while the other ranks wait. If rank 0 fails, the others
    stop with an error here rather than wait for collectives that never come."""
    built = [None]
    try:
        if env.main:
            built[0] = prepare_data(root, s, rows, env.device, encoding, teacher)
            shutil.rmtree(root / "run", ignore_errors=True)
            (root / "run").mkdir(parents=True)
    finally:
        if env.world_size > 1:
            dist.broadcast_object_list(built, src=0)  # also the barrier
    if built[0] is None:
        raise DflashError("rank 0 could not build the synthetic data (its error is in its output)")
    return built[0]
