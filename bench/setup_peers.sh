#!/usr/bin/env bash
# Installs the checkpoint peers the benchmarks compare ffplane with INTO THE ACTIVE VENV,
# always with torch pinned (pip -c pin.txt, pin.txt = "torch==$TORCH_VERSION"), so that no
# peer's torch requirement pulls another (multi-GB CUDA) torch build:
#
#   dlrover        DLRover flash checkpoint   dlrover[torch]==0.6.1 + grpcio (imported, not declared);
#                  the deprecated pynvml shim it pulls is removed again (nvidia-ml-py stays)
#   torchft        torchft 0.2.0              (wheel carries the torchft_lighthouse binary)
#   nvrx           nvidia-resiliency-ext 0.7.0: only a cp312 manylinux_2_39 wheel exists; its
#                  pure-Python files (+ dist-info) are unpacked into site-packages, the compiled
#                  CUPTI module is skipped, the runtime deps local checkpointing needs are installed
#   mlflashpoint   Google ML Flashpoint 0.0.10 from its sdist (Requires-Python >=3.12 overridden);
#                  abseil comes from a local source (its CMake would fetch it from GitHub), and the
#                  two pybind11 extensions the wheel lacks are built with cmake + ninja and copied
#                  into the installed package. ~4 min on 2 cores the first time (only those two
#                  targets and the abseil parts they use are compiled; the whole tree is ~11 min);
#                  the build tree in $PEERS_WORK makes a reinstall take seconds.
#
#   . venv/bin/activate; bash bench/setup_peers.sh [PEER ...]      # default: all four
#
# Idempotent: a peer already installed at its version (and importing) is left alone. Prints one
# line per peer ("installed", "already there", "skipped: why", "failed: why (log: ...)"); one
# peer's failure never stops the others, and the script exits 0 whatever the peers did.
#
# Environment:
#   TORCH_VERSION    the torch pin (default 2.13.0)
#   PEERS_WORK       downloads, build trees, logs (default ${XDG_CACHE_HOME:-~/.cache}/ffplane-peers)
#   PEERS_PREFETCHED a folder that may already hold the NVRx wheel / ML Flashpoint sdist (default /tmp/pk)
#   ABSEIL_SRC       abseil-cpp 20250814.1 source tree for ML Flashpoint (default: exported from the
#                    git mirror ABSEIL_MIRROR=/work/.mirror/abseil+abseil-cpp/repo when that exists;
#                    otherwise ML Flashpoint is skipped)
set -euo pipefail
shopt -s inherit_errexit

TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PEERS_WORK=${PEERS_WORK:-${XDG_CACHE_HOME:-$HOME/.cache}/ffplane-peers}
PEERS_PREFETCHED=${PEERS_PREFETCHED:-/tmp/pk}
ABSEIL_MIRROR=${ABSEIL_MIRROR:-/work/.mirror/abseil+abseil-cpp/repo}
ABSEIL_TAG=20250814.1

DLROVER_VERSION=0.6.1
TORCHFT_VERSION=0.2.0
NVRX_VERSION=0.7.0
MLFP_VERSION=0.0.10

if ! python -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null; then
    echo "setup_peers: no virtual environment is active (. venv/bin/activate first)" >&2
    exit 2
fi

mkdir -p "$PEERS_WORK/dl" "$PEERS_WORK/logs"
PIN=$PEERS_WORK/pin.txt
echo "torch==$TORCH_VERSION" >"$PIN"
TORCH_BEFORE=$(python -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)

pip_pinned() { python -m pip install --disable-pip-version-check -c "$PIN" "$@"; }

# the installed version of a distribution, or nothing
dist_version() {
    python - "$1" <<'EOF' 2>/dev/null || true
import sys
from importlib.metadata import version
print(version(sys.argv[1]))
EOF
}

