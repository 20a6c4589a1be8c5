#!/usr/bin/env bash
# Every check that needs a GPU, in one run (a lent GPU machine's time is short):
# the cuda-marked tests, then bench/gpu_checkpoint.py, then bench/dali.py --device gpu
# where nvidia-dali is installed.
#
#   bash bench/gpu_all.sh OUT_DIR [SIZES_MB]      # SIZES_MB: gpu_checkpoint's --sizes-mb (default 1024,4096)
#
# Logs and the results' JSON land in OUT_DIR; copy the JSON into bench/results/ to keep it.
set -u
out=${1:?usage: bash bench/gpu_all.sh OUT_DIR [SIZES_MB]}
sizes=${2:-1024,4096}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
    nproc
} 2>&1 | tee "$out/machine.txt"
# a run past its time is stopped by SIGABRT: PYTHONFAULTHANDLER writes every thread's stack to the log
tests=(tests/trainer_client/test_device_saves.py tests/trainer_client/test_dataloader.py
    tests/trainer_client/test_dali.py tests/trainer_client/test_fsdp2.py tests/trainer_client/test_dcp.py)
timeout -s ABRT -k 10 300 python3 -m pytest -q -m cuda -rs -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$out/cuda_tests.log"
timeout -s ABRT -k 10 480 python3 bench/gpu_checkpoint.py --sizes-mb "$sizes" --results-dir "$out" 2>&1 | tee "$out/gpu_checkpoint.log"
if python3 -c 'import nvidia.dali' 2>/dev/null; then
    timeout 300 python3 bench/dali.py --device gpu --results-dir "$out" 2>&1 | tee "$out/dali_gpu.log"
else
    echo "nvidia-dali is not installed here: bench/dali.py --device gpu not run" | tee "$out/dali_gpu.log"
fi
