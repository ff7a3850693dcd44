"""The training clone and ComfyUI's model management: unloading a model the way ComfyUI does,
and keeping the training clone where training put it for the length of a run."""

from __future__ import annotations

import contextlib

import torch

HOLD_KEY = "kontext_trainer_training_hold"


def as_the_executor_loads():
    """Call ComfyUI's model management (load, unload) from the training thread inside this, as
    the executor calls it: under `torch.inference_mode()`.

    Why: a load or unload moves weights with `Module._apply`, which swaps each tensor's `.data`
    for one made in the caller's mode. A loader-made Parameter (created under inference mode in
    the executor) whose `.data` is swapped outside inference mode becomes unusable everywhere,
    for ComfyUI's own sampling too ("Inference tensors do not track version counter"; on a GPU
    every load is such a move). Moved under inference mode it stays a plain inference tensor:
    ComfyUI uses it as always, and `make_autograd_safe_` replaces it where we train."""
    return torch.inference_mode()


def as_after_a_node() -> bool:
    """What ComfyUI's executor does after every node under dynamic VRAM (0.33 `execution.py`):
    its cast buffers reset (`reset_cast_buffers`), the prefetch queues cleaned and the vbar
    watermarks reset. The command line calls it between its phases (loading, encoding,
    training), each a node in a workflow. True when it ran (dynamic VRAM on)."""
    import importlib

    try:
        import comfy.memory_management as memory
    except ImportError:  # ComfyUI 0.3.75: nothing to reset
        return False
    if not getattr(memory, "aimdo_enabled", False):
        return False
    import comfy.model_management

    comfy.model_management.reset_cast_buffers()
    for module, function in (
        ("comfy.model_prefetch", "cleanup_prefetch_queues"),
        ("comfy_aimdo.model_vbar", "vbars_reset_watermark_limits"),
    ):
        try:
            getattr(importlib.import_module(module), function)()
        except (ImportError, AttributeError):  # a ComfyUI or comfy-aimdo without it
            continue
    return True


def is_dynamic(patcher) -> bool:
    """True for ComfyUI 0.33's dynamic-VRAM patcher (`ModelPatcherDynamic`, the stock loaders'
    default on NVIDIA): weights stay where the loader put them (a read-only memory map of the
    file) and are cast per forward."""
    check = getattr(patcher, "is_dynamic", None)
    return bool(check and check())


def loaded_entries(match) -> list:
    import comfy.model_management

    return [
        loaded
        for loaded in comfy.model_management.current_loaded_models
        if loaded.model is not None and match(loaded.model)
    ]


def unload_through_comfyui(patcher, every_clone: bool = False) -> None:
    """Unload `patcher` (with `every_clone`: every patcher of its model) the way ComfyUI's
    model management does (`LoadedModel.model_unload`: weight patches undone, weights on the
    offload device), so the module holds the weights as the loader made them."""
    import comfy.model_management

    def match(other):
        return other.model is patcher.model if every_clone else other is patcher

    with as_the_executor_loads():
        for loaded in loaded_entries(match):
            comfy.model_management.current_loaded_models.remove(loaded)
            loaded.model_unload()
        if patcher.model.current_weight_patches_uuid is not None:  # loaded outside the manager
            patcher.unpatch_model(patcher.offload_device)


def _prepare_sampling_in_place(executor, model, noise_shape, conds, model_options=None, **_loading):
    """The training clone's PREPARE_SAMPLING wrapper: previews sample the model exactly as
    training holds it. ComfyUI's `_prepare_sampling` without loading the clone itself (it is
    loaded; loading it again could move or re-patch weights under the run); additional
    models (a ControlNet in the conditioning, ...) still load. `_loading`: how ComfyUI 0.33
    asks the clone to load (`force_full_load`, `force_offload`), moot for a clone that stays."""
    import comfy.model_management
    import comfy.sampler_helpers as helpers

    models, inference_memory = helpers.get_additional_models(conds, model.model_dtype())
    models += helpers.get_additional_models_from_model_options(model_options)
    models += model.get_nested_additional_models()
    if models:
        memory, minimum = helpers.estimate_memory(model, noise_shape, conds)
        with as_the_executor_loads():
            comfy.model_management.load_models_gpu(
                models,
                memory_required=memory + inference_memory,
                minimum_memory_required=minimum + inference_memory,
            )
    return model.model, conds, models


@contextlib.contextmanager
def held_for_training(patcher):
    """While training, ComfyUI's model management cannot unload, partially unload or re-patch
    the training clone: it leaves ComfyUI's list of loaded models (so freeing memory for the
    VAE, the "unload models" button or another model's load pass it by), and previews sample
    it in place (`_prepare_sampling_in_place`). Afterwards it is a loaded model like any
    other again."""
    import comfy.model_management
    import comfy.patcher_extension

    held = loaded_entries(lambda other: other is patcher)
    for loaded in held:
        comfy.model_management.current_loaded_models.remove(loaded)
    kind = comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING
    patcher.add_wrapper_with_key(kind, HOLD_KEY, _prepare_sampling_in_place)
    try:
        yield
    finally:
        patcher.remove_wrappers_with_key(kind, HOLD_KEY)
        for loaded in reversed(held):
            comfy.model_management.current_loaded_models.insert(0, loaded)


def interrupted_error() -> type[Exception]:
    """The exception ComfyUI's ops raise inside a run when the user presses Cancel."""
    import comfy.model_management

    return comfy.model_management.InterruptProcessingException
