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
# flash-attn-4 (--attention-kernel-option BACKEND=FLASH), where carried. Its CuTe DSL's CUDA libraries are over one
# call's 64 MiB: a first call carries them alone (.fa4-libs/, the wheel's files as a tar.xz: `unzip` the
# nvidia_cutlass_dsl_libs_cu13-4.8.1 wheel, then `tar cf - . | xz -T2 -9e`, 61 MiB) and runs only
# `mkdir -p /tmp/fa4site && tar -xJf .fa4-libs/*.tar.xz -C /tmp/fa4site`; the next call on the same warm machine
# (within its 30 s) carries .device-wheels/ and .fa4-wheels/ (flash_attn_4-4.0.0b40, nvidia_cutlass_dsl-4.8.1,
# nvidia_cutlass_dsl_libs_base and _core-4.8.1, quack_kernels-0.6.5, apache_tvm_ffi-0.1.15.post2,
# torch_c_dlpack_ext-0.1.5; `pip download --no-deps` for python 3.12) and sources this file.
if [ -d .fa4-libs ]; then
    mkdir -p /tmp/fa4site && tar -xJf .fa4-libs/*.tar.xz -C /tmp/fa4site || return 1
fi
if [ -d .fa4-wheels ] && [ -d /tmp/fa4site/nvidia_cutlass_dsl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa4wh .fa4-wheels/*.whl || return 1
    cp -a /tmp/fa4wh/. /tmp/fa4site/  # one nvidia_cutlass_dsl folder from the three wheels that fill it
    export PYTHONPATH=$PYTHONPATH:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages PYTHONWARNINGS=ignore::UserWarning  # the CuTe DSL warns at every launch
fi
python3 - <<'PY'
import torch, transformers, zarr, numcodecs, fla
print(f"versions: torch {torch.__version__}, transformers {transformers.__version__}, zarr {zarr.__version__}, "
      f"numcodecs {numcodecs.__version__}, fla {fla.__version__}, GPU {torch.cuda.get_device_name()}")
from importlib.metadata import PackageNotFoundError, version
try:
    print(f"flash-attn-4 {version('flash-attn-4')}, nvidia-cutlass-dsl-libs-cu13 {version('nvidia-cutlass-dsl-libs-cu13')}")
except PackageNotFoundError:
    print("flash-attn-4: not installed (BACKEND=FLASH unavailable)")
PY