# $1 file name, $2... pip download arguments: the file in $PEERS_WORK/dl, copied from
# $PEERS_PREFETCHED or downloaded; prints its path
fetch_dist() {
    local name=$1
    shift
    if [[ ! -s $PEERS_WORK/dl/$name ]]; then
        if [[ -s $PEERS_PREFETCHED/$name ]]; then
            cp "$PEERS_PREFETCHED/$name" "$PEERS_WORK/dl/$name.part"
            mv "$PEERS_WORK/dl/$name.part" "$PEERS_WORK/dl/$name"
        else
            python -m pip download --disable-pip-version-check --no-deps -d "$PEERS_WORK/dl" "$@" >&2
        fi
    fi
    [[ -s $PEERS_WORK/dl/$name ]] || { echo "pip download did not produce $name" >&2; return 1; }
    echo "$PEERS_WORK/dl/$name"
}

# a peer function reports through these (the main loop prints the line)
STATUS_FILE=
done_as() { echo "$1" >"$STATUS_FILE"; }

# ---------------------------------------------------------------- DLRover flash checkpoint
peer_dlrover() {
    if [[ $(dist_version dlrover) == "$DLROVER_VERSION" ]] &&
        python -c 'import grpc, dlrover.trainer.torch.flash_checkpoint.ddp' 2>/dev/null; then
        done_as "already there ($DLROVER_VERSION)"
        return
    fi
    pip_pinned "dlrover[torch]==$DLROVER_VERSION" grpcio
    # dlrover requires the deprecated "pynvml" shim, whose _pynvml_redirector.pth makes every
    # `import torch` (torch.cuda imports pynvml) warn "FutureWarning: The pynvml package is
    # deprecated": drop the shim; nvidia-ml-py (pulled in too) provides the real pynvml module
    if [[ -n $(dist_version pynvml) ]]; then
        python -m pip uninstall --disable-pip-version-check -y pynvml
        pip_pinned --force-reinstall --no-deps nvidia-ml-py
    fi
    python -W error::FutureWarning -c 'import torch, pynvml'
    python -c 'from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType'
    done_as "installed ($DLROVER_VERSION)"
}

# ---------------------------------------------------------------- torchft
peer_torchft() {
    if [[ $(dist_version torchft) == "$TORCHFT_VERSION" ]] &&
        python -c 'from torchft import Manager' 2>/dev/null && command -v torchft_lighthouse >/dev/null; then
        done_as "already there ($TORCHFT_VERSION)"
        return
    fi
    pip_pinned "torchft==$TORCHFT_VERSION"
    python -c 'from torchft import Manager'
    command -v torchft_lighthouse >/dev/null || { echo "torchft_lighthouse is not on PATH" >&2; return 1; }
    done_as "installed ($TORCHFT_VERSION)"
}

# ---------------------------------------------------------------- NVIDIA resiliency-ext
NVRX_PROBE='from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy
from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict'

peer_nvrx() {
    if [[ $(dist_version nvidia-resiliency-ext) == "$NVRX_VERSION" ]] && python -c "$NVRX_PROBE" 2>/dev/null; then
        done_as "already there ($NVRX_VERSION)"
        return
    fi
    local whl site old
    whl=$(fetch_dist "nvidia_resiliency_ext-$NVRX_VERSION-cp312-cp312-manylinux_2_39_x86_64.whl" \
        "nvidia-resiliency-ext==$NVRX_VERSION" --python-version 3.12 --platform manylinux_2_39_x86_64 \
        --only-binary :all:)
    pip_pinned numpy psutil packaging pyyaml nvidia-ml-py defusedxml
    old=$(dist_version nvidia-resiliency-ext)
    if [[ -n $old ]]; then python -m pip uninstall --disable-pip-version-check -y nvidia-resiliency-ext; fi
    site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # unpack everything but compiled modules (nvrx_cupti_module.*.so, cp312-only and CUDA-only);
    # the dist-info goes in too (so pip show / __version__ work), its RECORD without what was skipped
    python - "$whl" "$site" <<'EOF'
import os, sys, zipfile
whl, site = sys.argv[1], sys.argv[2]
skip = lambda n: n.endswith((".so", ".pyd")) or ".data/" in n
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if not n.endswith("/")]
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    for n in names:
        if skip(n) or n == record:
            continue
        z.extract(n, site)
    lines = z.read(record).decode().splitlines()
    kept = [l for l in lines if l and not skip(l.split(",")[0])]
    info = os.path.dirname(record)
    with open(os.path.join(site, info, "INSTALLER"), "w") as f:
        f.write("ffplane-setup_peers\n")
    kept.append(f"{info}/INSTALLER,,")
    with open(os.path.join(site, record), "w") as f:
        f.write("\n".join(kept) + "\n")
