# Sourced by scripts/demo.sh and scripts/test.sh: create (once) and activate a project venv.
# torch is pinned to the CPU build first: an unpinned `torch` would pull a multi-GB CUDA build.
# Where pip's sources have no CPU build of the pin (PyPI on Linux has the CUDA one alone), it comes
# from PyTorch's CPU index (scripts/_pip.py torch-args).
# Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.13.0" TORCH_PIP_ARGS="--index-url ...");
# CI's newest leg floats it (TORCH_SPEC=torch: the newest release, PyPI's CUDA build, which runs
# on the CPU too).
#
# LEG picks the accelerate/transformers pair (docs/compatibility.md); each leg has its own venv:
#   newest (default)  the newest releases in the supported range   .venv
#   oldest            transformers 4.57.6 + accelerate 1.10.1,       .venv-oldest
#                     torch 2.11.0 (the supported floor; PyPI's CUDA build, about 3 GB to fetch)
#   axolotl           transformers 5.16.1 + accelerate 1.13.0        .venv-axolotl
#   clients           what `pip install llamafactory==0.9.5` resolves  .venv-clients
#                     (transformers 5.6.0 + accelerate 1.11.0, trl 0.24, peft 0.18): its CLI, run
#                     through `fsdp-offload-cfg run` (tests/clients)
#   swift             what `pip install ms-swift==4.6.0` resolves       .venv-swift
#                     (transformers 5.19.0 + accelerate 1.15.0, trl 0.29.1, peft 0.20.0): `swift sft`
#                     through `fsdp-offload-cfg run` (tests/clients)
#   axolotl-plugin    what `pip install axolotl==0.19.0` resolves      .venv-axolotl-plugin
#                     (transformers 5.16.1 + accelerate 1.13.0, trl 1.9.0, peft 0.20.0): axolotl's
#                     config loader with our plugin listed, and `axolotl train` on 2 gloo ranks (tests/clients)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LEG="${LEG:-newest}"
TORCH_DEFAULT="torch==2.13.0"  # the CPU build (this machine keeps it on disk)
TORCH_CPU=yes  # whether the set-up asks for the CPU build of TORCH_DEFAULT wherever it installs
case "$LEG" in
  newest)  PAIR=() ;;
  oldest)  PAIR=("transformers==4.57.6" "accelerate==1.10.1"); TORCH_DEFAULT="torch==2.11.0"; TORCH_CPU=no ;;
  axolotl) PAIR=("transformers==5.16.1" "accelerate==1.13.0") ;;
  clients) PAIR=("transformers==5.6.0" "accelerate==1.11.0" "trl==0.24.0" "peft==0.18.1") ;;
  swift)   PAIR=("transformers==5.19.0" "accelerate==1.15.0" "trl==0.29.1" "peft==0.20.0") ;;
  axolotl-plugin) PAIR=("transformers==5.16.1" "accelerate==1.13.0" "trl==1.9.0" "peft==0.20.0") ;;
  *) echo "unknown LEG=$LEG (newest, oldest, axolotl, clients, swift, axolotl-plugin)" >&2; exit 2 ;;
esac
if [ "$LEG" = newest ]; then DEFAULT_VENV="$ROOT/.venv"; else DEFAULT_VENV="$ROOT/.venv-$LEG"; fi
# The editable install writes into the checkout (fsdp_offload_cfg.egg-info): where several legs
# install at once from one checkout (.ci/run's lanes), that step takes turns through the lock file
# FSDP_OFFLOAD_CFG_INSTALL_LOCK names; torch and the frameworks install into each leg's own venv
# side by side.
in_turn() {  # COMMAND...: run it holding that lock where one is named (a shell function too)
  if [ -z "${FSDP_OFFLOAD_CFG_INSTALL_LOCK:-}" ]; then "$@"; return; fi
  ( flock 9 && "$@" ) 9>"$FSDP_OFFLOAD_CFG_INSTALL_LOCK"
}
VENV="${FSDP_OFFLOAD_CFG_VENV:-$DEFAULT_VENV}"
# FSDP_OFFLOAD_CFG_PYTHON: the interpreter the venv is made with (default python3; .ci/run names
# CPython 3.13 for the newest leg, 3.12 for the oldest)
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV (leg $LEG) with $("${FSDP_OFFLOAD_CFG_PYTHON:-python3}" --version 2>&1)"
  "${FSDP_OFFLOAD_CFG_PYTHON:-python3}" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
