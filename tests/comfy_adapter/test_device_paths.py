"""The GPU code paths of training, on a CPU-only machine (see kt_testing.devices).

1. Device discipline: the whole training step (forward, loss, backward, clipping, AdamW)
   with the model on another device than the cached samples (`meta` stands in for the GPU),
   on full and partial loads, with a stock LoRA and with fp8 weights.
2. Partial ("lowvram") loads: ComfyUI leaves some layers on the offload device and casts them
   per use; the gradients equal a full load's, with and without a stock LoRA, for fp8 and
   fp8_scaled weights and with block swap, and the shared MODEL is unchanged afterwards.
3. ComfyUI's model management cannot unload or re-load the training clone under a run
   ("unload models", previews).
"""

from __future__ import annotations

import pytest
import torch

from comfy_adapter.autograd_safe import autograd_unsafe
from kt_testing.device_moves import emulate_device_moves
from kt_testing.devices import (
    META,
    cpu_as_small_gpu,
    lora_state,
    lowvram_layers,
    meta_as_gpu,
    offload_reserve,
    stock_lora,
)
from kt_testing.probes import model_output, tiny_samples
from kt_testing.tiny_models import small_flux_vae, tiny_flux_patcher

# attention + a single block's fused layer (trained by the default preset) and a modulation
# layer (not trained by it: its weight stays a plain patched Linear under the run)
LORA_LAYERS = ("double_blocks.0.img_attn.qkv", "single_blocks.1.linear2", "double_blocks.1.img_mod.lin")


@pytest.fixture(scope="module")
def mods(pack_import):
    names = {
        "ft": "comfy_adapter.lora_session",
        "loop": "trainer_core.loop",
        "flow_step": "trainer_core.flow_step",
        "previews": "comfy_adapter.previews",
    }
    return type("Mods", (), {key: pack_import(name) for key, name in names.items()})


@pytest.fixture
def forget_meta_models():
    """Models loaded onto `meta` hold no values: drop them from ComfyUI's list afterwards."""
    import comfy.model_management as mm

    yield
    mm.current_loaded_models[:] = [m for m in mm.current_loaded_models if m.device.type != "meta"]


def base_model(kind: str, with_lora: bool, seed: int = 5):
    if kind == "fp8":  # as the stock UNETLoader loads weight_dtype fp8_e4m3fn on a CPU
        model = tiny_flux_patcher(seed=seed, dtype=torch.float8_e4m3fn, manual_cast_dtype=torch.float32)
    else:
        model = tiny_flux_patcher(seed=seed)
    return stock_lora(model, LORA_LAYERS, seed=seed + 1) if with_lora else model


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.diffusion_model.parameters())


def samples(mods):
    return tiny_samples(mods.flow_step.Sample, 2, 3, [(8, 6)])


# -- 1. device discipline ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "with_lora", "partial"),
    [("fp32", False, False), ("fp32", True, True), ("fp8", False, False), ("fp8", True, True)],
    ids=["full", "partial-stock-lora", "fp8", "fp8-partial-stock-lora"],
)
def test_a_training_step_stays_on_the_compute_device(
    mods, monkeypatch, forget_meta_models, kind, with_lora, partial
):
    import comfy.model_management as mm

    model = base_model(kind, with_lora)
    budget = weight_bytes(model) // 2 if partial else 2**34
    meta_as_gpu(monkeypatch, model, int(mm.minimum_inference_memory()) + budget)
    config = mods.ft.TrainConfig(rank=2, alpha=2.0, targets="all_linear", seed=3)
    with mods.ft.lora_session(model, config) as session:
        assert bool(lowvram_layers(session.diffusion_model)) == partial
        parameters = session.lora.parameters()
        assert {p.device for p in parameters} == {META}
        loss = session.loss(samples(mods), torch.Generator().manual_seed(1))  # samples on the CPU
        assert loss.device == META
        loss.backward()
        assert all(p.grad is not None and p.grad.device == META for p in parameters)
        torch.nn.utils.clip_grad_norm_(parameters, 1.0, foreach=False)
        optimizer = mods.loop.make_optimizer(config, parameters)
        optimizer.step()
        assert {p.device for p in parameters} == {META}


# -- 2. partial loads --------------------------------------------------------------------------


def gradients(mods, model, config):
    with mods.ft.lora_session(model, config, poison_swapped=True) as session:
        left_behind = lowvram_layers(session.diffusion_model)
        swapped = []
        if session.swapper is not None:
            moved = {id(slot.tensor) for slots in session.swapper.slots.values() for slot in slots}
            swapped = [
                name.removesuffix(".base_layer")
                for name, module in session.diffusion_model.named_modules()
                if any(id(p) in moved for p in module.parameters(recurse=False))
            ]
        loss = session.loss(samples(mods), torch.Generator().manual_seed(7))
        grads = torch.autograd.grad(loss, session.lora.parameters())
    return loss.detach(), grads, left_behind, swapped


