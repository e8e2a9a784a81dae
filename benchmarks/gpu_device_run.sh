#!/usr/bin/env bash
# GPU acceptance on one lent H100/H200 (benchmarks/GPU.md says how to call it). From the repository
# root, with the cp312 wheels in .whl/ carried along:
#   bash benchmarks/gpu_device_run.sh tests   # the gpu-marked tests (tests/test_gpu.py), about 6 minutes
#   bash benchmarks/gpu_device_run.sh bench   # benchmarks/gpu_bench.py on 124M, 350M and 1.3B, about 7 minutes
# Further arguments go to pytest / gpu_bench.py (e.g. tests -k memory, bench --sizes 1.3b).
# Logs and results go to $OUT (the device tool's folder that comes back), else /tmp/gpu_out.
set -uo pipefail
what=${1:-tests}
out=${OUT:-/tmp/gpu_out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, megatron.core; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', megatron.core.__version__, torch.cuda.get_device_name(0))"
} 2>&1 | tee "$out/gpu.txt"
case "$what" in
  tests)
    timeout 570 python3 -m pytest -m gpu tests/test_gpu.py -v -p no:cacheprovider --durations=0 \
      --junitxml="$out/gpu_tests.xml" "${@:2}" 2>&1 | tee "$out/gpu_tests.log"
    ;;
  bench)
    timeout 570 python3 benchmarks/gpu_bench.py --json "$out/gpu_bench.json" --profile "${@:2}" 2>&1 | tee "$out/gpu_bench.log"
    ;;
  *)
    echo "usage: $0 tests|bench" >&2
    exit 2
    ;;
esac
