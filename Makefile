# The commands of the README, and the set-up step they share.
#   make demo   set up, then train a LoRA end to end through a headless ComfyUI
#   make ui     set up, then start ComfyUI with the pack on the demo's files (CPU); prints the
#               address to open (PORT=8189 make ui for another port)
#   make test   set up, then lint and run every test layer
#   make test-quick   set up, then lint, the layer check, trainer_core, comfy_adapter, nodes and
#                     families without the slow tests, on ComfyUI 0.3.75 (daily work)
#   make test-gpu   set up, then the GPU layer (tests/gpu) with ComfyUI booted on CUDA
.PHONY: setup test test-quick test-gpu demo ui lint

setup:
	@bash scripts/setup.sh

test: setup
	@bash scripts/test.sh

test-quick: setup
	@bash scripts/test.sh --quick

# Fails (does not skip) where torch sees no CUDA device. -rP prints the measured figures.
test-gpu: setup
	@KT_TEST_DEVICE=cuda .venv/bin/python -m pytest tests/gpu -m gpu -rP

demo: setup
	@bash scripts/demo.sh

ui: setup
	@bash scripts/demo.sh ui $(if $(PORT),--port $(PORT))

lint: setup
	@.venv/bin/ruff check .
