#!/usr/bin/env bash
# The test suite, in its own venv. Extra arguments go to pytest (e.g. -k loading, -x).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec python -m pytest "$@"
