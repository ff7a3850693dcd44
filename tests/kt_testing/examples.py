"""The shipped example workflows as the e2e tests queue them: the API-format source, a node's id
and inputs by type, the end of a run, the inputs a training example reads, and the model files
the examples' loaders name (the real files users download)."""

from __future__ import annotations

import json

from .datasets import color_image, write_one_folder
from .paths import REPO_ROOT

EXAMPLES = REPO_ROOT / "example_workflows" / "api"
PYTORCH_ATTENTION = ("--use-pytorch-cross-attention",)  # ComfyUI's choice on NVIDIA
# The stock model loaders' file widgets, as (node type, input) -> the models/ folder it reads.
LOADER_FOLDERS = {
    ("UNETLoader", "unet_name"): "diffusion_models",
    ("VAELoader", "vae_name"): "vae",
    ("CLIPLoader", "clip_name"): "text_encoders",
    ("DualCLIPLoader", "clip_name1"): "text_encoders",
    ("DualCLIPLoader", "clip_name2"): "text_encoders",
}


def shipped(name: str) -> dict:
    return json.loads((EXAMPLES / name).read_text())


def only_id(workflow: dict, class_type: str) -> str:
    (node_id,) = [key for key, node in workflow.items() if node["class_type"] == class_type]
    return node_id


def inputs_of(workflow: dict, class_type: str) -> dict:
    return workflow[only_id(workflow, class_type)]["inputs"]


def succeeded(messages: list[dict]) -> None:
    assert messages[-1]["type"] == "execution_success", messages[-1]["data"].get("exception_message")


def saved_image(server, workflow: dict):
    """Run `workflow` to its end on `server`: its one SaveImage's image, as an int array."""
    import numpy as np
    from PIL import Image

    prompt_id, messages = server.run_prompt(workflow, timeout=600)
    succeeded(messages)
    (saved,) = server.history(prompt_id)["outputs"][only_id(workflow, "SaveImage")]["images"]
    path = server.base_dir / "output" / saved["subfolder"] / saved["filename"]
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def write_training_inputs(server, workflow: dict, samples=("a", "b", "c")) -> None:
    """The dataset folder the training workflow names (three 64 px samples by default, two
    references each) and the images its LoadImage nodes read, in the server's input/."""
    inputs = server.base_dir / "input"
    folder = inputs_of(workflow, "KontextTrainer_LoadKontextDataset")["folder"]
    write_one_folder(inputs / folder, list(samples), references=2, size=(64, 64))
    for seed, node_id in enumerate(k for k, n in workflow.items() if n["class_type"] == "LoadImage"):
        color_image(64, 64, seed=500 + seed).save(inputs / workflow[node_id]["inputs"]["image"])


def loaded_models(source: dict) -> list[tuple[str, str]]:
    """(models/ folder, file name) of each file the API-format workflow's stock model loaders
    load (its LoRAs left out: the examples' own training writes them)."""
    return [
        (folder, node["inputs"][name])
        for node in source.values()
        for (kind, name), folder in LOADER_FOLDERS.items()
        if node["class_type"] == kind
    ]


def write_model_stand_ins(base_dir) -> None:
    """An empty file under each model name the shipped examples load, in `base_dir`'s models/:
    a page opened after this shows the examples as to a user who has the files (no Missing
    Models dialog: the frontend checks names only). A file already there is left as it is."""
    for source in sorted(EXAMPLES.glob("*.json")):
        for folder, name in loaded_models(json.loads(source.read_text())):
            path = base_dir / "models" / folder / name
            if not (path.exists() or path.is_symlink()):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
