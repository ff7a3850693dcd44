"""The guard before a run's first step (comfy_adapter/forward_guard.py): the training path and ComfyUI's
own forward agree on the user's model within the stated tolerance, and a patch that breaks
(what a ComfyUI release could do to it) stops the run before any step with one message
naming the ComfyUI version."""

from __future__ import annotations

import importlib

import pytest
import torch

from kt_testing.probes import tiny_samples
from kt_testing.tiny_models import TINY_FAMILIES


@pytest.fixture(scope="module")
def mods(pack):
    names = {
        "ft": "comfy_adapter.lora_session",
        "guard": "comfy_adapter.forward_guard",
        "blocks": "comfy_adapter.families.flux.blocks",
        "flux": "comfy_adapter.families.flux",
    }
    return type("Mods", (), {k: importlib.import_module(f"{pack.__name__}.{v}") for k, v in names.items()})


CASES = {  # family, layout
    "flux": ("flux", "offset"),
    "flux2": ("flux2", "index"),
    "flux2-timestep-zero": ("flux2", "index_timestep_zero"),  # ComfyUI 0.33+
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_paths_agree_within_the_tolerance(mods, pack, case, dtype):
    """Measured here: what the guard sees on a healthy model (its probe carries a reference in
    the run's layout), well inside its tolerance (on ComfyUI 0.3.75 both paths share every
    kernel: bit-equal)."""
    import comfyui_version

    family, layout = CASES[case]
    patcher = TINY_FAMILIES[family].patcher(seed=4, dtype=dtype)
    if layout == "index_timestep_zero" and not mods.flux.comfy_runs_timestep_zero(
        patcher.model.diffusion_model
    ):
        pytest.skip("this ComfyUI has no timestep-zero references (0.33+)")
    config = mods.ft.TrainConfig(rank=2, alpha=2.0, seed=1, layout=layout)
    seen = []
    real = mods.guard.check_training_forward

    def recording(*args):
        seen.append(real(*args))
        return seen[-1]

    mods.ft.check_training_forward = recording
    try:
        with mods.ft.lora_session(patcher, config):
            pass
    finally:
        mods.ft.check_training_forward = real
    allowed = mods.guard.TOLERANCE.get(dtype, mods.guard.HALF_TOLERANCE)
    print(f"\n{case} {dtype} on ComfyUI {comfyui_version.__version__}: relative difference {seen[0]:.2e}")
    assert seen[0] <= allowed / 10
    if comfyui_version.__version__ == "0.3.75":
        assert seen[0] == 0.0


def test_a_broken_patch_stops_the_run_before_any_step(mods, pack, monkeypatch):
    """A double-block patch whose output drifts by 1% (as a changed block argument would make
    it) is refused before the first step; the message names the ComfyUI version."""
    import comfyui_version

    loop = importlib.import_module(f"{pack.__name__}.trainer_core.loop")
    flow_step = importlib.import_module(f"{pack.__name__}.trainer_core.flow_step")
    real_call = mods.blocks.DoubleBlockReplacement.__call__

    def drifting(self, args, extra):
        out = real_call(self, args, extra)
        return {**out, "img": out["img"] * 1.01}

    monkeypatch.setattr(mods.blocks.DoubleBlockReplacement, "__call__", drifting)
    patcher = TINY_FAMILIES["flux"].patcher(seed=4)
    samples = tiny_samples(flow_step.Sample, 1, 2, [(8, 8)])
    config = mods.ft.TrainConfig(steps=2, rank=2, alpha=2.0, seed=1)
    steps = []
    message = rf"cannot train on this ComfyUI \({comfyui_version.__version__}\): .* Nothing was trained"
    with pytest.raises(RuntimeError, match=message):
        with mods.ft.lora_session(patcher, config) as session:
            loop.train(config, session.lora.parameters(), lambda i: samples, session.loss, steps.append)
    assert steps == []


def test_a_patch_that_raises_stops_the_run_in_one_line(mods, monkeypatch):
    """A single-block patch that fails where ComfyUI's own forward runs (as a block argument a
    release renamed would: TypeError) is refused before any step in one line naming the ComfyUI
    version and the error, not with the error itself from deep in a step."""
    import comfyui_version

    def failing(self, args, extra):
        raise TypeError("forward() got an unexpected keyword argument 'vec'")

    monkeypatch.setattr(mods.blocks.SingleBlockReplacement, "__call__", failing)
    config = mods.ft.TrainConfig(steps=2, rank=2, alpha=2.0, seed=1)
    message = (
        rf"cannot train on this ComfyUI \({comfyui_version.__version__}\): for this model ComfyUI's own "
        r"FLUX.1 forward runs but the training path fails \(TypeError: forward\(\) got an unexpected "
        r"keyword argument 'vec'\), .* Nothing was trained"
    )
    with pytest.raises(RuntimeError, match=message) as raised:
        with mods.ft.lora_session(TINY_FAMILIES["flux"].patcher(seed=4), config):
            pytest.fail("the session must not start")
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("path", ["recompute", "re-cast"])
def test_a_weight_made_under_inference_mode_stops_the_run_in_one_line(mods, pack, monkeypatch, path):
    """Should a ComfyUI hand a layer a weight made under inference mode that the trainer does
    not know to replace (a cast view cached by sampling, under dynamic VRAM), and autograd save
    it (a layer the cast contract recomputes in the backward, as ComfyUI's quantized Linear:
    its forward with a graph saves the weight), the backward probe says so in one line naming
    the way out, not autograd's raw error mid-run. A plain cast Linear's re-cast saves no
    weight: where only Linears cast, the same casts train (the session starts, its guard's
    forward and backward probes passed)."""
    import comfy.ops
    import comfyui_version

    cast_contract = importlib.import_module(f"{pack.__name__}.comfy_adapter.cast_contract")
    if path == "recompute":
        monkeypatch.setattr(cast_contract, "plain_cast_linear", lambda layer: False)
    # dynamic VRAM's casts are reused memory: the contract is on (the casts below are fresh)
    monkeypatch.setattr(cast_contract, "reuse_by_design", lambda: ("dynamic VRAM (this test)", ""))

    cast = comfy.ops.cast_bias_weight

    def cast_made_in_inference_mode(*args, **kwargs):
        weight, bias, *rest = cast(*args, **kwargs)
        with torch.inference_mode():
            return (weight.clone(), None if bias is None else bias.clone(), *rest)

    patcher = TINY_FAMILIES["flux"].patcher(seed=4)
    for layer in patcher.model.diffusion_model.modules():
        # every layer casts, as under dynamic VRAM; in the re-cast case only the Linears (0.33's
        # norms cast too, and a norm saves its weight)
        if hasattr(layer, "comfy_cast_weights") and (path == "recompute" or cast_contract.is_linear(layer)):
            layer.comfy_cast_weights = True
    monkeypatch.setattr(comfy.ops, "cast_bias_weight", cast_made_in_inference_mode)
    config = mods.ft.TrainConfig(steps=2, rank=2, alpha=2.0, seed=1)
    message = (
        rf"cannot train on this ComfyUI \({comfyui_version.__version__}\): a weight ComfyUI hands a layer "
        r"was made under inference mode .* --disable-dynamic-vram"
    )
    if path == "re-cast":
        with mods.ft.lora_session(patcher, config) as session:
            assert session.lora.parameters()
        return
    with pytest.raises(RuntimeError, match=message) as raised:
        with mods.ft.lora_session(patcher, config):
            pass
    assert "\n" not in str(raised.value)


def test_a_resumed_lora_with_dropout_passes_the_guard(mods):
    """A run that starts from a trained LoRA (resume, start_from_lora) with LoRA dropout on: the
    guard compares the two paths in eval mode (peft creates its dropout modules in training
    mode; with dropout the two forwards would differ by chance and the run would be refused)."""
    from kt_testing.gradients import randomise_lora

    patcher = TINY_FAMILIES["flux"].patcher(seed=4)
    with mods.ft.lora_session(patcher, mods.ft.TrainConfig(rank=2, alpha=2.0, seed=1)) as session:
        randomise_lora(session, seed=3)
        trained = session.lora.modules()
    config = mods.ft.TrainConfig(rank=2, alpha=2.0, dropout=0.5, seed=1)
    with mods.ft.lora_session(patcher, config, initial=trained) as session:
        assert any(m.training for m in session.diffusion_model.modules())  # dropout is on again


def test_the_probe_carries_a_reference_in_the_runs_layout(mods, pack, monkeypatch):
    """The guard's probe has a reference in the run's layout, so it also compares the
    reference path. Shown with ComfyUI 0.33's timestep-zero references: a block patch that
    drops the call-time modulation ranges (`modulation_dims*`, as a changed block argument
    would) computes the same without references but not with them, and the run is refused."""
    from kt_testing.tiny_models import tiny_flux2_patcher

    if not mods.flux.comfy_runs_timestep_zero(tiny_flux2_patcher(seed=4).model.diffusion_model):
        pytest.skip("this ComfyUI has no timestep-zero references (0.33+)")
    monkeypatch.setattr(mods.blocks, "call_time_kwargs", lambda extra: {})
    for layout in ("index", "index_timestep_zero"):
        config = mods.ft.TrainConfig(rank=2, alpha=2.0, seed=1, layout=layout)
        if layout == "index":  # no modulation ranges: the patch is harmless
            with mods.ft.lora_session(tiny_flux2_patcher(seed=4), config):
                pass
        else:
            with pytest.raises(RuntimeError, match=r"cannot train on this ComfyUI \(0\.33"):
                with mods.ft.lora_session(tiny_flux2_patcher(seed=4), config):
                    pytest.fail("the session must not start")
