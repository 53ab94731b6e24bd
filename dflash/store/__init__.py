"""The harvest store: a folder holding a Zarr v3 group of per-rank parts and JSON bookkeeping.

    harvest.json                      written first: the manifest without counts (dflash.manifest)
    zarr.json, parts/zarr.json        Zarr v3 groups
    projection/                       subspace stores only: P [width, feature_dim] float32
    parts/rank00000/<array>/          hidden, (scales,) input_ids, position_ids, doc_ids, loss_mask, (teacher_*,)
                                      digests (each chunk's place), documents
    parts/rank00000/progress.json     rows committed and the header they were written under; rewritten only after
                                      those rows' chunks are on disk
    manifest.json                     written last: the store is complete only once it exists

Every file is replaced atomically (zarr writes chunks to a temporary file and renames it; the JSON files here
do the same), so a killed harvest leaves committed rows intact and resumes from `rows_committed`.
The exact format, and how to read it with plain zarr, is in docs/shard-format.md.

This module is where callers find the store's names: its layout and read side (`Store.open`) are
dflash.store.reader's, its write side dflash.store.writer's, its JSON bookkeeping dflash.store.bookkeeping's.
"""

from dflash.locks import LOCK_FILE  # noqa: F401
from dflash.manifest import FORMAT_VERSION, FeatureSpec  # noqa: F401
from dflash.store.bookkeeping import (  # noqa: F401  (re-exported: dflash.store is where callers find them)
    CONTENT_KEYS,
    DOCUMENT_SOURCES,
    DOCUMENT_SOURCES_FIX,
    FINGERPRINT_BEFORE,
    FINGERPRINT_UNRECORDED,
    HARVEST_FILE,
    MANIFEST_FILE,
    PART_COUNTS,
    PROGRESS_FILE,
    PROJECTION,
    PROJECTION_FIX,
    REPAIR,
    TMP_PREFIX,
    as_recorded,
    check_header,
    check_parts_agree,
    content_sha256,
    header_content,
    header_differences,
    header_sha256,
    missing_chunks,
    missing_committed_chunks,
    part_name,
    part_progress,
    read_json,
    read_manifest,
    read_progress,
    read_whole,
    write_json_atomic,
    write_json_exclusive,
)
from dflash.store.folder import (  # noqa: F401  (re-exported)
    check_folder,
    check_writable,
    nearest_existing,
    part_lock,
)
from dflash.store.reader import (  # noqa: F401  (re-exported)
    BF16,
    CHUNK_BYTES,
    DIGESTS,
    DIRECT_DECODERS,
    DOCUMENT_COLUMNS,
    HIDDEN_BLOSC,
    HIDDEN_DTYPES,
    SCALE_DTYPE,
    TEACHER_DTYPES,
    TOKEN_ARRAYS,
    ChunkReader,
    Store,
    array_config,
    arrays_of,
    chunk_columns,
    chunk_digest,
    compressors_of,
    damaged_whole_arrays,
    disk_bytes,
    document_digests,
    hidden_chunk_tokens,
    hidden_compressors,
    misplaced,
    misplaced_documents,
    open_manifest,
    place_digest,
    read_document_sources,
    read_projection,
    row_arrays,
    stored_checksum,
    target_path,
    teacher_arrays,
    token_compressors,
)
from dflash.store.writer import (  # noqa: F401  (re-exported)
    CHUNK_WRITTEN,
    DOC_CHUNK,
    HIDDEN_ENCODINGS,
    TEACHER_MEANINGS,
    HiddenChunkWriter,
    PartContent,
    PartSpec,
    PartWriter,
    create_part_arrays,
    create_store,
    finalize,
    new_manifest,
    record_digests,
    record_self_check,
    write_document_sources,
    write_projection,
    write_store,
)