print("skipped:", [n for n in names if skip(n)])
EOF
    python -c "$NVRX_PROBE"
    done_as "installed ($NVRX_VERSION, pure-Python part; CUPTI module skipped)"
}

# ---------------------------------------------------------------- Google ML Flashpoint
MLFP_PROBE='import ml_flashpoint.checkpoint_object_manager.buffer_object.buffer_object_ext
import ml_flashpoint.replication.transfer_service.transfer_service_ext
from ml_flashpoint.adapter.pytorch.memory_storage_writer import MemoryStorageWriter
from ml_flashpoint.adapter.pytorch.memory_storage_reader import MemoryStorageReader'
MLFP_EXTS=(buffer_object_ext transfer_service_ext)

peer_mlflashpoint() {
    if [[ $(dist_version ml-flashpoint) == "$MLFP_VERSION" ]] && python -c "$MLFP_PROBE" 2>/dev/null; then
        done_as "already there ($MLFP_VERSION)"
        return
    fi
    local abseil=${ABSEIL_SRC:-}
    if [[ -z $abseil ]]; then
        abseil=$PEERS_WORK/abseil-cpp-$ABSEIL_TAG
        if [[ ! -f $abseil/CMakeLists.txt ]]; then
            if ! git --git-dir="$ABSEIL_MIRROR" rev-parse -q --verify "refs/tags/$ABSEIL_TAG" >/dev/null 2>&1; then
                done_as "skipped: no abseil source (ABSEIL_SRC unset and no git mirror with tag $ABSEIL_TAG at $ABSEIL_MIRROR); its CMake would fetch abseil from GitHub"
                return
            fi
            rm -rf "$abseil.part"
            mkdir -p "$abseil.part"
            git --git-dir="$ABSEIL_MIRROR" archive "$ABSEIL_TAG" | tar -x -C "$abseil.part"
            mv "$abseil.part" "$abseil"
        fi
    fi
    [[ -f $abseil/CMakeLists.txt ]] || { echo "ABSEIL_SRC=$abseil holds no CMakeLists.txt" >&2; return 1; }
    abseil=$(cd "$abseil" && pwd)

    pip_pinned pybind11==3.0.1 scikit-build-core==0.11.6 cmake==3.31.10 ninja==1.11.1.3 setuptools-scm \
        typing-extensions numpy
    local sdist src build
    sdist=$(fetch_dist "ml_flashpoint-$MLFP_VERSION.tar.gz" "ml-flashpoint==$MLFP_VERSION" \
        --no-binary :all: --no-build-isolation --ignore-requires-python)
    src=$PEERS_WORK/ml_flashpoint-$MLFP_VERSION
    build=$PEERS_WORK/ml_flashpoint-build
    # a build tree configured for another interpreter (another venv) is of no use: start it again
    local py
    py=$(python -c 'import sys; print(sys.executable)')
    if [[ -f $build/CMakeCache.txt ]] && ! grep -qxF "Python_EXECUTABLE:PATH=$py" "$build/CMakeCache.txt"; then
        rm -rf "$build"
    fi
    if [[ ! -f $src/pyproject.toml ]]; then
        rm -rf "$src.part"
        mkdir -p "$src.part"
        tar -xzf "$sdist" -C "$src.part" --strip-components=1
        mv "$src.part" "$src"
    fi
    # pip builds the local tree in place; its CMake writes the extension .so files next to their
    # sources (CMAKE_LIBRARY_OUTPUT_DIRECTORY), but the wheel does not carry them
    export SKBUILD_CMAKE_ARGS="-DFETCHCONTENT_SOURCE_DIR_ABSEIL-CPP=$abseil;-DFETCHCONTENT_FULLY_DISCONNECTED=ON;-DBUILD_TESTING=OFF"
    export SKBUILD_BUILD_DIR=$build
    export SKBUILD_BUILD_TARGETS="buffer_object_ext;transfer_service_ext" # not all of abseil
    export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
    pip_pinned --no-deps --no-build-isolation --ignore-requires-python "$src"
    # the two extensions, with cmake + ninja: in the tree the wheel build configured (a no-op when
    # that build already compiled them), else configured here
    local pybind11_dir
    pybind11_dir=$(python -m pybind11 --cmakedir)
    if [[ ! -f $build/build.ninja ]]; then
        cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
            -Dpybind11_DIR="$pybind11_dir" -DPython_EXECUTABLE="$py" \
            -DFETCHCONTENT_SOURCE_DIR_ABSEIL-CPP="$abseil" -DFETCHCONTENT_FULLY_DISCONNECTED=ON \
            -DBUILD_TESTING=OFF
    fi
    cmake --build "$build" --target "${MLFP_EXTS[@]}"
    # copy them into the installed package (and into its RECORD, so pip uninstall removes them)
    python - "$src/src" "${MLFP_EXTS[@]}" <<'EOF'
import glob, os, shutil, sys
from importlib.metadata import distribution
from importlib.util import find_spec
src, exts = sys.argv[1], sys.argv[2:]
pkg = find_spec("ml_flashpoint").submodule_search_locations[0]
dist = distribution("ml-flashpoint")
site = str(dist.locate_file(""))
record = os.path.join(site, next(str(f) for f in dist.files if str(f).endswith(".dist-info/RECORD")))
listed = open(record).read().splitlines()
for ext in exts:
    found = glob.glob(os.path.join(src, "ml_flashpoint", "**", ext + ".*so"), recursive=True)
    if len(found) != 1:
        sys.exit(f"expected one built {ext}*.so under {src}, found {found}")
    rel = os.path.relpath(found[0], os.path.join(src, "ml_flashpoint"))
    dst = os.path.join(pkg, rel)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy2(found[0], dst)
    line = os.path.relpath(dst, site) + ",,"
    if line not in listed:
        listed.append(line)
    print("copied", found[0], "->", dst)
with open(record, "w") as f:
    f.write("\n".join(listed) + "\n")
EOF
    python -c "$MLFP_PROBE"
    done_as "installed ($MLFP_VERSION, with buffer_object_ext + transfer_service_ext)"
}

