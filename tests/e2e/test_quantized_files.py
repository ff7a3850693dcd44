"""The shipped Kontext training workflow on ComfyUI's quantized diffusion-model files, loaded by
the stock UNETLoader through a real server: the demo Flux with every block Linear quantized by
ComfyUI's own code, at 1/12 of its width (`demo_assets.NARROW_FLUX_CONFIG`; the file's size is
not what is tested, its form is; on 0.3.75 the server reads its 2 heads from the file:
kt_testing/flux_widths.py), in each
on-disk form this ComfyUI reads (the older scaled_fp8 form of `flux1-dev-kontext_fp8_scaled`,
fp8mixed's `_quantization_metadata`, and 0.33's per-layer `comfy_quant`;
kt_testing/quantized_files.py).

On 70adb75 this failed with "no layers to train" on 0.33 (every form) and on 0.3.75 (fp8mixed).
Run on a server that also replays 0.33's reused cast memory (kt_testing/cast_replay.py), and each
run shows which casts it replayed: on 0.33 the quantized layers' own (a quantized weight's dtype
is the compute dtype, so its cast hands out the weight itself, as in a vbar page on a GPU); on
0.3.75, which dequantizes every quantized cast into fresh memory (on a GPU too), the plain layers'
casts, the quantized ones counted as fresh."""

from __future__ import annotations

import hashlib
import json
import math

import pytest

from kt_testing.cast_replay import CAST_REPLAY_ENV
from kt_testing.flux_widths import FLUX_WIDTHS_ENV
from kt_testing.graphs import demo_training
from kt_testing.paths import TEST_NODE_PACKS
from kt_testing.quantized_files import FORMS, write_quantized_file
from kt_testing.runs import progress_events
from kt_testing.server import ComfyServer
from trainer_core.lora_file import load

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory, stock_assets):
    import demo_assets
    import demo_dataset

    base = tmp_path_factory.mktemp("quantized-files")
    env = {CAST_REPLAY_ENV: "dynamic", FLUX_WIDTHS_ENV: "1"}
    with ComfyServer(base, extra_packs=TEST_NODE_PACKS, env=env) as running:
        demo_assets.link_into_models(stock_assets, running.base_dir / "models")
        demo_dataset.write_demo_dataset(running.base_dir / "input" / "kontext_demo", count=2)
        yield running


def source_flux(stock_assets) -> dict:
    """The state dict the quantized files are made from: the narrow demo Flux (on 0.3.75 the
    stock-size one cost this module 125 core-s in a fresh clone of c0afdd7)."""
    import demo_assets

    return demo_assets.flux_state_dict(config=demo_assets.NARROW_FLUX_CONFIG)


def replay_counts(server) -> dict[str, int]:
    """The server's cast replay counts so far (`kt_testing.cast_replay.REPLAYED`)."""
    _, messages = server.run_prompt({"1": {"class_type": "KTTest_CastReplayCount", "inputs": {"nonce": 0}}})
    assert messages[-1]["type"] == "execution_success"
    outputs = server.history(messages[-1]["data"]["prompt_id"])["outputs"]["1"]
    return {key: value[0] for key, value in outputs.items()}


