# The two commands of the README, and the set-up step both share.
#   make demo   set up, then train a LoRA end to end through a headless ComfyUI
#   make test   set up, then lint and run every test layer
.PHONY: setup test demo lint

setup:
	@bash scripts/setup.sh

test: setup
	@bash scripts/test.sh

demo: setup
	@bash scripts/demo.sh

lint: setup
	@.venv/bin/ruff check .
