"""TrainLoRA under ComfyUI 0.33's dynamic VRAM (its default on NVIDIA), emulated on the CPU
(kt_testing/dynamic_vram.py): the stock UNETLoader builds `ModelPatcherDynamic` and assigns
the file's read-only memory-mapped weights, as inference Parameters, without a copy.

Every flow runs through a real server with dynamic VRAM emulated and through a plain one, and
each shows that the dynamic server's MODEL holds mapped inference weights. The flows about
memory (the demo's, fp8_scaled's) run the demo's stock-size Flux (1 GiB of bf16 weights); the
others (checkpointing, a stock LoRA, Cancel then resume, sampling, block swap) the same Flux
at 1/12 of its width (`demo_assets.NARROW_FLUX_CONFIG`, through the same stock UNETLoader,
whose 0.33 detection reads the width), where a step costs a tenth. On 70adb75 (and up to
ecd75f4) every run made a copy of each mapped weight (`make_autograd_safe_`): the server's anonymous memory
grew by more than the model's size while training (measured on ecd75f4: +1352 MiB for the
1020 MiB demo Flux), and the copies stayed in the MODEL, which every flow here checks after
its run. Now the training shares the mapped memory: the LoRA equals the plain server's bit
for bit, and the growth stays well below the model's size: what a run needs on a CPU is the
demo's largest layer cast to fp32 (a quarter of the model) and its activations (+341 to +427 MiB
here; CI once measured +517 MiB), where a copy adds the whole model; on a GPU the casts land in
VRAM.

ComfyUI 0.3.75 has no dynamic VRAM: the module skips there."""

from __future__ import annotations

import itertools
import math

import pytest

from kt_testing.dynamic_vram import DYNAMIC_VRAM_ENV, EMULATION_MARK, comfyui_has_dynamic_vram, server_env
from kt_testing.graphs import demo_training
from kt_testing.paths import TEST_NODE_PACKS
from kt_testing.runs import progress_events, run_and_interrupt
from kt_testing.server import ComfyServer
from trainer_core.lora_file import load

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not comfyui_has_dynamic_vram(), reason="ComfyUI 0.3.75 has no dynamic VRAM (ModelPatcherDynamic)"
    ),
]

NARROW = "kt-narrow-flux.safetensors"  # the narrow demo Flux, in each server's diffusion_models/
PROBES = itertools.count(1)
MODEL_BYTES_FLOOR = 1_000_000_000  # the demo Flux's mapped block weights (about 1.07 GB)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, stock_assets_files):
    import demo_assets
    import demo_dataset

    plain_base, dynamic_base = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("dynamic")
    with (
        ComfyServer(plain_base, extra_packs=TEST_NODE_PACKS) as plain,
        ComfyServer(dynamic_base, extra_packs=TEST_NODE_PACKS, env=server_env()) as dynamic,
    ):
        narrow = demo_assets.write_narrow_flux(tmp_path_factory.mktemp("narrow") / NARROW)
        for server in (plain, dynamic):
            demo_assets.link_into_models(stock_assets_files, server.base_dir / "models")
            (server.base_dir / "models" / "diffusion_models" / NARROW).symlink_to(narrow)
            demo_dataset.write_demo_dataset(server.base_dir / "input" / "kontext_demo", count=2)
        assert EMULATION_MARK in dynamic.log() and EMULATION_MARK not in plain.log()
        yield plain, dynamic


@pytest.fixture(scope="module")
def stock_assets_files(comfy_runtime):
    """The demo's files (cached outside git); checking a cached Flux's names imports ComfyUI."""
    import demo_assets
    from kt_testing.paths import asset_cache_dir

    return demo_assets.ensure_assets(asset_cache_dir())


def demo_workflow(
    lora_name: str, steps: int = 2, narrow: bool = False, preview: bool = True, **settings
) -> dict:
    """The shipped example, cut to `steps` steps, the preview (`preview`) at every 2nd step, no
    snapshots, no held-out loss; `narrow`: on the narrow demo Flux."""
    workflow = demo_training(lora_name, steps=steps, preview=preview, **settings)
    if narrow:
        workflow["1"]["inputs"]["unet_name"] = NARROW
    if preview:
        workflow["10"]["inputs"]["every_n_steps"] = 2
    return workflow


