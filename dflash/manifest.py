"""The store's manifest: a typed, validated record of what a store holds and how it was made.

`harvest.json` (written first) and `manifest.json` (written last) hold the same record; only the manifest has
`counts` and `parts`. Every field is checked once, when the file is read (`Manifest.from_json`): past that point
code reads attributes, never string keys. Format version 2 adds what training needs about the target (so
that it reads only the embedding and the LM head from the target's files) and the feature encoding (`features`:
precision, stored width, scale groups and the subspace projection); version-1 stores read as bf16, full width.
`teacher` (`--teacher`) is an optional field of version 2, absent from stores without one: those are what they
were before it existed, and a reader that ignores it reads the rest of a teacher store unchanged. Version 3 adds
each part's `digests` array, which binds every chunk to its place (dflash.store.reader.chunk_digest); version-2
stores are read without that check.
"""

import dataclasses
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.errors import DflashError

logger = logging.getLogger("dflash")

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
DIGESTS_SINCE = 3  # the first format version whose parts hold `digests`
PART_NAME = re.compile(r"rank\d{5}")
PRECISIONS = ("bf16", "fp8")
# The target's next-token distribution stored per position (`--teacher`), by kind: array name -> dtype.
TEACHER_ARRAYS = {
    "topk": {"teacher_ids": "int32", "teacher_probs": "float16", "teacher_tail": "float16"},
    "hidden": {"teacher_hidden": "bfloat16"},
}


@dataclass(frozen=True)
class TargetSpec:
    """The target model as training needs it: identity, and the text-model fields the drafter copies."""

    name: str  # the checkpoint's name (fingerprint.model holds the path the harvest loaded)
    model_type: str
    config_hash: str  # sha256 of config.json, canonical (sorted keys, no whitespace)
    num_layers: int  # of the whole target
    hidden_size: int
    vocab_size: int
    # The drafter's shape (None only in version-1 stores, which training completes from the target's config.json).
    intermediate_size: int | None = None  # None also for MoE targets without a dense FFN
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float | None = None
    rope_theta: float | None = None
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False

    @property
    def has_text_config(self) -> bool:
        return self.num_attention_heads is not None

    def text_config(self) -> dict:
        """The fields `DrafterConfig.from_target_config` reads, as a transformers-style dict."""
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_layers,
            "tie_word_embeddings": self.tie_word_embeddings,
        }


