#!/usr/bin/env bash
# GPU checks for a lent device machine (docs/benchmarks.md, "GPU"). Runs in under 8 minutes, each part under its
# own timeout so one that hangs cannot hide the others:
#   1. the GPU tests (every test marked `gpu`: the CUDA pipeline, GDS, the bucketed hand-off to a device) and the
#      loader suites that run on any machine;
#   2. the loader benchmark on CUDA: preheat auto/read/direct/gds against safetensors load_file(device="cuda"),
#      fastsafetensors (with and without GDS), InstantTensor and runai-model-streamer when their wheels were carried,
#      with plain pinned host-to-device bandwidth measured in the same run;
#   3. the bucketed hand-off into a transformers model built on the device (bench/device_handoff.py), standing in
#      for vLLM's weight loaders (vLLM's wheel is too large to travel): peak extra device memory per bucket size;
#   4. when the machine's Python has vLLM: the --load-format preheat plugin's registration test.
# Wheels the machine lacks travel in .whl/ (ignored by git; `carry: [".whl"]`): kvikio-cu13 + libkvikio-cu13 +
# rapids-logger (GDS), fastsafetensors, instanttensor, nixl-cu12 (the NIXL peer transport test).
# Usage (from the repo root on the device machine): bash scripts/device_check.sh [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/preheat-device}}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  python3 -c "from preheat.io.gds import gds_status; print('gds:', gds_status())"
  nproc; free -g | head -2; df -h /tmp | tail -1; uname -r
} 2>&1 | tee "$out/gpu.txt"

# Only the files that hold GPU tests are collected: the others import what this machine lacks (moto, boto3...).
mapfile -t gpu_tests < <(grep -rl "pytest.mark.gpu" tests/unit tests/integration | sort)
timeout "${PREHEAT_DEVICE_TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m gpu "${gpu_tests[@]}" 2>&1 \
  | tail -60 | tee "$out/tests.txt"
tests_rc=${PIPESTATUS[0]}

timeout "${PREHEAT_DEVICE_BENCH_S:-260}" python3 bench/load.py --device cuda --size "${PREHEAT_DEVICE_BENCH_SIZE:-4GB}" \
  --repeat 2 --warm-repeat 3 --dir /tmp/preheat-bench --json "$out/load-cuda.json" 2>&1 | tee "$out/bench.txt"
bench_rc=${PIPESTATUS[0]}

handoff_rc=0
if [ -f bench/device_handoff.py ]; then
  timeout "${PREHEAT_DEVICE_HANDOFF_S:-90}" python3 bench/device_handoff.py --dir /tmp/preheat-bench \
    --json "$out/handoff.json" 2>&1 | tee "$out/handoff.txt"
  handoff_rc=${PIPESTATUS[0]}
fi

engine_rc=0
if python3 -c "import vllm" >/dev/null 2>&1; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engines/test_vllm_register.py 2>&1 | tee "$out/engines.txt"
  engine_rc=${PIPESTATUS[0]}
else
  echo "no vLLM on this machine: engine checks skipped" | tee "$out/engines.txt"
fi
echo "tests rc=$tests_rc bench rc=$bench_rc handoff rc=$handoff_rc engines rc=$engine_rc" | tee "$out/rc.txt"
exit $(( tests_rc || bench_rc || handoff_rc || engine_rc ))
