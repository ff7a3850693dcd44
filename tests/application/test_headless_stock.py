"""The user's path from the graph to the command line, with the real entry point
(`python -m trainer_core`) and ComfyUI's stock loaders: the shipped training example
(UI format, as saved by the frontend) becomes a config, the config trains headless on the
stock-loadable demo models, and the config becomes an API workflow again."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys

import pytest

from demo_assets import ensure_assets, link_into_models, narrow_flux_loads, write_narrow_flux
from demo_dataset import write_demo_dataset
from kt_testing.headless import environment, with_cpu_attention
from kt_testing.paths import REPO_ROOT, asset_cache_dir

EXAMPLE = REPO_ROOT / "example_workflows" / "kontext_lora_training.json"
EXAMPLE_API = REPO_ROOT / "example_workflows" / "api" / "kontext_lora_training.json"


def on_demo_files(text: str) -> str:
    """A run file's [model] with the example's real FLUX.1 files swapped for the demo's (as
    `demo_assets.on_demo_files` swaps them in a graph: its CLIP-L alone for clip_l + t5xxl)."""
    model = (
        '[model]\ndiffusion_model = "kontext-trainer-demo-flux.safetensors"\nweight_dtype = "default"\n'
        'vae = "kontext-trainer-demo-ae.safetensors"\n'
        'text_encoders = ["kontext-trainer-demo-clip-l.safetensors"]\nclip_type = "stable_diffusion"\n'
    )
    swapped = re.sub(r"(?s)\[model\]\n.*?(?=\nclip_device)", model.rstrip("\n"), text, count=1)
    assert swapped != text, text
    return swapped


def trainer_core(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer_core", *args],
        cwd=REPO_ROOT,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory, comfy_runtime):  # checking the cached Flux's names imports ComfyUI
    """A ComfyUI base directory with the demo models in models/ and the demo dataset in input/.
    Where this ComfyUI's UNETLoader loads the narrow demo Flux (0.33), that Flux stands under the
    demo's name: the path from the example to the command is tested, not the model's size
    (the training test: 62 s on the stock-size Flux in session 19's run, 40 s on the narrow one
    with another job beside it); 0.3.75 trains the stock-size one."""
    base = tmp_path_factory.mktemp("stock-base")
    link_into_models(ensure_assets(asset_cache_dir()), base / "models")
    if narrow_flux_loads():
        flux = base / "models" / "diffusion_models" / "kontext-trainer-demo-flux.safetensors"
        flux.unlink()
        write_narrow_flux(flux)
    write_demo_dataset(base / "input" / "kontext_demo", count=3)  # both aspect buckets
    return base


def test_example_workflow_to_config_to_workflow(base, tmp_path):
    config = tmp_path / "run.toml"
    result = trainer_core(
        "config", "--from-workflow", str(EXAMPLE), "--base-directory", str(base), "-o", str(config)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = config.read_text()
    assert f"base_directory = {json.dumps(str(base))}" in text
    assert 'diffusion_model = "flux1-dev-kontext_fp8_scaled.safetensors"' in text  # the real files
    assert 'text_encoders = ["clip_l.safetensors", "t5xxl_fp8_e4m3fn_scaled.safetensors"]' in text
    back = tmp_path / "run_api.json"
    result = trainer_core("workflow", "--config", str(config), "-o", str(back))
    assert result.returncode == 0, result.stdout + result.stderr
    written, shipped = json.loads(back.read_text()), json.loads(EXAMPLE_API.read_text())
    for class_type in ("UNETLoader", "VAELoader", "DualCLIPLoader", "KontextTrainer_LoadKontextDataset"):
        (ours,) = [n["inputs"] for n in written.values() if n["class_type"] == class_type]
        (theirs,) = [n["inputs"] for n in shipped.values() if n["class_type"] == class_type]
        assert {k: v for k, v in ours.items() if not isinstance(v, list)} == {
            k: v for k, v in theirs.items() if not isinstance(v, list)
        }
    (ours,) = [n["inputs"] for n in written.values() if n["class_type"] == "KontextTrainer_TrainLoRA"]
    (theirs,) = [n["inputs"] for n in shipped.values() if n["class_type"] == "KontextTrainer_TrainLoRA"]
    links = ("model", "dataset", "preview")  # links; headless has no previews
    assert {k: v for k, v in ours.items() if k not in links} == {
        k: v for k, v in theirs.items() if k not in links
    }


@pytest.mark.slow
def test_the_example_trains_headless_with_the_stock_loaders(base, tmp_path):
    """The models stay where they are, outside the run's base directory, found through an
    `extra_model_paths.yaml` given as ComfyUI's own flag in the run file (issue 41 item 5:
    ComfyUI's `utils.extra_config` reads it, as `main.py` has it do)."""
    config, user_base = tmp_path / "run.toml", tmp_path / "user-base"
    shutil.copytree(base / "input" / "kontext_demo", user_base / "input" / "kontext_demo")
    paths = tmp_path / "shared_models.yaml"
    folders = ("diffusion_models", "vae", "text_encoders")
    paths.write_text(
        "shared:\n" + f"    base_path: {base / 'models'}\n" + "".join(f"    {f}: {f}\n" for f in folders)
    )
    result = trainer_core(
        "config", "--from-workflow", str(EXAMPLE), "--base-directory", str(user_base), "-o", str(config)
    )
    assert result.returncode == 0, result.stderr
    text = on_demo_files(config.read_text())
    assert "\nflags = []\n" in text
    flags = f'\nflags = ["--extra-model-paths-config", "{paths}"]\n'
    config.write_text(text.replace("\nflags = []\n", flags))
    # a short run of the example (the edits a user would make to try it), nothing held out: the
    # held-out loss after the last step is 5 forwards of the Flux, more than the 2 steps cost;
    # the references at 64 px (a quarter of the example's tokens for them)
    text = config.read_text()
    edits = {"steps": (24, 2), "save_every": (12, 0), "validate_every": (8, 0), "hold_out": (1, 0)}
    edits["reference_resolution"] = (128, 64)
    for key, (shipped, value) in edits.items():
        assert f"\n{key} = {shipped}\n" in text
        text = re.sub(rf"\n{key} = \d+\n", f"\n{key} = {value}\n", text)
    config.write_text(text)
    result = trainer_core("train", "--config", str(config), "--cpu", *with_cpu_attention([]))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "extra_model_paths_config=" in result.stdout
    assert not (user_base / "models" / "diffusion_models").exists() or not any(
        (user_base / "models" / "diffusion_models").iterdir()
    )
    lora = user_base / "models" / "loras" / "kontext_demo_lora.safetensors"
    assert f"LoRA saved: {lora}" in result.stdout
    assert "loading the model files with ComfyUI's loaders" in result.stdout
    assert "] 2/2  loss" in result.stdout
    from safetensors import safe_open

    with safe_open(str(lora), "pt") as handle:
        keys = set(handle.keys())
        metadata = handle.metadata()
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in keys
    assert metadata["ss_output_name"] == "kontext_demo_lora"
    # issue 32: the keys sd-scripts writes for a FLUX.1 LoRA (84-97 ss_*), with this run's values
    assert len([key for key in metadata if key.startswith("ss_")]) >= 84
    model = (base / "models" / "diffusion_models" / "kontext-trainer-demo-flux.safetensors").resolve()
    assert metadata["ss_sd_model_name"] == model.name
    assert metadata["ss_new_sd_model_hash"] == hashlib.sha256(model.read_bytes()).hexdigest()
    images = int(metadata["ss_num_train_images"])
    assert json.loads(metadata["ss_dataset_dirs"]) == {"kontext_demo": {"n_repeats": 1, "img_count": images}}
    buckets = json.loads(metadata["ss_bucket_info"])["buckets"]
    assert sum(bucket["count"] for bucket in buckets.values()) == images
    captions = [p.read_text(encoding="utf-8") for p in (user_base / "input" / "kontext_demo").glob("*.txt")]
    tags = json.loads(metadata["ss_tag_frequency"])["kontext_demo"]
    first = captions[0].split(",")[0].strip().lower()
    having = sum(first in [t.strip().lower() for t in c.split(",")] for c in captions)
    held = int(metadata["ss_num_validation_images"])  # held-out captions are not counted
    assert having - held <= tags[first] <= having and len(captions) == images + held
    assert metadata["ss_epoch"] == metadata["ss_num_epochs"] != "0"  # the final LoRA: the epochs run
    assert metadata["ss_mixed_precision"] == "no" and metadata["ss_cache_latents"] == "True"


@pytest.mark.version_independent
def test_a_file_that_is_not_a_model_is_named_in_one_line(base, tmp_path):
    """`[model] diffusion_model` pointing at an existing file that is no model (the user's
    mistake): one line naming the key and the file, not the loader's traceback."""
    config = tmp_path / "run.toml"
    result = trainer_core(
        "config", "--from-workflow", str(EXAMPLE), "--base-directory", str(base), "-o", str(config)
    )
    assert result.returncode == 0, result.stderr
    notes = tmp_path / "notes.txt"
    notes.write_text("root:x:0:0:root:/root:/bin/bash\n")
    text = on_demo_files(config.read_text()).replace(
        'diffusion_model = "kontext-trainer-demo-flux.safetensors"',
        f"diffusion_model = {json.dumps(str(notes))}",
    )
    text = re.sub(r'(?m)^lora_name = ".*"$', 'lora_name = "not_a_model"', text)  # a name no run took
    config.write_text(text)
    result = trainer_core("train", "--config", str(config), "--cpu", *with_cpu_attention([]), timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"[model] diffusion_model: UNETLoader could not load {notes} (" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
