# Sourced by scripts/demo.sh and scripts/test.sh: create (once) and activate the project venv.
# torch is pinned to the CPU build first: an unpinned `torch` would pull a multi-GB CUDA build.
# Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.13.0" TORCH_PIP_ARGS="--index-url ...").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FSDP_OFFLOAD_CFG_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
if ! python -c "import fsdp_offload_cfg, pytest, hypothesis, peft" >/dev/null 2>&1; then
  echo "[setup] installing torch (CPU build) and fsdp-offload-cfg[test]"
  python -m pip install -q --upgrade pip
  python -m pip install -q ${TORCH_PIP_ARGS:-} "${TORCH_SPEC:-torch==2.13.0}"
  python -m pip install -q -e "$ROOT[test]"
fi
cd "$ROOT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
