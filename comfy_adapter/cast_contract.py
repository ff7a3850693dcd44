"""ComfyUI's cast contract, kept while training: a weight that `comfy.ops.cast_bias_weight`
hands a layer is valid only for that layer's use.

On ComfyUI 0.33 with dynamic VRAM (its default on NVIDIA), a layer's cast weight is a view of
memory ComfyUI refills for the next layer (a vbar page or an aimdo cast buffer, refilled through
a new tensor, so no version counter moves); offloaded layers without cudaMallocAsync share the
per-stream cast buffers. Anything autograd saves for the backward from such a cast (the base
`F.linear` under peft's LoRA, ComfyUI's `QuantLinearFunc`, a frozen Linear between two LoRA
layers) would be read back after ComfyUI reused it: another layer's weight, no error.

One mechanism covers every Linear of the diffusion model (`nn.Linear` and ComfyUI's quantized
`mixed_precision_ops` Linear, LoRA-wrapped or not): while training, a layer whose forward
casts runs its own forward (ComfyUI's code, unchanged) under a per-layer non-reentrant
`torch.utils.checkpoint`. Nothing the cast returned outlives the forward: the backward runs
ComfyUI's forward of that one layer again (its cast, its `uncast_bias_weight`, its
`QuantLinearFunc` with `training_fp8_bwd`, its weight functions) and uses that cast at once.

Why this design (issue 29's A2) over an autograd Function that casts again and multiplies by
the weight itself (A1): ComfyUI's own quantized forward and fp8 backward, weight functions,
`LowVramPatch` and bypass adapters keep working as ComfyUI writes them, with no copy of its
backward; the cost is one more forward of each casting layer (a matmul), measured in
`bench/`. Memory: what the backward keeps of a layer is its input (the LoRA keeps it too),
never a weight, with or without block checkpointing.

A layer that does not cast (a full load of a plain Linear) hands autograd its own Parameter,
which nothing reuses: it runs as before, at no cost.

A recompute reads the layer's input as it is at backward time; an in-place change to it in
between would go unseen by autograd inside a checkpointed block (the block's checkpoint packs
what the layer's saves, and nothing saved that way is version-checked; at the top level
autograd checks the input the layer's checkpoint saves), so the recompute checks the version
itself and raises autograd's own words ("modified by an inplace operation"), which
`forward_guard.check_training_backward` reports.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint


def is_linear(module: torch.nn.Module) -> bool:
    """A Linear layer the pack can train: `nn.Linear` (ComfyUI's plain, manual-cast and
    scaled-fp8 ops subclass it) or ComfyUI's quantized Linear (`mixed_precision_ops`, an
    `nn.Module` holding a `QuantizedTensor` weight, with `in_features` / `out_features`)."""
    if isinstance(module, torch.nn.Linear):
        return True
    try:
        from comfy.ops import CastWeightBiasOp
    except ImportError:  # a ComfyUI without it has no quantized Linear either
        return False
    return (
        isinstance(module, CastWeightBiasOp)
        and hasattr(module, "in_features")
        and hasattr(module, "out_features")
        and hasattr(module, "weight")
    )


def linear_names(module: torch.nn.Module) -> list[str]:
    """The names of `module`'s Linear layers (`is_linear`), in model order; a LoRA-wrapped
    layer counts once, under its own name (peft shows its Linear as `<name>.base_layer`)."""
    names = [name.removesuffix(".base_layer") for name, child in module.named_modules() if is_linear(child)]
    return list(dict.fromkeys(names))


def casts_per_call(layer: torch.nn.Module) -> bool:
    """True when the layer's forward goes through `comfy.ops.cast_bias_weight` (what it returns
    may be reused memory): ComfyUI's quantized Linear always casts; an `nn.Linear` op casts when
    its load marked it (`comfy_cast_weights`: offloaded, fp8 or another stored dtype, dynamic
    VRAM) or it carries weight / bias functions (a partial load's LoRA, fp8_scaled's scale)."""
    if not isinstance(layer, torch.nn.Linear):
        return True
    return bool(
        getattr(layer, "comfy_cast_weights", False)
        or getattr(layer, "weight_function", None)
        or getattr(layer, "bias_function", None)
    )


RESIDENT_VIEWS = ("_v_weight", "_v_bias")  # ComfyUI 0.33: a vbar-resident layer's cached cast


def own_resident_views(layer: torch.nn.Module) -> int:
    """Under dynamic VRAM, a layer whose weights are still resident in its vbar pages hands out
    the views it cached at its last cast (`_v_weight`, `_v_bias`). A view cached by sampling
    (under inference mode) is an inference tensor, which autograd refuses to save ("Inference
    tensors cannot be saved for backward"). Such views are replaced by normal tensors over the
    same VRAM (`shared_copy`: no copy); returns how many."""
    from .autograd_safe import shared_copy

    count = 0
    for name in RESIDENT_VIEWS:
        view = vars(layer).get(name)
        if isinstance(view, torch.Tensor) and view.is_inference():
            shared = shared_copy(view)
            if shared is not None:
                setattr(layer, name, shared)
                count += 1
    return count


class RecastInBackward:
    """A layer's `forward`, run under a per-layer checkpoint when it casts and its input needs
    a gradient (see the module docstring). Installed as an instance attribute over the class's
    `forward`, removed by `recast_in_backward`'s returned function."""

    def __init__(self, layer: torch.nn.Module):
        self.layer = layer
        # the layer's forward as it is now: ComfyUI's, or one a ComfyUI bypass adapter installed
        self.previous = vars(layer).get("forward")
        self.forward = self.previous or type(layer).forward.__get__(layer)

    def __call__(self, x, *args, **kwargs):
        if not (torch.is_grad_enabled() and x.requires_grad and casts_per_call(self.layer)):
            return self.forward(x, *args, **kwargs)
        own_resident_views(self.layer)
        version = x._version

        def run(x):
            if x._version != version:  # the recompute would see another input
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an "
                    f"inplace operation: the input of a {type(self.layer).__name__} changed between "
                    "its forward and its backward"
                )
            return self.forward(x, *args, **kwargs)

        return torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False, preserve_rng_state=False)


def recast_in_backward(diffusion_model: torch.nn.Module):
    """Give every ComfyUI Linear of `diffusion_model` (`is_linear`, LoRA base layers included) the
    per-layer recompute; returns the function that takes it off again (the MODEL is shared:
    call it when training ends). Layers are found now: attach the LoRA first or after, either
    way the base layers are the same objects."""
    wrapped = []
    for layer in diffusion_model.modules():
        comfy_op = hasattr(layer, "comfy_cast_weights")  # not the LoRA's own torch Linears
        if is_linear(layer) and comfy_op and not isinstance(vars(layer).get("forward"), RecastInBackward):
            layer.forward = RecastInBackward(layer)
            wrapped.append(layer.forward)

    def remove() -> None:
        for wrapper in reversed(wrapped):
            if vars(wrapper.layer).get("forward") is not wrapper:
                continue  # someone replaced it since: theirs now
            if wrapper.previous is None:
                del wrapper.layer.forward
            else:
                wrapper.layer.forward = wrapper.previous

    return remove