def succeeded(messages) -> None:
    assert messages[-1]["type"] == "execution_success", messages[-1]["data"].get("exception_message")


def ui_of(server, graph: dict, node: str) -> dict:
    prompt_id, messages = server.run_prompt(graph)
    succeeded(messages)
    outputs = server.history(prompt_id)["outputs"][node]
    return {key: value[0] if len(value) == 1 else tuple(value) for key, value in outputs.items()}


def weights_of(server, graph: dict | None = None) -> dict:
    """How the UNETLoader's MODEL (of `graph`, default the demo's) holds its weights now
    (KTTest_MappedWeights)."""
    graph = graph or demo_workflow("unused")
    probe = {"1": graph["1"], "2": {"class_type": "KTTest_MappedWeights", "inputs": {"model": ["1", 0]}}}
    probe["2"]["inputs"]["nonce"] = weights_of.calls = getattr(weights_of, "calls", 0) + 1
    return ui_of(server, probe, "2")


def fresh_model(server, workflow: dict, name: str) -> dict:
    """`workflow` loading the demo Flux under a file name of its own (a link), so ComfyUI loads
    it afresh (its cache keeps models by file name) and no earlier run touched that MODEL."""
    import demo_assets

    folder = server.base_dir / "models" / "diffusion_models"
    link = folder / f"{name}.safetensors"
    if not link.exists():
        link.symlink_to((folder / demo_assets.FLUX_FILE[1]).resolve())
    workflow["1"]["inputs"]["unet_name"] = link.name
    return workflow


def vbar_geometry(server) -> dict:
    probe = {"1": {"class_type": "KTTest_VbarGeometry", "inputs": {"nonce": 0}}}
    prompt_id, messages = server.run_prompt(probe)
    succeeded(messages)
    return server.history(prompt_id)["outputs"]["1"]


def anonymous_memory(server) -> dict:
    return ui_of(server, {"1": {"class_type": "KTTest_AnonymousMemory", "inputs": {"nonce": 0}}}, "1")


def lora(server, name: str) -> dict:
    tensors, _ = load(server.base_dir / "models" / "loras" / f"{name}.safetensors")
    return tensors


