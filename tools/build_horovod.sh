#!/usr/bin/env bash
# Build Horovod for the installed PyTorch and install it (gloo controller, PyTorch only).
#
#   tools/build_horovod.sh PYTHON        # what `make horovod` runs
#
# Horovod's last release, 0.28.1, asks CMake for C++14 in two places (the top-level
# CMakeLists.txt and horovod/torch/CMakeLists.txt); PyTorch >= 2.1 headers need C++17, so its
# build fails against any current PyTorch.  This script fetches the release's source
# distribution from PyPI, changes those two lines to C++17, and builds a wheel against the
# torch that PYTHON imports, without build isolation (so pip never brings another torch),
# with gloo and without MPI, TensorFlow or MXNet.  The wheel is kept under
# <venv>/wheels/torch-<version>/, so running it again (or after `pip uninstall horovod`)
# installs in seconds; a different torch gets its own build.
set -euo pipefail

PY=${1:-python3}
VERSION=0.28.1

if "$PY" -c "import horovod.torch" 2>/dev/null; then
    echo "horovod.torch is already importable by $PY ($("$PY" -c 'import horovod; print(horovod.__version__)'))"
    exit 0
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "error: $PY cannot import torch; run 'make setup' first" >&2
    exit 1
fi
for tool in cmake c++ make; do
    if ! command -v "$tool" >/dev/null; then
        echo "error: building Horovod needs '$tool' on PATH (Debian/Ubuntu: apt-get install cmake g++ make;" \
             "or '$PY -m pip install cmake' for cmake)" >&2
        exit 1
    fi
done

torch_version=$("$PY" -c "import torch; print(torch.__version__.replace('+', '_'))")
venv=$("$PY" -c "import sys; print(sys.prefix)")
wheels="$venv/wheels/torch-$torch_version"
mkdir -p "$wheels"

# Horovod's run-time dependencies, never torch: it is already there.
"$PY" -m pip install --quiet cloudpickle psutil pyyaml packaging cffi

wheel=$(ls "$wheels"/horovod-"$VERSION"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "Fetching Horovod $VERSION's source distribution from PyPI"
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "horovod==$VERSION" -d "$work"
    tar -xzf "$work/horovod-$VERSION.tar.gz" -C "$work"
    source_dir="$work/horovod-$VERSION"
    for file in CMakeLists.txt horovod/torch/CMakeLists.txt; do
        if ! grep -q 'set(CMAKE_CXX_STANDARD 14)' "$source_dir/$file"; then
            echo "error: $file of Horovod $VERSION does not ask for C++14 where expected; this script" \
                 "knows that release only" >&2
            exit 1
        fi
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$source_dir/$file"
    done
    echo "Building Horovod $VERSION against torch $torch_version (gloo, no MPI; several minutes)"
    (cd "$source_dir" && \
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=gloo \
        MAKEFLAGS="-j$(nproc)" \
        "$PY" -m pip wheel --quiet --no-build-isolation --no-deps -w "$wheels" .)
    wheel=$(ls "$wheels"/horovod-"$VERSION"-*.whl | head -n 1)
fi
"$PY" -m pip install --quiet --no-deps "$wheel"
"$PY" -c "import horovod.torch as hvd; print('horovod.torch imports:', hvd.__name__)"
echo "Horovod $VERSION installed from $wheel"
