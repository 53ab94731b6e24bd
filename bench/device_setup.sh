# Source this on the GPU machine, from the repository root: installs the carried wheels (zarr, numcodecs, fla,
# ...; the machine reaches no package index) under /tmp/site and keeps compile caches in /tmp.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-wheels/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/triton TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
# A Triton cache carried along (`.device-cache/triton.tar.xz`, written by an earlier call) spares the 2-3 minutes
# of compiling fla's kernels per fresh machine; runs record it (DFLASH_TRITON_CACHE), since their stage times are
# then not those of a cold machine.
export DFLASH_TRITON_CACHE=cold
if [ -f .device-cache/triton.tar.xz ]; then
    mkdir -p /tmp/triton && tar -xJf .device-cache/triton.tar.xz -C /tmp/triton --strip-components=1 && \
        export DFLASH_TRITON_CACHE=carried
fi
python3 - <<'PY'
import torch, transformers, zarr, numcodecs, fla
print(f"versions: torch {torch.__version__}, transformers {transformers.__version__}, zarr {zarr.__version__}, "
      f"numcodecs {numcodecs.__version__}, fla {fla.__version__}, GPU {torch.cuda.get_device_name()}")
PY