# pip's install and uninstall, done by uv with pip's settings (scripts/_pip.py: 2-3x faster)
pip_() { python "$ROOT/scripts/_pip.py" "$@"; }
# TORCH_ARGS: the install arguments for the leg's torch. TORCH_PIP_ARGS and TORCH_SPEC as given,
# else its pin as the CPU build (pip's sources asked first: a dry run, 0.4 s here)
torch_args() {
  local line
  if [ -n "${TORCH_SPEC:-}${TORCH_PIP_ARGS:-}" ] || [ "$TORCH_CPU" = no ]; then
    line="${TORCH_PIP_ARGS:-} ${TORCH_SPEC:-$TORCH_DEFAULT}"
  else
    line=$(python "$ROOT/scripts/_pip.py" torch-args "$TORCH_DEFAULT")
  fi
  read -ra TORCH_ARGS <<< "$line"
}
# Whether the venv has these top-level modules: found, not imported (importing the frameworks to
# check for them took 9-15 s of CPU a leg, twice: at set-up and again in scripts/test.sh)
venv_has() {
  python -c 'import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))' "$@"
}
if [ "$LEG" = clients ]; then
  if ! venv_has fsdp_offload_cfg pytest llamafactory; then
    echo "[setup] installing llamafactory==0.9.5 with torch (CPU build), then fsdp-offload-cfg"
    # one command: alone, llamafactory's torchvision pin would replace the CPU torch with a CUDA build
    torch_args
    pip_ install -q "${TORCH_ARGS[@]}" "llamafactory==0.9.5"
    # PyPI's torchvision/torchaudio are CUDA builds that cannot load beside the CPU torch:
    # transformers imports torchvision when present; llamafactory imports torchaudio, which loads
    # in pure-Python mode without its compiled libraries
    pip_ uninstall -q -y torchvision || true
    rm -f "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"/torchaudio/lib/*.so
    in_turn pip_ install -q -e "$ROOT" pytest ${PAIR[@]+"${PAIR[@]}"}
  fi
elif [ "$LEG" = swift ]; then
  if ! venv_has fsdp_offload_cfg pytest swift msgspec; then
    echo "[setup] installing ms-swift==4.6.0 with torch (CPU build), then fsdp-offload-cfg"
    torch_args
    # msgspec: `swift rlhf` imports it (swift/rlhf_trainers/utils.py) and ms-swift 4.6 does not
    # declare it (vLLM brings it where that is installed); without it `swift rlhf` stops at import
    pip_ install -q "${TORCH_ARGS[@]}" "ms-swift==4.6.0" msgspec
    in_turn pip_ install -q -e "$ROOT" pytest ${PAIR[@]+"${PAIR[@]}"}
  fi
elif [ "$LEG" = axolotl-plugin ]; then
  if ! venv_has fsdp_offload_cfg pytest axolotl; then
    echo "[setup] installing axolotl==0.19.0 with torch (CPU build), then fsdp-offload-cfg"
    torch_args
    pip_ install -q "${TORCH_ARGS[@]}" "axolotl==0.19.0"
    in_turn pip_ install -q -e "$ROOT" pytest ${PAIR[@]+"${PAIR[@]}"}
  fi
elif ! venv_has fsdp_offload_cfg pytest hypothesis peft trl matplotlib; then
  echo "[setup] installing ${TORCH_SPEC:-$TORCH_DEFAULT}, ${PAIR[*]:-the newest accelerate and transformers}, fsdp-offload-cfg[test]"
  if [ -n "${TORCH_WHEELS:-}" ]; then  # torch downloaded ahead (.ci/run): from there, nothing fetched twice
    pip_ install -q --no-index --find-links "$TORCH_WHEELS" "${TORCH_SPEC:-$TORCH_DEFAULT}" \
      || echo "[setup] installing torch from $TORCH_WHEELS failed: fetching it"
  fi
  torch_args
  pip_ install -q "${TORCH_ARGS[@]}" ${PAIR[@]+"${PAIR[@]}"}
  # The package installs into an environment holding any supported pair without changing it; the
  # pins go along so that the test extras (trl, datasets) resolve around them, not over them.
  in_turn pip_ install -q -e "$ROOT[test]" ${PAIR[@]+"${PAIR[@]}"}
fi
TORCH_PIN=()
case "${TORCH_SPEC:-$TORCH_DEFAULT}" in *==*) TORCH_PIN=("${TORCH_SPEC:-$TORCH_DEFAULT}") ;; esac
for spec in ${PAIR[@]+"${PAIR[@]}"} ${TORCH_PIN[@]+"${TORCH_PIN[@]}"}; do
  python - "$spec" "$VENV" <<'PY'
import sys
from importlib import metadata
name, want = sys.argv[1].split("==")
have = metadata.version(name)
if have.split("+")[0] != want:  # torch's local tag (+cpu, +cu128) is the build, not the release
    sys.exit(f"[setup] leg needs {name}=={want}, the venv has {have}: remove {sys.argv[2]} to build it afresh")
PY
done
cd "$ROOT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