def same_lora(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def trained(server, graph: dict) -> tuple[dict, dict, list]:
    """Run a training graph; returns the LoRA, TrainLoRA's UI output and the messages. On the
    dynamic server, the MODEL TrainLoRA trained (its MODEL output: the same module) is probed
    after the run: it must still hold the file's mapped memory (70adb75 left a copy there)."""
    dynamic = DYNAMIC_VRAM_ENV in server.env
    if dynamic:
        graph = {**graph, "kt_mapped": {"class_type": "KTTest_MappedWeights", "inputs": {"model": ["5", 0]}}}
        graph["kt_mapped"]["inputs"]["nonce"] = next(PROBES)  # a fresh probe each run
    prompt_id, messages = server.run_prompt(graph, timeout=600)
    if messages[-1]["type"] != "execution_success":  # the server's own account of it
        pytest.fail(f"{messages[-1]['data'].get('exception_message')}\n{server.log()[-3000:]}")
    outputs = server.history(prompt_id)["outputs"]
    if dynamic:
        held = {key: value[0] for key, value in outputs["kt_mapped"].items()}
        assert held["large"] > 0 and held["mapped"] == held["large"], f"the MODEL holds a copy: {held}"
    return lora(server, graph["5"]["inputs"]["lora_name"]), outputs["5"], messages


def on_both(servers, graph: dict) -> list:
    """The graph on both servers, the dynamic one first: the LoRAs and losses are equal.
    Returns the dynamic server's messages."""
    plain, dynamic = servers
    ours, output, messages = trained(dynamic, graph)
    reference, reference_output, _ = trained(plain, graph)
    assert all(math.isfinite(x) for x in output["loss"])
    assert output["loss"] == reference_output["loss"]
    assert same_lora(ours, reference)
    return messages


def test_the_dynamic_server_loads_mapped_inference_weights(servers):
    plain, dynamic = servers
    held = weights_of(dynamic)
    assert held["dynamic"] and held["patcher"] == "DynamicOnCpu"
    assert held["large"] > 0 and held["mapped"] == held["large"] == held["mapped_inference_parameters"]
    assert held["mapped_bytes"] > MODEL_BYTES_FLOOR
    assert weights_of(plain)["mapped"] == 0 and not weights_of(plain)["dynamic"]


def test_the_demo_workflow_trains_on_the_mapped_weights_without_a_copy(servers):
    """With previews. The run before the measured one loads and encodes everything (cached
    afterwards), so the measured run is TrainLoRA's own."""
    dynamic = servers[1]
    trained(dynamic, demo_workflow("kt_dyn_warmup", narrow=True))  # the dataset, encoded and cached
    workflow = fresh_model(dynamic, demo_workflow("kt_dyn_demo"), "kt-dyn-demo")
    assert weights_of(dynamic, workflow)["mapped_inference_parameters"] == weights_of(dynamic)["large"]
    anonymous_memory(dynamic)  # measure from here
    messages = on_both(servers, fresh_model(servers[0], workflow, "kt-dyn-demo"))
    seen = anonymous_memory(dynamic)
    growth = (seen["peak_kib"] - seen["base_kib"]) * 1024
    held = weights_of(dynamic, workflow)  # the trained MODEL holds the file's memory still: no copy
    assert held["mapped"] == held["large"], held
    model = held["mapped_bytes"]
    print(f"\ndynamic VRAM, demo: anonymous memory +{growth >> 20} MiB for a {model >> 20} MiB model")
    print(f"peak seen in:\n{seen['peak_where']}")
    assert growth < 0.75 * model, (
        f"anonymous memory grew {growth >> 20} MiB for a {model >> 20} MiB model; peak seen in:\n"
        f"{seen['peak_where']}"
    )
    assert [p["step"] for p in progress_events(messages)[-1]["previews"]] == [2]


def test_gradient_checkpointing(servers):
    on_both(servers, demo_workflow("kt_dyn_checkpointed", narrow=True, gradient_checkpointing=True))
    # the run's log line: the contract on for ComfyUI's dynamic VRAM (its own state says so),
    # off on the plain server (a CPU process, bf16 weights that cast nothing)
    plain, dynamic = servers
    assert "cast contract on: ComfyUI's dynamic VRAM casts streamed layers" in dynamic.log()
    assert "cast contract off: " in plain.log() and "cast contract on" not in plain.log()


def test_a_stock_lora_before_train_lora(servers):
    for server in servers:  # the same stock LoRA file on both
        trained(server, demo_workflow("kt_dyn_base", narrow=True, seed=5))
    graph = demo_workflow("kt_dyn_on_lora", narrow=True, seed=5)
    graph["20"] = {
        "class_type": "LoraLoaderModelOnly",
        "inputs": {"model": ["1", 0], "lora_name": "kt_dyn_base.safetensors", "strength_model": 1.0},
    }
    graph["5"]["inputs"]["model"] = ["20", 0]
    on_both(servers, graph)


def test_cancel_then_resume_gives_the_plain_servers_lora(servers):
    plain, dynamic = servers
    recipe = {"seed": 11, "steps": 8, "narrow": True}  # steps to spare after the cut at step 2
    reference, _, _ = trained(plain, demo_workflow("kt_dyn_full", **recipe))
    cut = run_and_interrupt(dynamic, demo_workflow("kt_dyn_cut", **recipe), at_step=2, timeout=600)
    assert cut[-1]["type"] == "execution_interrupted", cut[-1]
    choice = progress_events(cut)[-1]["message"].split("resume from ")[1]
    resumed, _, _ = trained(dynamic, demo_workflow("kt_dyn_cut", resume_from=choice, **recipe))
    assert same_lora(resumed, reference)


def test_sampling_after_a_run_on_an_earlier_sampled_model(servers):
    """A stock KSampler on the MODEL, then TrainLoRA on it, then the same sampling: the same
    latent as before the run, and as the plain server's."""
    from kt_testing.graphs import ksampler_inputs

    graph = demo_workflow("kt_dyn_sampled", narrow=True, seed=3)
    sampling = {
        "1": graph["1"],
        "3": graph["3"],
        "21": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["3", 0], "text": "make it blue"}},
        "22": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "23": {"class_type": "KSampler", "inputs": ksampler_inputs(["1", 0], ["21", 0], ["22", 0])},
        "24": {"class_type": "KTTest_LatentDigest", "inputs": {"samples": ["23", 0]}},
    }
    digests = {}
    for server in servers:
        before = ui_of(server, sampling, "24")["digest"]
        trained(server, graph)
        sampling["23"]["inputs"]["seed"] = 8  # a new KSampler run on the same cached MODEL
        ui_of(server, sampling, "24")
        sampling["23"]["inputs"]["seed"] = 7
        after = ui_of(server, sampling, "24")["digest"]
        assert after == before
        digests[server.base_dir] = after
    assert len(set(digests.values())) == 1


