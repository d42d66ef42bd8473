#!/usr/bin/env bash
# The test suite, in its own venv. Extra arguments go to pytest (e.g. -k loading, -x).
# LEG=oldest|axolotl|newest picks the accelerate/transformers pair (default newest; see _env.sh).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
# the installed versions, read from their metadata (importing the three took 4 s of CPU)
python -c "import os; from importlib.metadata import version as v; import platform; print(f'[leg {os.environ.get(\"LEG\", \"newest\")}] Python {platform.python_version()}, torch {v(\"torch\")}, accelerate {v(\"accelerate\")}, transformers {v(\"transformers\")}')"
exec python -m pytest "$@"