@dataclass(frozen=True)
class TargetIdentity:
    """Which target checkpoint a store, a held-out store or a drafter was made from: its name (a folder's name, or
    a hub name) and the fingerprint of its weights (`weights_sha256`, docs/shard-format.md), None where the record
    predates it. The config alone does not tell a fine-tune from its base."""

    name: str
    weights_sha256: str | None

    @classmethod
    def of_checkpoint(cls, path: str) -> "TargetIdentity":
        from dflash.target_files import weights_sha256  # torch: only where a checkpoint is read

        return cls(Path(path).name if Path(path).is_dir() else str(path), weights_sha256(path))

    @classmethod
    def from_record(cls, record: dict | None) -> "TargetIdentity":
        """From an export's `dflash_target` (None: exported before dflash recorded it)."""
        record = record or {}
        return cls(record.get("name", ""), record.get("weights_sha256"))

    def to_record(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """Its digest's first 12 digits and its name."""
        digest = self.weights_sha256[:12] if self.weights_sha256 else "not recorded"
        return f"{digest} ({self.name})" if self.name else digest


def check_same_weights(
    expected: TargetIdentity, given: TargetIdentity, what: str, fix: str, flag: str | None = None, allowed=False
) -> None:
    """Compare the weights of `what` (a phrase naming both sides: "the weights of A and of B"): `given`'s must be
    `expected`'s. Other weights are refused naming both digests and `fix`, unless `allowed` (by `flag`, for a
    deliberate fine-tune; None: a command with no such flag): then a warning. Where a side records no digest (made
    by a dflash from before the record) there is nothing to compare: a note says so."""
    digests = f"weights_sha256 {given.describe()} against {expected.describe()}"
    if expected.weights_sha256 is None or given.weights_sha256 is None:
        logger.info("%s: not compared (%s; made by an older dflash, a record holds no digest)", what, digests)
        return
    if given.weights_sha256 == expected.weights_sha256:
        return
    if allowed:
        logger.warning("%s differ (%s); going on as %s asks", what, digests, flag)
        return
    override = f", or pass {flag} if the difference is deliberate" if flag else ""
    raise DflashError(f"{what} differ ({digests}): {fix}{override}")


@dataclass(frozen=True)
class TokenizerSpec:
    name: str
    vocab_size: int
    special_ids: dict  # bos, eos, pad, unk, mask -> id or None

    @property
    def mask_id(self) -> int | None:
        return self.special_ids.get("mask")


@dataclass(frozen=True)
class SubspaceSpec:
    """The stored features are `P h`: P [width, feature_dim] (orthonormal rows) in the store's `projection` array."""

    width: int
    captured: float  # share of the calibration features' uncentered second moment inside the subspace
    calibration_tokens: int
    calibration_documents: int


@dataclass(frozen=True)
class FeatureSpec:
    """How a token's features are stored: `width` values of `precision`, with `scale_groups` scales for fp8."""

    precision: str = "bf16"
    width: int = 0  # stored values per token: feature_dim, or the subspace width
    scale_groups: int = 0  # fp8: equal slices of the width, each with its own power-of-two scale per token
    subspace: SubspaceSpec | None = None

    @property
    def bytes_per_value(self) -> int:
        return 1 if self.precision == "fp8" else 2


@dataclass(frozen=True)
class TeacherSpec:
    """The target's next-token distribution at every stored position (docs/shard-format.md, "Teacher"): the top
    `k` probabilities with their ids and the tail mass (topk), or the final-normed last hidden state (hidden)."""

    kind: str  # "topk" | "hidden"
    k: int = 0  # topk: probabilities kept per position; 0 for hidden
    width: int = 0  # values per position of each array: k, or the target's hidden size
    arrays: dict = field(default_factory=dict)  # array name -> dtype (TEACHER_ARRAYS[kind])

    @property
    def name(self) -> str:
        """The `--teacher` value: topk:K or hidden."""
        return f"topk:{self.k}" if self.kind == "topk" else self.kind

    @property
    def bytes_per_token(self) -> int:
        """Uncompressed: ids and probabilities of k entries plus the tail (topk), or the bf16 hidden state."""
        if self.kind == "topk":
            return self.k * (4 + 2) + 2
        return 2 * self.width

    def describe(self) -> str:
        if self.kind == "topk":
            return f"top-{self.k} next-token probabilities (float16), ids (int32) and tail mass (float16)"
        return f"the final-normed last hidden state ({self.width} bfloat16 values)"


def teacher_spec(kind: str, k: int, hidden_size: int) -> TeacherSpec:
    """The spec this dflash writes for a kind of teacher."""
    width = k if kind == "topk" else hidden_size
    return TeacherSpec(kind, k if kind == "topk" else 0, width, dict(TEACHER_ARRAYS[kind]))


@dataclass(frozen=True)
class Counts:
    documents: int
    tokens: int
    loss_tokens: int
    padding_tokens: int
    rows: int


@dataclass(frozen=True)
class PartEntry:
    name: str  # rankNNNNN: a folder under parts/, never a path
    rows: int
    documents: int
    tokens: int
    loss_tokens: int
    padding_tokens: int


@dataclass(frozen=True)
class CheckFailure:
    """One document whose stored features differ from a fresh forward by more than the encoding error."""

    doc_id: int
    piece: int
    row: int  # global row index
    layer: int | None  # the tapped layer whose slice failed (None for a subspace store: P mixes the layers)
    relative_error: float
    matches_layer: int | None = None  # another layer of the fresh forward that matches that slice better


@dataclass(frozen=True)
class TeacherCheck:
    """The teacher arrays of the checked documents against the fresh forward's: per document, the mean over its
    positions of the total variation between the stored and the fresh top-k distributions (tail included), or the
    relative error of the stored final hidden state."""

    tolerance: float
    worst_error: float
    failures: tuple[CheckFailure, ...] = ()  # layer None: the teacher arrays


@dataclass(frozen=True)
class SelfCheck:
    """The store checked against its target (`dflash inspect --reforward`, run at the end of a harvest): stored
    documents drawn at random, each re-run alone and unpadded, every stored value compared with the fresh one."""

    passed: bool
    documents: int
    seed: int
    tolerance: float  # relative error (norm of the difference / norm of the fresh features) allowed per slice
    worst_relative_error: float
    bit_equal: float  # share of the stored values bit-equal to the fresh forward's encoding
    failures: tuple[CheckFailure, ...] = ()
    teacher: TeacherCheck | None = None  # stores with a teacher

    def describe(self) -> str:
        failed = len(self.failures) + (len(self.teacher.failures) if self.teacher else 0)
        verdict = "passed" if self.passed else f"FAILED on {failed} slice(s)"
        teacher = ""
        if self.teacher is not None:
            teacher = f"; teacher worst error {self.teacher.worst_error:.2e} (tolerance {self.teacher.tolerance:.2e})"
        return (
            f"{verdict}: {self.documents} documents re-run alone, worst relative error {self.worst_relative_error:.2e}"
            f" (tolerance {self.tolerance:.2e}), {self.bit_equal:.2%} of values bit-equal{teacher}"
        )


@dataclass(frozen=True)
class Manifest:
    format_version: int
    dflash_version: str
    fingerprint: dict  # the harvest settings that decide the content: a store is resumed only under the same ones
    options: dict  # the harvest options as given (without rank / device)
    target: TargetSpec
    layer_ids: tuple[int, ...]
    feature_dim: int  # len(layer_ids) * target.hidden_size: the width the drafter's fc takes at inference
    features: FeatureSpec
    dtype: str  # the dtype the target's features are rounded to before encoding ("bfloat16")
    token_budget: int
    tokenizer: TokenizerSpec
    data: dict  # the input's name, size, sha256 and tokenization stats
    codecs: dict  # array kind -> zarr codec configurations
    identity: str = ""  # sha256 of the content-deciding fields (fingerprint, target, tokenizer, features, codecs)
    counts: Counts | None = None  # manifest.json only
    parts: tuple[PartEntry, ...] = ()
    self_check: SelfCheck | None = None  # manifest.json only, when the harvest (or inspect) ran the check
    format: str = "dflash-harvest"
    sources: tuple[dict, ...] = ()  # per data source: records read, deduplicated, used, documents, tokens (optional)
    teacher: TeacherSpec | None = None  # `--teacher`: absent from the JSON (and no teacher arrays) when None
    extra: dict = field(default_factory=dict)  # keys written by a newer dflash, kept on rewrite

    @property
    def complete(self) -> bool:
        return self.counts is not None

    @property
    def world_size(self) -> int:
        return int(self.fingerprint["world_size"])

    @property
    def target_identity(self) -> TargetIdentity:
        """The checkpoint the store was harvested from (stores older than `weights_sha256` record no digest)."""
        return TargetIdentity(self.target.name, self.fingerprint.get("weights_sha256"))

    def with_parts(self, parts: list[PartEntry]) -> "Manifest":
        totals = {
            key: sum(getattr(p, key) for p in parts) for key in ("documents", "tokens", "loss_tokens", "padding_tokens")
        }
        counts = Counts(**totals, rows=sum(p.rows for p in parts))
        return dataclasses.replace(self, counts=counts, parts=tuple(parts))

    def header(self) -> "Manifest":
        """The record without counts and parts: what harvest.json holds."""
        return dataclasses.replace(self, counts=None, parts=(), self_check=None)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        extra = out.pop("extra")
        out["layer_ids"] = list(self.layer_ids)
        if self.counts is None:
            del out["counts"], out["parts"]
        if self.self_check is None:
            del out["self_check"]
        elif self.self_check.teacher is None:
            del out["self_check"]["teacher"]
        if self.teacher is None:
            del out["teacher"]
        if not self.sources:
            del out["sources"]
        else:
            out["sources"] = list(self.sources)
        return {**extra, **out}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> "Manifest":
        """Validate every field of a manifest or harvest.json read from `where`; DflashError names the first bad one."""
        return _parse_manifest(raw, where)

    def describe(self) -> list[str]:
        """Lines for `dflash inspect`."""
        t, tok, f = self.target, self.tokenizer, self.features
        mode = f"{f.precision}" + (f", {f.scale_groups} scale group(s) per token" if f.precision == "fp8" else "")
        if f.subspace is not None:
            mode += (
                f", subspace {f.subspace.width} of {self.feature_dim} (captured {f.subspace.captured:.2%} of the "
                f"second moment on {f.subspace.calibration_tokens} calibration tokens)"
            )
        return [
            f"target     {t.name} ({t.model_type}), {t.num_layers} layers, hidden {t.hidden_size}, vocab "
            f"{t.vocab_size}, config sha256 {t.config_hash[:12]}",
            f"features   layers {list(self.layer_ids)} -> {self.feature_dim} features; stored {f.width} per token "
            f"as {mode}",
            f"tokenizer  {tok.name}, vocab {tok.vocab_size}, special ids {tok.special_ids}",
            f"rows       {self.token_budget} tokens each; codec {self.codecs['hidden'][0]['name']} "
            f"{self.codecs['hidden'][0].get('configuration', {})} + crc32c",
            *([f"teacher    {self.teacher.describe()} per position"] if self.teacher else []),
            f"identity   {self.identity[:16]}",
            *(
                f"source     {s['source']}: {s['records']} records read, {s['deduplicated']} duplicates dropped, "
                f"{s['used']} used -> {s['documents']} documents, {s['tokens']} tokens ({s['loss_tokens']} with loss)"
                for s in self.sources
            ),
        ]


# ---------------------------------------------------------------------------------------------- validation


class _Fields:
    """Typed access to one JSON object, naming the file and the key on every problem."""

    def __init__(self, raw: Any, where: str, prefix: str = ""):
        if not isinstance(raw, dict):
            raise DflashError(f"{where}: {prefix or 'the file'} is not a JSON object; the store is damaged")
        self.raw, self.where, self.prefix = raw, where, prefix

    def _bad(self, key: str, want: str) -> DflashError:
        return DflashError(
            f"{self.where}: field {self.prefix}{key} is {self.raw.get(key)!r}, expected {want}; the file is damaged or "
            "was edited: restore it, or harvest again"
        )

    def get(self, key: str, kind, *default):
        if key not in self.raw:
            if default:
                return default[0]
            raise DflashError(
                f"{self.where}: field {self.prefix}{key} is missing; the file is damaged: restore it or harvest again"
            )
        value = self.raw[key]
        if value is None and default and default[0] is None:
            return None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise self._bad(key, kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind))
        return value

    def count(self, key: str, minimum: int = 0) -> int:
        value = self.get(key, int)
        if value < minimum:
            raise self._bad(key, f"an integer of at least {minimum}")
        return value

    def sub(self, key: str) -> "_Fields":
        return _Fields(self.get(key, dict), self.where, f"{self.prefix}{key}.")


