"""What a training run does under ComfyUI 0.33's dynamic VRAM (comfy-aimdo; the server's default
on NVIDIA), said in one place.

Under dynamic VRAM the stock loader leaves the weights in a read-only memory map of the file,
and `ModelPatcherDynamic` streams every module over 16 KiB to the GPU per use (vbar pages that
stay resident while VRAM allows), force-loading only the small ones. The training run:

- trains on those weights without a copy (`lora_session`: the frozen base is made usable by
  autograd with tensors sharing the loaded memory, and every casting Linear casts again in the
  backward: `cast_contract`), after a dirty load (a fresh `patches_uuid`), so no cast view that
  earlier sampling cached under inference mode is reused;
- ignores `blocks_to_swap` (aimdo already streams the weights: swapping the force-loaded small
  ones frees nothing) and ComfyUI's memory budget for partial loads (it has none in this mode);
- with fp8_scaled, gives the vbar the fp8 geometry (the GPU holds fp8 pages), but the fp8 block
  weights are new tensors in RAM: half the bf16 weights, said once with its size;
- reads the VRAM estimate as what training needs beside the streamed weights.

`dynamic_vram_notes` gives these as the lines the run shows (log and progress message).
"""

from __future__ import annotations

from .comfy_loading import is_dynamic

DISABLE_FLAG = "--disable-dynamic-vram"


def block_swap_note(blocks_to_swap: int) -> str:
    return (
        f"blocks_to_swap {blocks_to_swap} is not used under ComfyUI's dynamic VRAM, which already "
        f"streams every weight over 16 KiB from RAM per use; start ComfyUI with {DISABLE_FLAG} to "
        "swap blocks"
    )


def fp8_scaled_note(fp8_bytes: int) -> str:
    return (
        f"fp8_scaled under ComfyUI's dynamic VRAM: the fp8 block weights are a new copy in RAM "
        f"({fp8_bytes / 2**30:.2f} GiB) beside the file's mapped weights; the GPU holds them as fp8"
    )


def fp8_scaled_bytes(model, family) -> int:
    """The size of fp8_scaled's e4m3 block weights (one byte per value) for this MODEL of
    `family` (its `families.ModelFamily` entry)."""
    from ..trainer_core.fp8_rows import scaled_layer_names

    diffusion_model = model.model.diffusion_model
    names = scaled_layer_names(diffusion_model, family.fp8_layers)
    return sum(diffusion_model.get_submodule(name).weight.numel() for name in names)


def dynamic_vram_notes(model, blocks_to_swap: int, fp8_mode: str = "as_loaded", family=None) -> list[str]:
    """The statements a run on `model` shows before it starts (the first says the mode; the
    run adds what training needs beside the streamed weights to it): none off dynamic VRAM."""
    if not is_dynamic(model):
        return []
    notes = ["ComfyUI's dynamic VRAM: training streams the file's mapped weights (no copy of the model)"]
    if blocks_to_swap:
        notes.append(block_swap_note(blocks_to_swap))
    if fp8_mode == "fp8_scaled":
        if family is None:
            from .model_family import family_of

            family = family_of(model)
        notes.append(fp8_scaled_note(fp8_scaled_bytes(model, family)))
    return notes