def first_message(messages) -> str:
    return progress_events(messages)[0]["message"]


def test_block_swap_is_stated_not_done(servers):
    """Dynamic VRAM already streams the weights: swapping the small force-loaded ones would free
    nothing. The run says so on its progress line and trains as without swap."""
    swap = demo_workflow("kt_dyn_swap", narrow=True, blocks_to_swap=1, gradient_checkpointing=True)
    messages = on_both(servers, swap)
    assert "blocks_to_swap 1 is not used under ComfyUI's dynamic VRAM" in first_message(messages)
    assert "--disable-dynamic-vram" in first_message(messages)


def test_fp8_scaled_shares_the_mapped_weights_and_states_its_fp8_copy(servers):
    """fp8_scaled's e4m3 block weights are the one copy this mode makes (half the bf16 blocks),
    and the run says so with its size; beyond it, training on the mapped weights costs no more
    anonymous memory than on the plain server's loaded copy (the CPU's fp32 casts of fp8
    weights are large transients here, on a GPU they are VRAM: so the comparison)."""
    growth = {}
    for server in servers:
        workflow = fresh_model(
            server, demo_workflow("kt_dyn_fp8", steps=1, preview=False, fp8_mode="fp8_scaled"), "kt-dyn-fp8"
        )
        weights_of(server, workflow)  # loaded
    anonymous_memory(servers[0]), anonymous_memory(servers[1])
    vbar_geometry(servers[1])  # from here
    messages = on_both(servers, workflow)
    # the training load streamed the 10 fp8 block linears as fp8 (bf16 pages would hold casts)
    assert any("torch.float8_e4m3fn: 10" in load for load in vbar_geometry(servers[1])["loads"])
    for server in servers:
        seen = anonymous_memory(server)
        growth[server] = (seen["peak_kib"] - seen["base_kib"]) * 1024
    plain, dynamic = servers
    held = weights_of(dynamic, workflow)
    assert held["mapped"] == held["large"], held  # the originals are back, still the file's memory
    model = held["mapped_bytes"]
    print(f"\nfp8_scaled: anonymous memory +{growth[dynamic] >> 20} MiB, plain +{growth[plain] >> 20} MiB")
    note = first_message(messages)
    assert "fp8_scaled under ComfyUI's dynamic VRAM: the fp8 block weights are a new copy in RAM" in note
    # A copy of the mapped weights (the regression) would add the whole model; the CPU's peak
    # also holds a transient fp32 cast of the largest layer (a quarter of the model) whose
    # timing differs between the two servers: CI measured +1097 MiB against +992 MiB once.
    assert growth[dynamic] < growth[plain] + 0.3 * model
