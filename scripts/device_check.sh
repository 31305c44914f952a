#!/usr/bin/env bash
# GPU checks for a lent device machine (see README "GPU results"). Runs in under 8 minutes:
#   1. the GPU tests (tests/unit/io/test_gpu.py; tests/integration/peer/test_gpu_nixl.py, which skips unless a nixl wheel is carried in .whl/)
#      plus the loader suite on that machine;
#   2. the loader benchmark on CUDA: preheat read/direct/gds vs safetensors load_file(device="cuda"), with plain
#      pinned host-to-device bandwidth measured in the same run;
#   3. when the machine's Python has vLLM: the --load-format preheat plugin's registration test.
# Usage (from the repo root on the device machine): bash scripts/device_check.sh [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/preheat-device}}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Optional wheels carried in .whl/ (kvikio for GDS, runai-model-streamer, fastsafetensors, nixl-cu12 for the NIXL
# peer transport).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"

timeout 180 python3 -m pytest -q -p no:cacheprovider tests/unit/io/test_gpu.py tests/integration/peer/test_gpu_nixl.py tests/unit/loader/test_load.py \
  tests/unit/checkpoint/test_tensor_parallel.py tests/integration/loader/test_load_verify.py 2>&1 | tee "$out/tests.txt"
tests_rc=${PIPESTATUS[0]}

timeout 280 python3 bench/load.py --device cuda --size "${PREHEAT_DEVICE_BENCH_SIZE:-4GB}" --repeat 3 \
  --dir /tmp/preheat-bench --json "$out/load-cuda.json" 2>&1 | tee "$out/bench.txt"
bench_rc=${PIPESTATUS[0]}

# 3. vLLM, only if this machine's Python already has it (the lent machine has no network to install one): the
#    --load-format preheat plugin registers and builds its loader there (docs/integrations.md).
engine_rc=0
if python3 -c "import vllm" >/dev/null 2>&1; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engines/test_vllm_register.py 2>&1 | tee "$out/engines.txt"
  engine_rc=${PIPESTATUS[0]}
else
  echo "no vLLM on this machine: engine checks skipped" | tee "$out/engines.txt"
fi
echo "tests rc=$tests_rc bench rc=$bench_rc engines rc=$engine_rc"
exit $(( tests_rc || bench_rc || engine_rc ))