def _target(f: _Fields) -> TargetSpec:
    optional = {
        "intermediate_size": int,
        "num_attention_heads": int,
        "num_key_value_heads": int,
        "head_dim": int,
        "rms_norm_eps": float,
        "rope_theta": float,
        "max_position_embeddings": int,
    }
    return TargetSpec(
        name=f.get("name", str),
        model_type=f.get("model_type", str),
        config_hash=f.get("config_hash", str),
        num_layers=f.count("num_layers", 1),
        hidden_size=f.count("hidden_size", 1),
        vocab_size=f.count("vocab_size", 1),
        **{key: f.get(key, kind, None) for key, kind in optional.items()},
        tie_word_embeddings=f.get("tie_word_embeddings", bool, False),
    )


def _features(raw: Any, where: str, feature_dim: int) -> FeatureSpec:
    if raw is None:  # version 1: bf16, full width
        return FeatureSpec("bf16", feature_dim, 0, None)
    f = _Fields(raw, where, "features.")
    precision = f.get("precision", str)
    if precision not in PRECISIONS:
        raise f._bad("precision", " or ".join(PRECISIONS))
    width, groups = f.count("width", 1), f.count("scale_groups")
    if (precision == "fp8") != (groups > 0) or (groups and width % groups):
        raise f._bad("scale_groups", "a divisor of the width for fp8, 0 for bf16")
    subspace = None
    if f.raw.get("subspace") is not None:
        s = f.sub("subspace")
        subspace = SubspaceSpec(
            s.count("width", 1),
            s.get("captured", float),
            s.count("calibration_tokens"),
            s.count("calibration_documents"),
        )
        if subspace.width != width or width > feature_dim:
            raise s._bad("width", f"the stored width {width}, at most {feature_dim}")
    elif width != feature_dim:
        raise f._bad("width", f"the feature width {feature_dim} (no subspace)")
    return FeatureSpec(precision, width, groups, subspace)


