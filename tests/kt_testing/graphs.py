"""API-format graphs the end-to-end tests queue: the tests' own tiny-model nodes feeding the
product's nodes."""

from __future__ import annotations

from pathlib import Path

from trainer_core.config import TrainConfig

from .paths import REPO_ROOT


def training_graph(
    dataset: Path,
    lora_name: str,
    poison: bool = False,
    preview_every: int = 0,
    overwrite: bool = False,
    resume_from: str = "none",
    hold_out: int = 0,
    **overrides,
) -> dict:
    settings = {f: getattr(TrainConfig(), f) for f in TrainConfig.__dataclass_fields__}
    settings.update(rank=2, alpha=2.0, learning_rate=1e-3, gradient_checkpointing=False)
    settings.update(overrides)
    graph = {
        "1": {"class_type": "KTTest_TinyFluxModel", "inputs": {"seed": 3}},
        "2": {"class_type": "KTTest_SmallFluxVAE", "inputs": {"seed": 1}},
        "3": {"class_type": "KTTest_TinyCLIP", "inputs": {"seed": 2}},
        "4": {
            "class_type": "KontextTrainer_LoadKontextDataset",
            "inputs": {**dataset_inputs(["2", 0], ["3", 0], dataset), "hold_out": hold_out},
        },
        "5": {
            "class_type": "KontextTrainer_TrainLoRA",
            "inputs": {
                "model": ["1", 0],
                "dataset": ["6" if poison else "4", 0],
                "lora_name": lora_name,
                "overwrite": overwrite,
                "resume_from": resume_from,
                **settings,
            },
        },
    }
    if preview_every:  # PreviewSampler with a prompt from the tiny CLIP, 64 px, 2 sampling steps
        graph["7"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["3", 0], "text": "make it blue"}}
        graph["8"] = {
            "class_type": "KontextTrainer_PreviewSampler",
            "inputs": preview_inputs(["7", 0], ["2", 0], preview_every),
        }
        graph["5"]["inputs"]["preview"] = ["8", 0]
    if poison:
        graph["6"] = {"class_type": "KTTest_PoisonDataset", "inputs": {"dataset": ["4", 0], "index": 1}}
    return graph


def preview_inputs(positive, vae, every_n_steps: int) -> dict:
    """PreviewSampler's inputs for the tiny models: 64 px, 2 sampling steps, seed 0."""
    return {
        "positive": positive,
        "vae": vae,
        "every_n_steps": every_n_steps,
        "steps": 2,
        "cfg": 1.0,
        "guidance": 1.0,
        "width": 64,
        "height": 64,
        "seed": 0,
        "sampler_name": "euler",
        "scheduler": "simple",
    }


def cache_name(tmp_path_factory) -> str:
    """A cache folder of a test's own for LoadKontextDataset: a name, so the node makes it in
    ComfyUI's output folder (the only place the node may write besides temp)."""
    return f"kt_test_caches/{tmp_path_factory.mktemp('cache').name}"


def dataset_inputs(vae, clip, folder: Path, cache_folder: str = "") -> dict:
    """LoadKontextDataset's inputs for the tiny models: the folder by absolute path, 256 px
    targets, 64 px references."""
    return {
        "vae": vae,
        "clip": clip,
        "folder": "(absolute path below)",
        "path": str(folder),
        "resolution": 256,
        "reference_resolution": 64,
        "min_size": 0,
        "background": "white",
        "hold_out": 0,
        "seed": 0,
        "cache_folder": cache_folder,
    }


def ksampler_inputs(model, conditioning, latent: dict) -> dict:
    """A stock KSampler's inputs for the tiny models: 2 euler steps at cfg 1 (one model call per
    step), seed 7, the same conditioning as positive and negative."""
    return {
        "model": model,
        "seed": 7,
        "steps": 2,
        "cfg": 1.0,
        "sampler_name": "euler",
        "scheduler": "simple",
        "positive": conditioning,
        "negative": conditioning,
        "latent_image": latent,
        "denoise": 1.0,
    }


DEMO_TRAINING = REPO_ROOT / "example_workflows" / "api" / "kontext_lora_training.json"
DEMO_TEST_SIZE = 64  # the demo flows' reference and preview size in tests (the example's: 128)


def demo_training(
    lora_name: str, steps: int = 2, preview: bool = True, size: int = DEMO_TEST_SIZE, **settings
) -> dict:
    """The shipped Kontext training example (what `make demo` queues, on the demo's files), cut
    to `steps` steps, no snapshots, and nothing held out: no held-out loss after the last step
    (5 forwards of the demo Flux, measured at a third of a 2-step run on 0.3.75: 623 of 1909
    samples of TrainLoRA's thread, py-spy; the preview 532, the 2 steps 393; the example's own
    test runs it as shipped). The references and the preview at `size` pixels (the targets at
    the example's 128, the dataset's least resolution) and the preview one sampler step (the
    example's 4): what these flows test is the path, not the images. `preview` off:
    PreviewSampler is not connected. `settings`: TrainLoRA's other inputs."""
    import json

    from demo_assets import on_demo_files

    workflow = on_demo_files(json.loads(DEMO_TRAINING.read_text()))  # the real files' loaders swapped
    workflow["5"]["inputs"].update(steps=steps, save_every=0, lora_name=lora_name, **settings)
    workflow["4"]["inputs"].update(hold_out=0, reference_resolution=size)
    workflow["9"]["inputs"]["reference_resolution"] = size
    workflow["10"]["inputs"].update(width=size, height=size, steps=1)
    if not preview:
        del workflow["5"]["inputs"]["preview"], workflow["10"]
    return workflow
