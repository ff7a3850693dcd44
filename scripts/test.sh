#!/usr/bin/env bash
# Lint, then every test layer (trainer_core, nodes, e2e). Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m "not e2e"`.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

.venv/bin/ruff check . || exit 1
start=$SECONDS
.venv/bin/python -m pytest "$@"
status=$?
echo "[test] pytest finished in $((SECONDS - start)) s with exit code $status"
if [[ $status -eq 5 ]]; then
    echo "[test] pytest collected no tests: that is a failure here" >&2
    exit 1
fi
exit $status