class NewerFormat(DflashError):
    """A store of a format newer than this dflash reads: every command that meets it (inspect, train, harvest) gives
    this one message as it is, since no rerun or repair of this dflash mends it."""


def _parse_manifest(raw: Any, where: str) -> Manifest:
    f = _Fields(raw, where)
    version = f.get("format_version", int)
    if version > max(READABLE_VERSIONS):
        raise NewerFormat(
            f"{where} was written by a newer dflash (format version {version} > {max(READABLE_VERSIONS)}, the newest "
            "this dflash reads): upgrade dflash to read it, or harvest again into a new folder with this version"
        )
    if version not in READABLE_VERSIONS:
        raise DflashError(
            f"{where} has store format version {version}; this dflash reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}: use a matching dflash version or harvest again"
        )
    target = _target(f.sub("target"))
    layer_ids = f.get("layer_ids", list)
    if not layer_ids or not all(isinstance(i, int) and 0 <= i < target.num_layers for i in layer_ids):
        raise f._bad("layer_ids", f"a list of layer indices in 0..{target.num_layers - 1}")
    feature_dim = f.count("feature_dim", 1)
    if feature_dim != len(layer_ids) * target.hidden_size:
        raise f._bad("feature_dim", f"{len(layer_ids)} layers x {target.hidden_size}")
    tok = f.sub("tokenizer")
    known = {fl.name for fl in dataclasses.fields(Manifest)}
    manifest = Manifest(
        format_version=version,
        dflash_version=f.get("dflash_version", str),
        fingerprint=f.get("fingerprint", dict),
        options=f.get("options", dict),
        target=target,
        layer_ids=tuple(layer_ids),
        feature_dim=feature_dim,
        features=_features(raw.get("features"), where, feature_dim),
        dtype=f.get("dtype", str),
        token_budget=f.count("token_budget", 1),
        tokenizer=TokenizerSpec(tok.get("name", str), tok.count("vocab_size", 1), tok.get("special_ids", dict)),
        data=f.get("data", dict),
        codecs=f.get("codecs", dict),
        identity=f.get("identity", str, ""),
        format=f.get("format", str, "dflash-harvest"),
        sources=tuple(_source(_Fields(s, where, f"sources[{i}].")) for i, s in enumerate(f.get("sources", list, []))),
        teacher=None if raw.get("teacher") is None else _teacher(f.sub("teacher"), target),
        extra={k: v for k, v in raw.items() if k not in known and k not in ("storage",)},
    )
    _Fields(manifest.fingerprint, where, "fingerprint.").count("world_size", 1)
    if raw.get("self_check") is not None:
        manifest = dataclasses.replace(manifest, self_check=_self_check(f.sub("self_check")))
    if "counts" not in raw:
        return manifest
    parts = [_part(_Fields(p, where, f"parts[{i}].")) for i, p in enumerate(f.get("parts", list))]
    if len(parts) != manifest.world_size or [p.name for p in parts] != [f"rank{r:05d}" for r in range(len(parts))]:
        raise f._bad("parts", f"one entry per rank, rank00000..rank{manifest.world_size - 1:05d} in order")
    complete = manifest.with_parts(parts)
    c = f.sub("counts")
    recorded = Counts(*(c.count(key) for key in ("documents", "tokens", "loss_tokens", "padding_tokens", "rows")))
    if recorded != complete.counts:
        raise f._bad("counts", f"the sums over its parts {dataclasses.asdict(complete.counts)}")
    return complete


