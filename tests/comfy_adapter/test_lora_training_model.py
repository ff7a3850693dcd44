"""Training through ComfyUI's MODEL: the shared MODEL is untouched, the saved LoRA is what was
trained (read back by the stock LoraLoaderModelOnly), a file can seed a new run, and the
LoRA learns a reference edit."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from kt_testing.executor import run_node
from kt_testing.probes import model_output, tiny_samples
from kt_testing.tiny_models import TINY_FAMILIES, tiny_flux_patcher


@pytest.fixture(scope="module")
def ft(pack):
    return importlib.import_module(f"{pack.__name__}.comfy_adapter.lora_session")


@pytest.fixture(scope="module")
def run(pack):
    return importlib.import_module(f"{pack.__name__}.application.training_run")


@pytest.fixture(scope="module")
def core(pack):
    name = f"{pack.__name__}.trainer_core"
    return type(
        "Core",
        (),
        {
            "flow_step": importlib.import_module(f"{name}.flow_step"),
            "loop": importlib.import_module(f"{name}.loop"),
            "lora_file": importlib.import_module(f"{name}.lora_file"),
            "lora_metadata": importlib.import_module(f"{name}.lora_metadata"),
            "validation": importlib.import_module(f"{name}.validation"),
        },
    )


def sampling_output(model, transformer_options=None, family="flux"):
    """What a sampler gets from `model` for a fixed input with one reference."""
    tiny = TINY_FAMILIES[family]
    return model_output(
        model,
        sigma=0.7,
        references=[(8, 6)],
        transformer_options=transformer_options,
        channels=tiny.channels,
        pooled=tiny.pooled,
    )


def stock_lora_model(core, model, name, seed):
    """`model` with a random LoRA applied by the stock LoraLoaderModelOnly."""
    import folder_paths

    flux = model.model.diffusion_model
    gen = torch.Generator().manual_seed(seed)
    modules = {}
    for layer in ("double_blocks.0.img_attn.qkv", "single_blocks.1.linear2"):
        weight = flux.get_submodule(layer).weight
        modules[layer] = core.lora_file.LoraModule(
            torch.randn(2, weight.shape[1], generator=gen) * 0.2,
            torch.randn(weight.shape[0], 2, generator=gen) * 0.2,
            2.0,
        )
    path = f"{folder_paths.get_folder_paths('loras')[0]}/{name}"
    core.lora_file.save_atomic(core.lora_file.to_state_dict(modules), path)
    return stock_lora_loader(model, name)


def stock_lora_loader(model, name):
    """ComfyUI's LoraLoaderModelOnly applied to `model`, run by ComfyUI's executor."""
    inputs = {"model": model, "lora_name": name, "strength_model": 1.0}
    (patched,) = run_node("LoraLoaderModelOnly", inputs).outputs
    return patched


def samples_for(core, count, seed, family="flux"):
    tiny = TINY_FAMILIES[family]
    return tiny_samples(
        core.flow_step.Sample, count, seed, [(8, 6)], channels=tiny.channels, pooled=tiny.pooled
    )


def train_steps(core, session, config, samples):
    batches = [samples[i : i + 2] for i in range(0, len(samples), 2)]
    return core.loop.train(
        config, session.lora.parameters(), lambda i: batches[i % len(batches)], session.loss
    )


def module_snapshot(model):
    flux = model.model.diffusion_model
    return {
        "types": [(name, type(m)) for name, m in flux.named_modules()],
        "grad": {n: p.requires_grad for n, p in flux.named_parameters()},
        "attributes": set(vars(flux)),
        "options": repr(model.model_options),
        "wrappers": repr(model.wrappers),
        "patches": sorted(model.patches),
    }


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
@pytest.mark.parametrize("with_stock_lora", [False, True], ids=["bare", "stock-lora"])
def test_shared_model_is_bit_identical_after_training(ft, core, comfy_runtime, with_stock_lora, family):
    tiny = TINY_FAMILIES[family]

    def build(name):
        model = tiny.patcher(seed=12)
        if with_stock_lora:
            model = stock_lora_model(core, model, f"{family}_{name}", seed=1)
        return model

    def output(model, options=None):
        return sampling_output(model, options, family)

    # An identical, separately built MODEL gives the expected outputs and (loaded) weights,
    # so the shared one enters training never loaded, as at the start of a workflow.
    reference = build("kt_shared_reference.safetensors")
    before = output(reference)
    loaded_state = {k: v.clone() for k, v in reference.model.diffusion_model.state_dict().items()}
    # (loading replaces patched weights by new parameters; their flags are ComfyUI's business)
    loaded_grad = {n: p.requires_grad for n, p in reference.model.diffusion_model.named_parameters()}
    shared = build("kt_shared_base.safetensors")
    snapshot = module_snapshot(shared)

    layout = "dreamomni2" if family == "flux" else tiny.layout
    config = ft.TrainConfig(
        steps=3, rank=4, alpha=4.0, learning_rate=1e-2, layout=layout, targets="all_linear"
    )
    with ft.lora_session(shared, config) as session:
        # Training starts from exactly the model the user loaded (incl. a stock LoRA's weights):
        # at initialisation (lora_B = 0) the sampling-time output is identical.
        assert torch.equal(output(session.patcher, session.transformer_options()), before)
        result = train_steps(core, session, config, samples_for(core, 2, seed=2, family=family))
        assert result.steps == 3
        assert any(float(p.detach().abs().max()) > 0 for p in session.lora.parameters()[1::2])  # B moved

    after = module_snapshot(shared)
    for key in ("types", "attributes", "options", "wrappers", "patches"):
        assert after[key] == snapshot[key], key  # no LoRA layer, attribute, patch or wrapper left
    assert after["grad"] == loaded_grad
    assert torch.equal(output(shared), before)
    for key, tensor in shared.model.diffusion_model.state_dict().items():
        assert torch.equal(tensor, loaded_state[key]), key


@pytest.mark.parametrize(
    "precision,family",
    [("fp32", "flux"), ("bf16", "flux"), ("fp16", "flux"), ("fp32", "flux2"), ("bf16", "flux2")],
)
def test_saved_lora_through_stock_loader_equals_the_trained_model(
    ft, run, core, comfy_runtime, caplog, precision, family
):
    import comfy.lora
    import folder_paths

    tiny = TINY_FAMILIES[family]
    # FLUX.2: all_linear, so its model-wide modulation layers go through the file and back
    targets = "attention_mlp" if family == "flux" else "all_linear"
    config = ft.TrainConfig(
        steps=4,
        rank=4,
        alpha=2.0,
        learning_rate=2e-2,
        targets=targets,
        save_precision=precision,
        layout=tiny.layout,
    )
    name = f"kt_trained_{family}_{precision}.safetensors"
    path = f"{folder_paths.get_folder_paths('loras')[0]}/{name}"
    model = tiny.patcher(seed=13)
    base_model = {"flux": "flux1_kontext", "flux2": "flux2_dev"}[family]
    names = comfy_runtime.pack_module.comfy_adapter.model_family.family_of(model).names
    facts = core.lora_metadata.RunFacts("kt_trained", base_model, 64, 4, 2, "cafe", 1.7e9, 1, names)

    def output(model, transformer_options=None):  # this family's input
        return sampling_output(model, transformer_options, family)

    with ft.lora_session(model, config) as session:
        train_steps(core, session, config, samples_for(core, 4, seed=3, family=family))
        in_training = output(session.patcher, session.transformer_options())
        trained = session.lora.modules()
        session.save(path, core.lora_metadata.training_metadata(config, facts, 4))
    untrained = output(model)

    # ComfyUI's stock key map consumes every tensor of the file: one patch per LoRA module
    state, metadata = core.lora_file.load(path)
    dtype = core.lora_file.SAVE_PRECISIONS[precision]
    assert {t.dtype for k, t in state.items() if not k.endswith(".alpha")} == {dtype}
    with caplog.at_level("WARNING"):
        patches = comfy.lora.load_lora(state, comfy.lora.model_lora_keys_unet(model.model, {}))
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    assert len(patches) == len(trained) == len(state) // 3
    assert {key for key in patches} == {f"diffusion_model.{layer}.weight" for layer in trained}

    loaded = stock_lora_loader(tiny.patcher(seed=13), name)
    from_file = output(loaded)
    effect = (in_training - untrained).abs().max()
    assert effect > 1e-3  # the LoRA did change the model
    if precision == "fp32":
        assert (from_file - in_training).abs().max() <= 1e-5
    else:
        # the in-training LoRA with its down / up rounded to the file's dtype, added by hand
        reference = tiny.patcher(seed=13)
        with torch.no_grad():
            for layer, module in trained.items():
                down, up = module.down.to(dtype).float(), module.up.to(dtype).float()
                reference.model.diffusion_model.get_submodule(layer).weight += (module.alpha / 4) * up @ down
        assert (from_file - output(reference)).abs().max() <= 1e-5
        assert (from_file - in_training).abs().max() <= 2e-2 * effect  # within the dtype's rounding
    assert metadata["ss_network_dim"] == "4" and metadata["ss_steps"] == "4"
    assert metadata["kontext_trainer.targets"] == targets
    assert metadata["kontext_trainer.dataset_hash"] == "cafe"
    architecture = {"flux": ("flux1", "flux-1-dev/lora"), "flux2": ("flux_2_dev", "Flux.2-dev/lora")}[family]
    assert (metadata["ss_base_model_version"], metadata["modelspec.architecture"]) == architecture
    assert metadata["kontext_trainer.base_model"] == base_model
    if precision != "fp32":
        return

    # The same file seeds a new run: same weights, same outputs as the stock-loaded model.
    resumed_config = dataclasses.replace(config, targets="attention")  # the file's layers win
    initial = run.seed_lora(path, model, resumed_config)
    with ft.lora_session(model, resumed_config, initial=initial) as session:
        exported = session.lora.modules()
        assert set(exported) == set(initial)
        for layer, module in initial.items():
            assert torch.equal(exported[layer].down, module.down) and exported[layer].rank == 4
        assert (output(session.patcher, session.transformer_options()) - from_file).abs().max() <= 1e-5


def test_initial_lora_file_without_flux_keys_is_refused(ft, run, core, tmp_path):
    path = tmp_path / "text_encoder_only.safetensors"
    core.lora_file.save_atomic({"lora_te_text_model.lora_down.weight": torch.zeros(2, 4)}, path)
    message = r"text_encoder_only\.safetensors has no LoRA weights for this model's diffusion model"
    with pytest.raises(ValueError, match=message):
        run.seed_lora(path, tiny_flux_patcher(seed=0), ft.TrainConfig())


# Per family: latent side (the same 16 tokens: FLUX.1 8x8 in 2x2 patches, FLUX.2 4x4 in 1x1),
# VAE channels per latent channel group (FLUX.2 packs 2x2 VAE pixels of 32 channels into 128),
# steps, learning rate, the bounds on final / untrained and on final / mismatched-reference
# held-out loss. Measured final / untrained and final / mismatched on these tiny random models:
# FLUX.1 0.36 and 0.78 (150 steps: 0.38 and 0.84); FLUX.2 0.65 and 0.81 (from 3.15, its
# untrained model starts near the loss of predicting zero, 2.1, where FLUX.1's starts at 5.3; the
# tiny random FLUX.2 learns the copy from the reference slowly: 600 steps at 3e-3 gave 0.67 and
# 0.81 in 40 core-s, these 200 at 5e-3 in 29; at 1e-2 or 2e-2 it stops using the reference, 0.93
# and 1.00 of the mismatched loss).
EDIT_SETS = {"flux": (8, 1, 300, 1e-2, 0.5, 0.8), "flux2": (4, 4, 200, 5e-3, 0.7, 0.85)}


# Once per suite (on 0.33): what it proves is the trainer's (loss, layout, loop, validation);
# ComfyUI's forward is held to the same on both ComfyUIs by the parity and gradient tests. On
# 0.3.75 it cost 158 s of that run's time (fresh clone on 40fa3f1).
@pytest.mark.version_independent
@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_held_out_loss_halves_and_the_reference_is_used(ft, core, family):
    """A synthetic edit set: flat-ish colour latents and, as targets, a fixed recolouring of
    them (VAE channels rotated and negated). The run's own validation (held-out loss at fixed
    sigmas and noise, twice in the run) must fall to at most half of the untrained model's
    (FLUX.2: 0.7, see EDIT_SETS), and be clearly lower with each sample's own reference than
    with another sample's: the LoRA learned the edit from the reference, not just a bias."""
    tiny = TINY_FAMILIES[family]
    side, group, steps, learning_rate, bound, mismatch_bound = EDIT_SETS[family]
    gen = torch.Generator().manual_seed(0)
    context, pooled = torch.randn(5, 48, generator=gen), torch.randn(tiny.pooled, generator=gen)
    samples, channels = [], tiny.channels
    for _ in range(32):
        colour = torch.randn(channels // group, 1, 1, generator=gen).repeat_interleave(group, 0)
        control = colour + 0.3 * torch.randn(channels, side, side, generator=gen)
        samples.append(core.flow_step.Sample(-control.roll(3 * group, 0), context, pooled, [control]))
    training, held_out = samples[:24], samples[24:]
    mismatched = [
        dataclasses.replace(s, references=held_out[(i + 1) % 8].references) for i, s in enumerate(held_out)
    ]
    config = ft.TrainConfig(
        steps=steps,
        learning_rate=learning_rate,
        rank=16,
        alpha=16.0,
        targets="all_linear",
        timestep_sampler="shift",
        gradient_checkpointing=False,
        validate_every=steps // 2,
        layout=tiny.layout,
    )

    with ft.lora_session(tiny.patcher(seed=1), config) as session:

        def validate(data=held_out):
            with core.validation.evaluating(session.diffusion_model):
                return core.validation.held_out_loss(session.predict, data, session.pack, config.seed)

        before = validate()
        batches = [training[i : i + 2] for i in range(0, len(training), 2)]
        result = core.loop.train(
            config,
            session.lora.parameters(),
            lambda i: batches[i % len(batches)],
            session.loss,
            validate=validate,
        )
        after_mismatched = validate(mismatched)
    curve = [loss for _, loss in result.validation]
    assert [step for step, _ in result.validation] == [steps // 2, steps]
    assert curve[-1] <= bound * before, (before, curve)
    assert curve[0] > curve[-1], curve
    assert curve[-1] < mismatch_bound * after_mismatched, (curve, after_mismatched)


def test_trains_a_model_created_in_inference_mode(ft, core):
    """ComfyUI builds every MODEL inside torch.inference_mode(); training must still work and
    leave the model's outputs bit-identical."""
    with torch.inference_mode():
        model = tiny_flux_patcher(seed=14)
    assert next(model.model.diffusion_model.parameters()).is_inference()
    before = sampling_output(model)
    config = ft.TrainConfig(steps=2, rank=2, alpha=2.0, learning_rate=1e-2)
    with ft.lora_session(model, config) as session:
        result = train_steps(core, session, config, samples_for(core, 2, seed=4))
    assert len(result.losses) == 2 and all(loss == loss for loss in result.losses)
    assert torch.equal(sampling_output(model), before)


def test_the_frozen_base_of_a_model_created_in_inference_mode_is_shared_not_copied(ft):
    """The loader's inference weights are swapped for normal tensors over the same memory
    (`make_autograd_safe_(share_memory=True)`): a copy would double the model in RAM (on 0.33's
    dynamic VRAM, +1352 MiB for the demo Flux: tests/e2e/test_dynamic_vram.py, which only 0.33
    runs, and slowly). Checked by address: every base weight of the session lies where the
    loaded one lay."""
    with torch.inference_mode():
        model = tiny_flux_patcher(seed=14)
    loaded = {name: p.data_ptr() for name, p in model.model.diffusion_model.named_parameters()}
    with ft.lora_session(model, ft.TrainConfig(rank=2, alpha=2.0)) as session:
        base = {
            name.replace(".base_layer.", "."): p
            for name, p in session.diffusion_model.named_parameters()
            if ".lora_" not in name
        }
        assert base.keys() == loaded.keys()
        assert not any(p.is_inference() for p in base.values())  # swapped: autograd can save them
        moved = [name for name, p in base.items() if p.data_ptr() != loaded[name]]
        assert not moved, f"{len(moved)} of {len(base)} base weights were copied, e.g. {moved[0]}"


def test_the_session_samples_timesteps_with_its_familys_token_shift(ft, core, pack):
    """The flux_shift sampler takes the shift of the session's family (`ModelFamily.token_shift`,
    issue 43: Qwen-Image's is musubi-tuner's qwen_shift): a FLUX.1 entry given Qwen's points
    draws the loss with them, and not with FLUX's."""
    families = importlib.import_module(f"{pack.__name__}.comfy_adapter.families.flux")
    objective = importlib.import_module(f"{pack.__name__}.trainer_core.objective")
    qwen = objective.QWEN_TOKEN_SHIFT_POINTS
    family = dataclasses.replace(families.FLUX1, token_shift=qwen)
    # 1024 image tokens each (at 256 both lines give mu 0.5)
    samples = tiny_samples(core.flow_step.Sample, 2, 4, [(8, 8)], target=(64, 64))
    config = ft.TrainConfig(rank=2, alpha=2.0, timestep_sampler="flux_shift")
    with torch.inference_mode(False), ft.lora_session(tiny_flux_patcher(seed=1), config, family=family) as s:
        ours = s.loss(samples, torch.Generator().manual_seed(3))
        losses = {
            points: core.flow_step.flow_matching_loss(
                s.predict, samples, config, torch.Generator().manual_seed(3), s.empty_text, s.pack,
                noise_scaling=s.noise_scaling, token_shift=points,
            )
            for points in (qwen, objective.TOKEN_SHIFT_POINTS)
        }
    assert torch.equal(ours, losses[qwen]) and not torch.equal(ours, losses[objective.TOKEN_SHIFT_POINTS])
