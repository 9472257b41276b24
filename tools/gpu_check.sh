#!/usr/bin/env bash
# gradbuilder on a CUDA GPU, in one command:
#
#     tools/gpu_check.sh [REPORT]        (default: gpu_report.txt)
#
# Prints what the machine has (nvidia-smi, torch, onnxruntime's usable providers), runs the
# CUDA tests (tests/test_cuda.py: TrainingSession, float16 and bfloat16 mixed precision,
# ORTModule with CUDA tensors) and, where a GPU is usable, the benchmarks with --device cuda
# (bench_gpu: a d768 encoder's step against PyTorch eager and torch.compile in float32 with and
# without TF32, float16 and bfloat16, time and device memory; bench_train: TrainingSession against PyTorch; bench_ortmodule: ORTModule against PyTorch;
# bench_memory measures peak resident memory and has no CUDA mode; bench_distributed with NCCL
# where there are two GPUs or more). Everything goes to the
# screen and to REPORT. On a machine without a GPU it checks only that the CUDA paths say so
# clearly. Exits non-zero when a test or a benchmark failed.
set -uo pipefail
cd "$(dirname "$0")/.."
report=${1:-gpu_report.txt}
py=${PYTHON:-python}
status=0
exec > >(tee "$report") 2>&1

echo "# gradbuilder GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: no NVIDIA driver here"
gpu=$($py - <<'PY'
import warnings
import onnxruntime as ort
import torch
import gradbuilder
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    usable = gradbuilder.get_available_providers()
import sys
print(f"torch {torch.__version__}, torch.cuda.is_available() = {torch.cuda.is_available()}", file=sys.stderr)
print(f"onnxruntime {ort.__version__}, built with {ort.get_available_providers()}, usable here {usable}", file=sys.stderr)
print(int("CUDAExecutionProvider" in usable and torch.cuda.is_available()))
PY
) || status=1

echo
echo "## CUDA tests (tests/test_cuda.py)"
$py -m pytest -p no:cacheprovider -q -rA tests/test_cuda.py || status=1

echo
if [ "$gpu" = "1" ]; then
    echo "## bench_gpu: the d768 encoder, TrainingSession against PyTorch eager and torch.compile"
    $py tools/bench_gpu.py --json gpu_bench.json || status=1
    echo
    echo "## bench_train --device cuda"
    $py tools/bench_train.py --device cuda || status=1
    echo
    echo "## bench_ortmodule --device cuda"
    $py tools/bench_ortmodule.py --device cuda || status=1
    gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
    echo
    if [ "$gpus" -ge 2 ]; then
        echo "## bench_distributed --device cuda (NCCL, one GPU per process)"
        $py tools/bench_distributed.py --device cuda || status=1
    else
        echo "## bench_distributed: $gpus GPU here; NCCL needs one GPU per process (2 or more)"
    fi
else
    echo "## benchmarks: no usable CUDA GPU here; --device cuda answers:"
    $py tools/bench_train.py --device cuda --models mlp 2>&1 | tail -1
fi
echo
echo "# gpu_check: $([ $status = 0 ] && echo passed || echo FAILED), report in $report"
exit $status