def _teacher(f: _Fields, target: TargetSpec) -> TeacherSpec:
    kind = f.get("kind", str)
    if kind not in TEACHER_ARRAYS:
        raise f._bad("kind", " or ".join(TEACHER_ARRAYS))
    k = f.count("k", 1) if kind == "topk" else 0
    if k > target.vocab_size:
        raise f._bad("k", f"at most the vocabulary size {target.vocab_size}")
    expected = teacher_spec(kind, k, target.hidden_size)
    if f.count("width") != expected.width:
        raise f._bad("width", str(expected.width))
    if f.get("arrays", dict) != expected.arrays:
        raise DflashError(
            f"{f.where}: the teacher arrays {f.raw['arrays']} are not the {expected.arrays} this dflash reads for "
            f"--teacher {kind}; use the dflash version that harvested the store, or harvest again"
        )
    return expected


def _source(f: _Fields) -> dict:
    counts = ("records", "deduplicated", "used", "documents", "tokens", "loss_tokens")
    return {"source": f.get("source", str), "weight": f.get("weight", float), **{key: f.count(key) for key in counts}}


def _part(f: _Fields) -> PartEntry:
    name = f.get("name", str)
    if not PART_NAME.fullmatch(name):
        raise f._bad("name", "rankNNNNN (a part folder's name, never a path)")
    return PartEntry(name, *(f.count(key) for key in ("rows", "documents", "tokens", "loss_tokens", "padding_tokens")))