def sha256_of(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def legacy_hash_of(path) -> str:
    """sd-scripts' (and the old web UI's) model hash: 64 KiB at 1 MiB into the file."""
    with open(path, "rb") as handle:
        handle.seek(0x100000)
        return hashlib.sha256(handle.read(0x10000)).hexdigest()[:8]


@pytest.mark.parametrize("form", FORMS)
def test_the_kontext_workflow_trains_on_a_quantized_file(served, stock_assets, form):
    from kt_testing.quantized_files import comfy_reads_comfy_quant, forms_this_comfyui_loads

    if form not in forms_this_comfyui_loads():
        pytest.skip(f"this ComfyUI does not read the {form} form (0.33 does)")
    name = f"kt-demo-flux-{form}.safetensors"
    path = served.base_dir / "models" / "diffusion_models" / name
    if not path.exists():
        write_quantized_file(path, source_flux(stock_assets), form)
    workflow = demo_training(f"kt_quantized_{form}")  # with the preview; no held-out loss
    workflow["1"]["inputs"]["unet_name"] = name
    before = replay_counts(served)
    prompt_id, messages = served.run_prompt(workflow, timeout=600)
    assert messages[-1]["type"] == "execution_success", messages[-1]["data"].get("exception_message")
    replayed = {key: count - before[key] for key, count in replay_counts(served).items()}
    print(f"\n{form}: cast replay during the run {replayed}")
    if comfy_reads_comfy_quant():  # 0.33: the quantized layers' casts were handed out in reused memory
        assert replayed["quantized_casts"] > 0 and replayed["quantized_marked"] > 0, replayed
    else:  # 0.3.75: they were fresh; the plain layers' (none in its fp8 nn.Linear scaled_fp8 form) replayed
        assert replayed["quantized_casts"] == 0 and replayed["fresh_casts"] > 0, replayed
        assert (replayed["casts"] > 0) == (form != "scaled_fp8"), replayed
    result = served.history(prompt_id)["outputs"]["5"]
    assert len(result["loss"]) == 2 and all(math.isfinite(x) for x in result["loss"])
    assert [p["step"] for p in progress_events(messages)[-1]["previews"]] == [2]
    tensors, metadata = load(served.base_dir / "models" / "loras" / f"kt_quantized_{form}.safetensors")
    assert any("img_attn_qkv" in key for key in tensors)  # the quantized layers got the LoRA
    # issue 32: sd-scripts' base-model keys, the file followed back from TrainLoRA's MODEL input
    assert metadata["ss_sd_model_name"] == name and metadata["ss_fp8_base"] == "True"
    assert metadata["ss_new_sd_model_hash"] == sha256_of(path)
    assert metadata["ss_sd_model_hash"] == legacy_hash_of(path)
    assert "Using mixed precision operations" in served.log() or "scaled fp8" in served.log()


@pytest.mark.parametrize(
    ("fp8_mode", "words"),
    [("fp8_scaled", "already quantized"), ("fp8_backward", "fp8_backward")],
)
def test_a_mode_that_cannot_run_on_a_quantized_file_is_one_line_before_any_step(
    served, stock_assets, fp8_mode, words
):
    name = "kt-demo-flux-quantization_metadata.safetensors"
    path = served.base_dir / "models" / "diffusion_models" / name
    if not path.exists():
        write_quantized_file(path, source_flux(stock_assets), "quantization_metadata")
    workflow = demo_training(f"kt_refused_{fp8_mode}", fp8_mode=fp8_mode)
    workflow["1"]["inputs"]["unet_name"] = name
    _, messages = served.run_prompt(workflow, timeout=600)
    assert messages[-1]["type"] == "execution_error"
    error = messages[-1]["data"]["exception_message"].strip()
    assert words in error and "\n" not in error, error
    assert not progress_events(messages)  # refused before any step


def test_a_base_loaded_as_fp8_is_recorded_as_sd_scripts_records_it(served):
    """Issue 32: `ss_fp8_base` was "False" for a MODEL that UNETLoader loaded with weight_dtype
    fp8_e4m3fn (sd-scripts writes True when the base ran in fp8)."""
    workflow = demo_training("kt_fp8_weight_dtype", steps=1, preview=False)  # the file's metadata is tested
    workflow["1"]["inputs"]["weight_dtype"] = "fp8_e4m3fn"
    import demo_assets

    narrow = served.base_dir / "models" / "diffusion_models" / "kt-narrow-flux.safetensors"
    if not narrow.exists():  # the narrow demo Flux: the dtype is tested, not the size
        demo_assets.write_narrow_flux(narrow)
    workflow["1"]["inputs"]["unet_name"] = narrow.name
    _, messages = served.run_prompt(workflow, timeout=600)
    assert messages[-1]["type"] == "execution_success", messages[-1]["data"].get("exception_message")
    _, metadata = load(served.base_dir / "models" / "loras" / "kt_fp8_weight_dtype.safetensors")
    assert metadata["ss_fp8_base"] == metadata["ss_fp8_base_unet"] == "True"
    assert json.loads(metadata["kontext_trainer.base_weights"])["plain"].get("float8_e4m3fn", 0) > 0 or (
        json.loads(metadata["kontext_trainer.base_weights"])["quantized"].get("float8_e4m3fn", 0) > 0
    )
    assert metadata["ss_sd_model_name"] == workflow["1"]["inputs"]["unet_name"]
