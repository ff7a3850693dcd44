#!/usr/bin/env bash
# The demo: trains a Kontext LoRA end to end through a headless ComfyUI on the built-in
# defaults (see scripts/demo.py); `demo.sh ui [--port N]` starts that ComfyUI on the demo's
# files for a browser instead. `make demo` and `make ui` run the set-up first.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/demo.py "$@"