# (weights, stock LoRA, config, budget divisor). On the tiny Flux ComfyUI's partial load
# either loads the LoRA-patched layers first (budget 1/2 of the weights: the blocks are split
# between loaded and left-behind layers) or, below about 1/14, leaves every layer behind, the
# patched ones included (their patches then apply per use through `LowVramPatch`).
CASES = {
    "fp32": ("fp32", False, {}, 2),
    "fp32-stock-lora-left-behind": ("fp32", True, {}, 16),
    "fp8": ("fp8", False, {}, 2),
    "fp8_scaled": ("fp32", False, {"fp8_mode": "fp8_scaled"}, 2),
    "fp8_scaled-stock-lora-left-behind": ("fp32", True, {"fp8_mode": "fp8_scaled"}, 16),
    "swap-split-blocks-stock-lora": ("fp32", True, {"blocks_to_swap": 4}, 2),
}


def patched_layers(model) -> set[str]:
    return {key.removeprefix("diffusion_model.").removesuffix(".weight") for key in model.patches}


@pytest.mark.parametrize("case", list(CASES))
def test_a_partial_load_trains_exactly_like_a_full_load(mods, monkeypatch, case):
    kind, with_lora, settings, divisor = CASES[case]
    config = mods.ft.TrainConfig(rank=2, alpha=2.0, targets="all_linear", seed=4, **settings)
    full_loss, full_grads, none_left, _ = gradients(mods, base_model(kind, with_lora), config)
    assert none_left == []

    model = base_model(kind, with_lora)
    cpu_as_small_gpu(monkeypatch, weight_budget=weight_bytes(model) // divisor)
    before = model_output(model)  # itself a partial load: the model as other workflows see it
    parameters = dict(model.model.diffusion_model.named_parameters())
    loss, grads, left_behind, swapped = gradients(mods, model, config)
    assert left_behind
    if divisor == 16:
        assert patched_layers(model) <= set(left_behind)
    else:
        assert len(left_behind) < len(
            [m for m in model.model.diffusion_model.modules() if hasattr(m, "weight")]
        )
    assert torch.equal(loss, full_loss)
    for got, expected in zip(grads, full_grads, strict=True):
        assert torch.equal(got, expected)
    if settings.get("blocks_to_swap"):  # blocks are split: the swapper moved only the loaded layers
        assert swapped and not set(swapped) & set(left_behind)
        split = [f"double_blocks.{i}." for i in range(2)] + [f"single_blocks.{i}." for i in range(2)]
        assert any(
            any(n.startswith(b) for n in swapped) and any(n.startswith(b) for n in left_behind) for b in split
        )
    # the shared MODEL: the same sampling output, and (fp8_scaled unloads the model through
    # ComfyUI first, which puts fresh Parameters in) the same parameter objects
    after = dict(model.model.diffusion_model.named_parameters())
    if "fp8_mode" not in settings:
        assert all(after[name] is p for name, p in parameters.items())
    assert {p.dtype for p in after.values()} == {p.dtype for p in parameters.values()}
    assert torch.equal(model_output(model), before)


@pytest.mark.parametrize("streams", [0, 2], ids=["cpu-streams", "nvidia-streams"])
def test_half_the_weights_is_a_partial_load_only_beside_comfyuis_offload_reserve(mods, monkeypatch, streams):
    """On the H100 the GPU layer's partial-load test, given half the weights of a MODEL with a
    stock LoRA, found every layer left behind ("47 layers left behind, weights on ['cpu']").
    ComfyUI's own accounting, not the trainer: on NVIDIA it offloads asynchronously
    (NUM_STREAMS 2) and keeps (NUM_STREAMS + 1) x the largest left-behind layer free, a
    patched layer counted with its LowVramPatch estimate (`offload_reserve`). With 2 streams
    half the weights load no layer (here as on the H100: every layer left behind; ComfyUI 0.33
    counts its reserve differently and splits the model); a quarter of the weights plus the
    reserve splits the model, with either stream count and either ComfyUI."""
    import comfy.model_management as mm

    monkeypatch.setattr(mm, "NUM_STREAMS", streams)
    config = mods.ft.TrainConfig(rank=2, alpha=2.0, targets="all_linear", seed=4)
    castable = [
        n
        for n, m in base_model("fp32", True).model.diffusion_model.named_modules()
        if hasattr(m, "comfy_cast_weights")
    ]

    def left_behind(budget_of) -> int:
        model = base_model("fp32", True)
        with pytest.MonkeyPatch.context() as scoped:
            cpu_as_small_gpu(scoped, weight_budget=budget_of(model))
            with mods.ft.lora_session(model, config) as session:
                return len(lowvram_layers(session.diffusion_model))

    half = left_behind(lambda model: weight_bytes(model) // 2)
    beside = left_behind(lambda model: weight_bytes(model) // 4 + offload_reserve(model))
    assert 0 < beside < len(castable)
    import comfyui_version

    if streams and comfyui_version.__version__ == "0.3.75":  # the H100's ComfyUI
        assert half == len(castable)
    else:  # ComfyUI 0.33 reserves the next NUM_STREAMS layers, not 3x the largest: half splits
        assert 0 < half < len(castable)


@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_fp8_scaled_applies_the_stock_lora_exactly(mods, monkeypatch, partial):
    """Each patched layer computes with its fp8 values times their scale plus the stock LoRA's
    delta in full precision (not folded into the fp8 values, where rounding would blur it),
    the same on full and partial loads."""
    import comfy.ops

    model = base_model("fp32", True)
    expected_delta = {}
    for name, value in lora_state(model, LORA_LAYERS, seed=6).items():  # by hand: alpha/rank * up @ down
        if name.endswith("lora_up.weight"):
            layer = name.removeprefix("diffusion_model.").removesuffix(".lora_up.weight")
            down = lora_state(model, LORA_LAYERS, seed=6)[f"diffusion_model.{layer}.lora_down.weight"]
            expected_delta[layer] = value @ down  # alpha == rank
    if partial:  # every layer left behind: the patches apply per use (see CASES)
        cpu_as_small_gpu(monkeypatch, weight_budget=weight_bytes(model) // 16)
    config = mods.ft.TrainConfig(rank=2, alpha=2.0, fp8_mode="fp8_scaled", seed=2)
    with mods.ft.lora_session(model, config) as session:
        left_behind = lowvram_layers(session.diffusion_model)
        for layer in ("double_blocks.0.img_attn.qkv", "single_blocks.1.linear2"):
            base = session.diffusion_model.get_submodule(layer).get_base_layer()
            assert base.weight.dtype == torch.float8_e4m3fn
            scale = next(f for f in base.weight_function if hasattr(f, "scale")).scale
            weight, _ = comfy.ops.cast_bias_weight(base, torch.zeros(1, base.in_features))
            expected = base.weight.float() * scale[:, None] + expected_delta[layer]
            assert torch.allclose(weight, expected, rtol=1e-6, atol=1e-6)
    assert (set(LORA_LAYERS) <= set(left_behind)) if partial else not left_behind


def test_fp8_scaled_quantises_before_comfyui_loads(mods, pack_import):
    """ComfyUI loads (and counts) fp8 weights for the block linears: the full-precision model
    is never loaded for an fp8_scaled run."""
    import comfy.model_management as mm

    model = base_model("fp32", True)
    flux = model.model.diffusion_model
    family = pack_import("comfy_adapter.model_family").family_of(model)
    scaled = pack_import("trainer_core.fp8_rows").scaled_layer_names(flux, family.fp8_layers)
    expected = mm.module_size(model.model) - sum(3 * flux.get_submodule(n).weight.numel() for n in scaled)
    config = mods.ft.TrainConfig(rank=2, alpha=2.0, fp8_mode="fp8_scaled", seed=2)
    with mods.ft.lora_session(model, config) as session:
        assert session.patcher.model.model_loaded_weight_memory == expected  # 1 byte, not 4
    assert mm.module_size(model.model) == expected + sum(
        3 * flux.get_submodule(n).weight.numel() for n in scaled
    )


# -- 3. the clone is ComfyUI's to leave alone while training -------------------------------------


def losses(mods, model, config, during=None):
    batch = samples(mods)
    with mods.ft.lora_session(model, config) as session:

        def on_step(info):
            if during is not None:
                during(info.step, session)

        return mods.loop.train(
            config, session.lora.parameters(), lambda i: batch, session.loss, on_step
        ).losses


def test_unloading_models_during_training_changes_nothing(mods):
    import comfy.model_management as mm

    config = mods.ft.TrainConfig(steps=3, rank=2, alpha=2.0, learning_rate=1e-2, seed=6)
    undisturbed = losses(mods, base_model("fp32", True), config)
    clones = []

    def unload(step, session):
        mm.unload_all_models()  # the "Unload models" button (/free) mid-run
        clones.append(session.patcher)

    model = base_model("fp32", True)
    assert losses(mods, model, config, unload) == undisturbed
    assert clones[0] in mm.loaded_models()  # after the run, a loaded model like any other


def test_previews_sample_the_training_clone_in_place(mods, monkeypatch):
    import comfy.model_management as mm

    calls = []
    real = mm.load_models_gpu
    monkeypatch.setattr(
        mm, "load_models_gpu", lambda models, **kw: (calls.append(list(models)), real(models, **kw))
    )
    gen = torch.Generator().manual_seed(0)
    positive = [[torch.randn(1, 5, 48, generator=gen), {"pooled_output": torch.randn(1, 32, generator=gen)}]]
    settings = mods.previews.PreviewSettings(
        positive, None, small_flux_vae(), 1, 2, 1.0, 3.5, 64, 64, 0, "euler", "simple"
    )
    config = mods.ft.TrainConfig(rank=2, alpha=2.0, seed=1)
    with mods.ft.lora_session(base_model("fp32", True), config) as session:
        weights = {n: p.data_ptr() for n, p in session.diffusion_model.named_parameters()}
        calls.clear()
        images = mods.previews.sample_previews(session, settings, config.layout)
        assert not any(session.patcher in models for models in calls)  # the VAE's load only
        assert calls  # the VAE was loaded the normal way
        assert {n: p.data_ptr() for n, p in session.diffusion_model.named_parameters()} == weights
    assert images.shape == (1, 64, 64, 3) and torch.isfinite(images).all()


# -- 4. weights a GPU load has moved (kt_testing.device_moves) ------------------------------------


def loaded_in_the_executor(kind: str, with_lora: bool):
    """`base_model` as a loader node makes it (under inference mode, in the executor), with
    every later load and unload moving its weights as a GPU load does, loaded once by a sampling
    run in the executor."""
    import comfy.model_management as mm

    with torch.inference_mode():
        model = emulate_device_moves(base_model(kind, with_lora))
        mm.load_models_gpu([model])
    return model


def half_inference(model) -> list[str]:
    """Weights no op can use: not inference tensors, yet without a version counter."""
    unsafe = [n for n, p in model.model.diffusion_model.named_parameters() if not p.is_inference()]
    return [n for n in unsafe if autograd_unsafe(model.model.diffusion_model.get_parameter(n))]


@pytest.mark.parametrize(
    "case",
    [
        "fp32",
        "fp32-stock-lora-left-behind",
        "fp8",
        "fp8_scaled-stock-lora-left-behind",
        "swap-split-blocks-stock-lora",
    ],
)
def test_weights_moved_by_a_gpu_load_train_exactly_like_plain_ones(mods, monkeypatch, case):
    """The first GPU run failed at step 1 ("Inference tensors do not track version counter"):
    the training thread's load moved loader-made weights outside inference mode. Here each
    load moves them so (and cast, patched by a stock LoRA, partially loaded); two runs with
    "Unload models" between them (the second loads the model again) give exactly the loss and
    gradients of the same model made outside inference mode and never moved."""
    import comfy.model_management as mm

    kind, with_lora, settings, divisor = CASES[case]
    config = mods.ft.TrainConfig(rank=2, alpha=2.0, targets="all_linear", seed=4, **settings)
    expected_loss, expected_grads, *_ = gradients(mods, base_model(kind, with_lora), config)
    cpu_as_small_gpu(monkeypatch, weight_budget=weight_bytes(base_model(kind, with_lora)) // divisor)
    model = loaded_in_the_executor(kind, with_lora)
    for _ in range(2):
        loss, grads, left_behind, _ = gradients(mods, model, config)
        assert left_behind  # a partial load
        assert torch.equal(loss, expected_loss)
        assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
        mm.unload_all_models()  # the button, from a thread outside inference mode
    assert not half_inference(model)  # the run left nothing unusable behind


def test_loads_from_the_training_thread_leave_the_loaders_weights_usable(mods):
    """ComfyUI's model management called from the training thread (the clone's load, the
    fp8_scaled unload) runs as in the executor, under inference mode: afterwards the shared
    MODEL's weights are plain inference tensors ComfyUI can use, never half-inference ones."""
    config = mods.ft.TrainConfig(rank=2, alpha=2.0, seed=4, fp8_mode="fp8_scaled")
    model = loaded_in_the_executor("fp32", True)
    with mods.ft.lora_session(model, config):
        pass
    assert not half_inference(model)
    with torch.inference_mode():
        model_output(model)  # ComfyUI's own forward on the MODEL
