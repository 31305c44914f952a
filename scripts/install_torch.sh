#!/usr/bin/env bash
# Installs the CPU build of PyTorch into a venv, saying what it downloads:
#
#   scripts/install_torch.sh VENV_PYTHON [VERSION]        (VERSION default: 2.13.0)
#
# A bare `pip install torch` on Linux x86-64 takes the CUDA build: ~900 MB for torch plus ~2-3 GB of nvidia-*
# libraries, none of which preheat needs on a CPU. PyTorch's CPU wheel index serves a ~190 MB wheel instead, so it is
# asked first (the same order as deploy/image/Containerfile); the package index is the fallback when that index is
# unreachable (an air-gapped mirror, a proxy that allows only the package index). A venv that already has the
# version is left alone, so `make demo` and `make test` stay quick on the second run.
set -euo pipefail
PY=${1:?usage: install_torch.sh VENV_PYTHON [VERSION]}
VERSION=${2:-2.13.0}
CPU_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}  # make TORCH_INDEX=... for a mirror

have=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
if [[ ${have%%+*} == "$VERSION" ]]; then
  echo "torch $have already in $(dirname "$(dirname "$PY")")"
  exit 0
fi

echo "installing PyTorch $VERSION, CPU build (~190 MB download), from $CPU_INDEX"
# --retries 0 and a short timeout: an unreachable index should fall back in seconds, not after pip's minutes of
# retries. Local wheels the machine's pip configuration points at (find-links) still count.
if "$PY" -m pip install -q --retries 0 --timeout 15 --index-url "$CPU_INDEX" "torch==$VERSION" 2>/tmp/preheat-torch-$$.log \
  && "$PY" -c 'import torch' 2>/dev/null; then
  rm -f /tmp/preheat-torch-$$.log
else
  echo "the CPU wheel index was unreachable or had no torch $VERSION ($(tail -n 1 /tmp/preheat-torch-$$.log 2>/dev/null))"
  rm -f /tmp/preheat-torch-$$.log
  case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) echo "installing torch==$VERSION from the package index: on Linux x86-64 that is the CUDA build" \
                       "(~900 MB, plus ~2-3 GB of nvidia-* libraries), unless this machine's pip finds a CPU wheel" ;;
    *)            echo "installing torch==$VERSION from the package index (a CPU build on this platform, ~100-200 MB)" ;;
  esac
  "$PY" -m pip install -q "torch==$VERSION" || "$PY" -m pip install -q "torch>=2.4"
fi
echo "torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null) installed"
