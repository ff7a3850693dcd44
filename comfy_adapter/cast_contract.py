"""ComfyUI's cast contract, kept while training: a weight that `comfy.ops.cast_bias_weight`
hands a layer is valid only for that layer's use.

On ComfyUI 0.33 with dynamic VRAM (its default on NVIDIA), a layer's cast weight is a view of
memory ComfyUI refills for the next layer (a vbar page or an aimdo cast buffer, refilled through
a new tensor, so no version counter moves); offloaded layers without cudaMallocAsync share the
per-stream cast buffers. Anything autograd saves for the backward from such a cast (the base
`F.linear` under peft's LoRA, ComfyUI's `QuantLinearFunc`, a frozen Linear between two LoRA
layers) would be read back after ComfyUI reused it: another layer's weight, no error.

While training, every Linear of the diffusion model whose forward casts (`casts_per_call`) and
whose input needs a gradient keeps nothing of its cast past its forward, in one of two ways:

- **A re-cast in the backward** (`RecastLinear`), for ComfyUI's plain cast Linear (its
  `forward_comfy_cast_weights` is `cast_bias_weight`, `F.linear`, `uncast_bias_weight`: the
  bf16 layers dynamic VRAM streams, manual-cast fp8 weights, partial loads, fp8_scaled's
  scale, a partial load's LoRA as a weight function). The forward is ComfyUI's, run under
  an autograd Function that saves nothing; the backward asks `cast_bias_weight` for the weight
  again (so weight functions, `LowVramPatch` and the dynamic VRAM pages apply as in the forward)
  and multiplies the output's gradient by it at once. The base weights are frozen: the input's
  gradient is all the backward needs, and it needs no input. One forward matmul per forward,
  as without the contract; the cost is the second cast (a transfer where weights stream).
- **A per-layer recompute** (`RecomputeLinear`) for every other casting Linear: ComfyUI's
  quantized Linear (`mixed_precision_ops`, whose training forward is `QuantLinearFunc`), the
  fp8 ops whose forward tries an fp8 matmul, a forward a bypass adapter installed. The forward
  runs without a graph and keeps the layer's input; the backward runs that layer's forward
  again with a graph (its cast, its `QuantLinearFunc` with `training_fp8_bwd`) and goes back
  through it at once: one more forward matmul of that layer per step, and no copy of
  ComfyUI's backward. No node of the first forward survives it, so neither does the fp8 copy
  of the input `QuantLinearFunc` keeps on its node for the fp8 backward (a checkpoint, which
  drops saved tensors only, kept it for the whole forward: 1.06 MiB a token at FLUX.1 size).

A layer that does not cast (a full load of a plain Linear) hands autograd its own Parameter,
which nothing reuses: it runs as before, at no cost.

A recompute reads the layer's input as it is at backward time; an in-place change to it in
between would go unseen by autograd inside a checkpointed block (the block's checkpoint packs
what the layer saves, and nothing saved that way is version-checked; at the top level
autograd checks the input the recompute saves), so the recompute checks the version itself
and raises autograd's own words ("modified by an inplace operation"), which
`forward_guard.check_training_backward` reports. A re-cast reads no input, so such a change
cannot alter its gradient.
"""

from __future__ import annotations

import torch


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


def plain_cast_linear(layer: torch.nn.Module) -> bool:
    """True when the layer's casting forward is ComfyUI's plain one: `cast_bias_weight`, then
    `F.linear` of the input by that weight and bias, then `uncast_bias_weight` (the
    `disable_weight_init.Linear` of ComfyUI's ops and the subclasses that keep its `forward`
    and `forward_comfy_cast_weights`: `manual_cast`, and the ops models load with). Its input
    gradient is then the output's gradient times the cast weight: `RecastLinear` can run it."""
    try:
        from comfy.ops import disable_weight_init
    except ImportError:
        return False
    base, cls = disable_weight_init.Linear, type(layer)
    return (
        isinstance(layer, base)
        and cls.forward is base.forward
        and cls.forward_comfy_cast_weights is base.forward_comfy_cast_weights
    )