# ---------------------------------------------------------------- main
ALL=(dlrover torchft nvrx mlflashpoint)
peers=("$@")
[[ ${#peers[@]} -gt 0 ]] || peers=("${ALL[@]}")
for peer in "${peers[@]}"; do
    if ! declare -F "peer_$peer" >/dev/null; then
        printf '%-13s failed: unknown peer (known: %s)\n' "$peer" "${ALL[*]}"
        continue
    fi
    log=$PEERS_WORK/logs/$peer.log
    STATUS_FILE=$PEERS_WORK/logs/$peer.status
    rm -f "$STATUS_FILE"
    # a subshell with errexit of its own: one peer failing ends that peer only
    set +e
    (
        set -euo pipefail
        "peer_$peer"
    ) >"$log" 2>&1
    rc=$?
    set -e
    torch_now=$(python -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
    if [[ $torch_now != "$TORCH_BEFORE" ]]; then
        printf '%-13s failed: torch changed from %s to %s (log: %s)\n' "$peer" "$TORCH_BEFORE" "$torch_now" "$log"
    elif [[ $rc -eq 0 && -s $STATUS_FILE ]]; then
        printf '%-13s %s\n' "$peer" "$(cat "$STATUS_FILE")"
    else
        reason=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-240)
        printf '%-13s failed: %s (log: %s)\n' "$peer" "${reason:-exit status $rc}" "$log"
    fi
done
exit 0
