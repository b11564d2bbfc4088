#!/usr/bin/env bash
# Transformer Engine 2.12.0 for an offline CUDA 13 / Python 3.12 machine whose calls carry
# at most 64 MiB (the lent H200: /work/.library/device, ../shared/te/README.md).
#
#   here:       tools/te_wheels.sh fetch [TORCH_EXT_WHEEL]  # -> .te/small, .te/part0..N-1
#   device:     tools/te_wheels.sh stage K                 # one call per part, .te/partK carried
#   device:     tools/te_wheels.sh install                 # last call: reassemble + install
#               export PYTHONPATH=$PYTHONPATH:/tmp/te_site
#
# Why 2.12.0: every cu13 release >= 2.13 imports cublasLtGroupedMatrixLayoutInit_internal,
# which the cuBLAS pinned by torch 2.11 (13.1.0.3) lacks; Megatron-Core 0.19's TEGroupedMLP
# needs TE >= 2.10. transformer_engine_torch is an sdist on the registry: TORCH_EXT_WHEEL is
# one built on the device (`pip wheel --no-build-isolation --no-deps` with NVTE_PYTORCH_FORCE_BUILD).
# The core wheel (190 MB) travels split in parts; parts outside the checkout (/tmp) survive
# between calls while the machine stays warm (30 s), so the calls must follow each other.
# Everything installs with ONE `pip install --target`: a second install of the core wheel
# into the same target replaces transformer_engine/ and loses the torch extension.
set -euo pipefail
VERSION=2.12.0
REPO=$(cd "$(dirname "$0")/.." && pwd)
DIR=$REPO/.te
PARTS_DIR=/tmp/te_parts
TARGET=${TE_TARGET:-/tmp/te_site}
CORE=transformer_engine_cu13-$VERSION-py3-none-manylinux_2_28_x86_64.whl

fetch() {  # fetch [TORCH_EXT_WHEEL]: the wheels, the core one split to fit beside the tree
    local ext=${1:-$REPO/../shared/te/transformer_engine_torch-$VERSION-cp312-cp312-linux_x86_64.whl}
    [ -f "$ext" ] || { echo "no transformer_engine_torch wheel at $ext" >&2; exit 2; }
    rm -rf "$DIR" && mkdir -p "$DIR/dl" "$DIR/small"
    local plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp $plat --platform manylinux2014_x86_64 --platform any -d "$DIR/dl" \
        transformer_engine==$VERSION transformer_engine_cu13==$VERSION pydantic==2.14.4 \
        pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
        typing-extensions==4.16.0 nvdlfw-inspect==0.2.2
    cp "$ext" "$DIR/small/"
    find "$DIR/dl" -name '*.whl' ! -name "$CORE" -exec mv {} "$DIR/small/" \;
    (cd "$DIR/dl" && sha256sum "$CORE" > "$DIR/small/core.sha256")
    # the part size leaves room for the tree that travels with every call, and the last
    # call's small wheels (.te/small, .whl: up to 8 MiB) within the 64 MiB a call carries
    local tree room size
    tree=$(cd "$REPO" && git ls-files -z | xargs -0 du -cb | tail -n 1 | cut -f1)
    room=$(( 54 * 1024 * 1024 - tree ))
    size=$(stat -c %s "$DIR/dl/$CORE")
    [ "$room" -gt $(( 8 * 1024 * 1024 )) ] || { echo "tree too large to carry parts" >&2; exit 2; }
    local n=$(( (size + room - 1) / room ))
    (cd "$DIR/dl" && split -n "$n" -d -a 2 "$CORE" part)
    for p in "$DIR"/dl/part*; do k=$((10#${p##*part})); mkdir -p "$DIR/part$k"; mv "$p" "$DIR/part$k/"; done
    rm -rf "$DIR/dl"
    echo "$n parts: one call per part (carry .te/partK: tools/te_wheels.sh stage K); the last"
    echo "carries .te/small too and runs tools/te_wheels.sh install (device_run.sh stage te)"
}

stage() {  # stage K: keep part K (carried as .te/partK) outside the checkout
    mkdir -p "$PARTS_DIR" && cp "$DIR/part$1"/part* "$PARTS_DIR/" && ls -la "$PARTS_DIR"
}

install() {  # reassemble the core wheel (parts from earlier calls), install everything
    if python3 -c "import sys; sys.path.insert(0, '$TARGET'); import transformer_engine.pytorch" 2>/dev/null; then
        echo "TE already installed in $TARGET"; return 0; fi
    compgen -G "$PARTS_DIR/part*" >/dev/null || { echo "no parts in $PARTS_DIR: a fresh machine (stage them first)" >&2; exit 3; }
    local work=/tmp/te_whl && rm -rf "$work" && mkdir -p "$work"
    cat "$PARTS_DIR"/part* > "$work/$CORE"
    (cd "$work" && sha256sum -c "$DIR/small/core.sha256") || { echo "core wheel checksum differs: a part is missing" >&2; exit 3; }
    cp "$DIR"/small/*.whl "$work/"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$TARGET" "$work"/*.whl
    PYTHONPATH=$TARGET:${PYTHONPATH:-} python3 -c "import transformer_engine as te, transformer_engine.pytorch; print('transformer_engine', te.__version__)"
}

case ${1:-} in
    fetch) shift; fetch "$@" ;;
    stage) [ $# -eq 2 ] || { echo "usage: $0 stage K" >&2; exit 2; }; stage "$2" ;;
    install) install ;;
    *) echo "usage: $0 fetch [TORCH_EXT_WHEEL] | stage K | install" >&2; exit 2 ;;
esac