class RecastLinear(torch.autograd.Function):
    """ComfyUI's forward of a plain cast Linear, keeping nothing for the backward but the layer;
    the backward casts the weight again (`cast_bias_weight`, as the forward did) and returns the
    input's gradient, `grad @ weight`, as autograd's linear backward computes it."""

    @staticmethod
    def forward(ctx, x, wrapper):
        ctx.wrapper, ctx.dtype, ctx.device = wrapper, x.dtype, x.device
        return wrapper.forward(x)

    @staticmethod
    def backward(ctx, grad):
        import comfy.ops

        layer = ctx.wrapper.layer
        ctx.wrapper.recasts += 1
        weight, bias, stream = comfy.ops.cast_bias_weight(
            layer, None, dtype=ctx.dtype, device=ctx.device, bias_dtype=ctx.dtype, offloadable=True
        )
        try:
            return grad.matmul(weight), None
        finally:
            comfy.ops.uncast_bias_weight(layer, weight, bias, stream)


class RecastInBackward:
    """A layer's `forward` when it casts and its input needs a gradient (see the module
    docstring): ComfyUI's plain cast Linear through `RecastLinear` (a re-cast in the backward),
    any other through `RecomputeLinear` (a recompute in the backward). Installed as an instance attribute
    over the class's `forward`, removed by `recast_in_backward`'s returned function. `recasts`
    counts the backward's casts of the first kind."""

    def __init__(self, layer: torch.nn.Module):
        self.layer = layer
        # the layer's forward as it is now: ComfyUI's, or one a ComfyUI bypass adapter installed
        self.previous = vars(layer).get("forward")
        self.forward = self.previous or type(layer).forward.__get__(layer)
        self.by_recast = self.previous is None and plain_cast_linear(layer)
        self.recasts = 0

    def __call__(self, x, *args, **kwargs):
        if not (torch.is_grad_enabled() and x.requires_grad and casts_per_call(self.layer)):
            return self.forward(x, *args, **kwargs)
        own_resident_views(self.layer)
        if self.by_recast and not args and not kwargs:
            return RecastLinear.apply(x, self)
        return RecomputeLinear.apply(x, self, args, kwargs)


class RecomputeLinear(torch.autograd.Function):
    """A layer's forward (ComfyUI's, unchanged) run without a graph, its input kept; the
    backward runs that forward again with a graph (its cast, and ComfyUI's `QuantLinearFunc`
    with its own fp8 or compute-dtype backward) and back through it at once. Unlike a
    checkpoint, the first forward leaves no autograd node behind: ComfyUI's `QuantLinearFunc`
    keeps its fp8 copy of the input on its node (`ctx.q_input`, not a saved tensor, so no
    checkpoint drops it), and here that copy lives only during the layer's backward."""

    @staticmethod
    def forward(ctx, x, wrapper, args, kwargs):
        ctx.wrapper, ctx.args, ctx.kwargs, ctx.version = wrapper, args, kwargs, x._version
        ctx.save_for_backward(x)
        return wrapper.forward(x, *args, **kwargs)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if x._version != ctx.version:  # the recompute would see another input
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: the input of a {type(ctx.wrapper.layer).__name__} changed between "
                "its forward and its backward"
            )
        with torch.enable_grad():
            again = x.detach().requires_grad_()
            out = ctx.wrapper.forward(again, *ctx.args, **ctx.kwargs)
            (grad_x,) = torch.autograd.grad(out, again, grad)
        return grad_x, None, None, None


def recast_in_backward(diffusion_model: torch.nn.Module):
    """Give every ComfyUI Linear of `diffusion_model` (`is_linear`, LoRA base layers included) the
    cast contract (`RecastInBackward`: a re-cast or a recompute in the backward); returns the
    function that takes it off again (the MODEL is shared: call it when training ends). Layers
    are found now: attach the LoRA first or after, either way the base layers are the same
    objects."""
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