def _self_check(f: _Fields) -> SelfCheck:
    teacher = None
    if f.raw.get("teacher") is not None:
        t = f.sub("teacher")
        teacher = TeacherCheck(t.get("tolerance", float), t.get("worst_error", float), _failures(t))
    bit_equal = f.get("bit_equal", float)
    if not 0.0 <= bit_equal <= 1.0:
        raise f._bad("bit_equal", "a share between 0 and 1")
    return SelfCheck(
        f.get("passed", bool),
        f.count("documents"),
        f.get("seed", int),
        f.get("tolerance", float),
        f.get("worst_relative_error", float),
        bit_equal,
        _failures(f),
        teacher,
    )


def _failures(f: _Fields) -> tuple[CheckFailure, ...]:
    failures = []
    for i, raw in enumerate(f.get("failures", list)):
        g = _Fields(raw, f.where, f"{f.prefix}failures[{i}].")
        failures.append(
            CheckFailure(
                g.get("doc_id", int),
                g.count("piece"),
                g.count("row"),
                g.get("layer", int, None),
                g.get("relative_error", float),
                g.get("matches_layer", int, None),
            )
        )
    return tuple(failures)


def identity_of(manifest: Manifest) -> str:
    """A content fingerprint of the store: equal for two stores that hold the same rows."""
    import hashlib

    keyed = {
        k: v
        for k, v in manifest.header().to_json().items()
        if k in ("fingerprint", "target", "tokenizer", "features", "codecs", "layer_ids", "token_budget", "teacher")
    }
    return hashlib.sha256(json.dumps(keyed, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
