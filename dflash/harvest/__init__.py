"""The harvest: run the frozen target once over the data and write its tapped features to the store.

Before any forward, every input is validated and a deterministic packing plan fixes which document goes to
which rank, row and offset; the store's arrays are preallocated from it, so a rerun resumes after the committed
rows. The modules: `options` (the checks, the encoding, the fingerprint), `header` (harvest.json's records),
`calibration` (a subspace store's projection), `pipeline` (the forward and write loop of a part), `driver` (one
part's harvest from start to finish, resume and repair included).
"""

from dflash.harvest.driver import Interrupted, run_harvest
from dflash.harvest.header import document_sources, target_spec
from dflash.harvest.options import (
    BEST_CODEC_RATIO,
    BLOCK_SIZE,
    check_free_space,
    check_options,
    data_config,
    feature_encoding,
    row_bytes,
    subspace_width,
    tapped_layers,
    teacher_encoding,
)
from dflash.harvest.pipeline import HOST_BUFFERS, PipelineStalls, RowEncoder, TeacherEncoder, store_bits

__all__ = [
    "BEST_CODEC_RATIO",
    "BLOCK_SIZE",
    "HOST_BUFFERS",
    "Interrupted",
    "PipelineStalls",
    "RowEncoder",
    "TeacherEncoder",
    "check_free_space",
    "check_options",
    "data_config",
    "document_sources",
    "feature_encoding",
    "row_bytes",
    "run_harvest",
    "store_bits",
    "subspace_width",
    "tapped_layers",
    "target_spec",
    "teacher_encoding",
]
