#!/usr/bin/env bash
# The test suite, in its own venv. Extra arguments go to pytest (e.g. -k loading, -x).
# LEG=oldest|axolotl|newest picks the accelerate/transformers pair (default newest; see _env.sh).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
python -c "import accelerate, torch, transformers; print(f'[leg {__import__(\"os\").environ.get(\"LEG\", \"newest\")}] torch {torch.__version__}, accelerate {accelerate.__version__}, transformers {transformers.__version__}')"
exec python -m pytest "$@"
