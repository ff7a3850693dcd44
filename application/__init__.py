"""The application: one training run as the TrainLoRA node and the command line both run it
(`training_run`), where its files go (`run_policy`), datasets from ComfyUI's folders
(`datasets`), the headless command (`cli`, `headless`) and workflow <-> config conversion.

It uses the ComfyUI adapter (`comfy_adapter`) and the core (`trainer_core`), never a node;
the only ComfyUI module it reads directly is `folder_paths`, ComfyUI's folder layout (see
ARCHITECTURE.md; `tests/test_layers.py` enforces the direction).
"""
