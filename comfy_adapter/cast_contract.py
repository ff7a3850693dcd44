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

**Norms too** (`is_cast_norm`): ComfyUI's RMSNorm, LayerNorm and GroupNorm ops with a weight
cast it as a Linear does (Qwen-Image's query / key / text norms, FLUX's QKNorm on 0.33), and
`rms_norm` / `layer_norm` keep that weight for the backward. Where casts are reused they take
the recompute (their input kept, the norm run again in the backward: a norm's cost, no matmul);
elsewhere they run as ComfyUI made them. Under dynamic VRAM a norm is small enough to stay
resident (its cast is its Parameter); it is an offloaded norm in a partial load, cast into a
stream's shared buffer, whose kept weight another layer's cast would overwrite.

**Only where it is needed** (`ContractPlan`, decided once per run by `plan_for`): the contract
guards against reuse, and ComfyUI reuses cast memory only in some set-ups. `reuse_by_design`
reads them from ComfyUI's state: dynamic VRAM (`memory_management.aimdo_enabled`: streamed
layers are cast into vbar pages and aimdo cast buffers it refills; a resident layer can be
evicted at any time, so every casting layer counts), and 0.33's per-stream cast buffers
(offload streams on and cudaMallocAsync off). Elsewhere (ComfyUI 0.3.75, whose casts are always
fresh; 0.33 with cudaMallocAsync) `shared_cast_memory` measures what the casts do: up to eight
casting layers cast one after another, each cast held, and reuse is any two handed the same
bytes (so a replay of reused memory on the CPU, or a ComfyUI we have not read, turns it on).
Without reuse, autograd keeps the casts (fresh memory, dropped by block checkpointing), except:
without block checkpointing ComfyUI's plain cast Linears still take the re-cast (it keeps no
cast weight for the backward at the cost of a cast), and with `training_fp8_bwd` its quantized
Linears still take the recompute (their fp8 copy of the input then lives only during the
layer's backward). `ContractPlan.describe` is the run's log line.

A recompute reads the layer's input as it is at backward time; an in-place change to it in
between would go unseen by autograd inside a checkpointed block (the block's checkpoint packs
what the layer saves, and nothing saved that way is version-checked; at the top level
autograd checks the input the recompute saves), so the recompute checks the version itself
and raises autograd's own words ("modified by an inplace operation"), which
`forward_guard.check_training_backward` reports. A re-cast reads no input, so such a change
cannot alter its gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

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


NORM_TYPES = ("RMSNorm", "LayerNorm", "GroupNorm")  # ComfyUI's norm ops, by their torch base


def is_cast_norm(module: torch.nn.Module) -> bool:
    """One of ComfyUI's norm ops (`comfy.ops`: RMSNorm, LayerNorm, GroupNorm, each over torch's
    class or, on 0.3.75, `comfy.rmsnorm.RMSNorm`) holding a weight: its forward casts that weight
    as a Linear's does."""
    return (
        hasattr(module, "comfy_cast_weights")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and any(base.__name__ in NORM_TYPES for base in type(module).__mro__[1:])
    )


def linear_names(module: torch.nn.Module) -> list[str]:
    """The names of `module`'s Linear layers (`is_linear`), in model order; a LoRA-wrapped
    layer counts once, under its own name (peft shows its Linear as `<name>.base_layer`)."""
    names = [name.removesuffix(".base_layer") for name, child in module.named_modules() if is_linear(child)]
    return list(dict.fromkeys(names))


def casts_per_call(layer: torch.nn.Module) -> bool:
    """True when the layer's forward goes through `comfy.ops.cast_bias_weight` (what it returns
    may be reused memory): ComfyUI's quantized Linear always casts; an `nn.Linear` op (or a norm
    op, `is_cast_norm`) casts when its load marked it (`comfy_cast_weights`: offloaded, fp8 or
    another stored dtype, dynamic VRAM) or it carries weight / bias functions (a partial load's
    LoRA, fp8_scaled's scale)."""
    if not isinstance(layer, torch.nn.Linear) and not is_cast_norm(layer):
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

    def __init__(self, layer: torch.nn.Module, by_recast: bool | None = None):
        self.layer = layer
        # the layer's forward as it is now: ComfyUI's, or one a ComfyUI bypass adapter installed
        self.previous = vars(layer).get("forward")
        self.forward = self.previous or type(layer).forward.__get__(layer)
        self.by_recast = can_recast(layer) if by_recast is None else by_recast
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


def can_recast(layer: torch.nn.Module) -> bool:
    """The layer's backward can be a re-cast: ComfyUI's plain cast Linear with its own forward
    (no bypass adapter's in its place)."""
    return "forward" not in vars(layer) and plain_cast_linear(layer)


def reuse_by_design() -> tuple[str | None, str]:
    """(why ComfyUI, as this process runs it, may hand one layer's cast memory to another, or
    None; why not, where None), read from ComfyUI's state: see the module docstring."""
    import comfy.model_management as mm
    from comfy.cli_args import args

    try:
        import comfy.memory_management as memory  # 0.33 and newer
    except ImportError:
        memory = None
    if getattr(memory, "aimdo_enabled", False):
        return "ComfyUI's dynamic VRAM casts streamed layers into memory it refills for later layers", ""
    if not hasattr(mm, "get_cast_buffer"):
        return None, "this ComfyUI has no cast buffers"
    if getattr(mm, "NUM_STREAMS", 0) <= 0:
        return None, "no offload streams, so no stream cast buffers; dynamic VRAM off"
    if not getattr(args, "cuda_malloc", False):
        return "ComfyUI's per-stream cast buffers hold offloaded layers' casts (cudaMallocAsync is off)", ""
    return None, "cudaMallocAsync on, so no stream cast buffers; dynamic VRAM off"


def _held_bytes(tensor: torch.Tensor) -> tuple[int, int]:
    stored = getattr(tensor, "_qdata", tensor)  # a quantized weight's packed values
    start = stored.data_ptr()
    return start, start + stored.numel() * stored.element_size()


def shared_cast_memory(layers, device, dtype, limit: int = 8) -> tuple[int, int]:
    """Cast up to `limit` of `layers` that cast per call (`casts_per_call`) one after another
    with ComfyUI's `cast_bias_weight`, holding every cast until the last; returns (how many were
    handed bytes an earlier, still held cast occupies; how many were cast). Fresh casts never
    overlap; memory ComfyUI reuses for the next layer does."""
    import comfy.ops

    held, ranges, shared = [], [], 0
    try:
        with torch.no_grad():
            for layer in [layer for layer in layers if casts_per_call(layer)][:limit]:
                weight, bias, stream = comfy.ops.cast_bias_weight(
                    layer, None, dtype=dtype, device=device, bias_dtype=dtype, offloadable=True
                )
                held.append((layer, weight, bias, stream))
                start, end = _held_bytes(weight)
                shared += any(start < other_end and other_start < end for other_start, other_end in ranges)
                ranges.append((start, end))
    finally:
        for layer, weight, bias, stream in reversed(held):
            comfy.ops.uncast_bias_weight(layer, weight, bias, stream)
    return shared, len(held)


@dataclass(frozen=True)
class ContractPlan:
    """Which layers keep the cast contract in one run (module docstring, "Only where it is
    needed"): `reuse` says why ComfyUI may reuse cast memory (None: it does not), `fresh` why
    not; `checkpointing` is block checkpointing, `fp8_backward` ComfyUI's `training_fp8_bwd`."""

    reuse: str | None
    fresh: str = ""
    checkpointing: bool = True
    fp8_backward: bool = False
    casting: bool = True  # some Linear casts its weight (measured where `reuse` is None)

    def way(self, layer: torch.nn.Module) -> str | None:
        """"recast", "recompute" or None (the layer runs as ComfyUI made it)."""
        if is_cast_norm(layer):  # no matmul to keep: recomputed where casts are reused
            return "recompute" if self.reuse is not None else None
        recast = can_recast(layer)
        if self.reuse is not None:
            return "recast" if recast else "recompute"
        if recast and not self.checkpointing:
            return "recast"  # keeps no cast weight for the backward: memory, at the cost of a cast
        if self.fp8_backward and not isinstance(layer, torch.nn.Linear):
            return "recompute"  # ComfyUI's quantized Linear: its fp8 input copy freed at once
        return None

    def describe(self) -> str:
        """The run's log line: whether the contract is on, where, and why."""
        if self.reuse is not None:
            return (
                f"cast contract on: {self.reuse}; each casting Linear's backward casts its weight "
                "again (a quantized or fp8 one, and each casting norm, runs its forward again)"
            )
        parts = []
        if not self.checkpointing:
            parts.append(
                "ComfyUI's cast Linears cast their weights again in the backward instead of keeping "
                "the casts (memory: block checkpointing is off)"
            )
        if self.fp8_backward:
            parts.append(
                "quantized Linears run their forward again in the backward, so their fp8 copy of the "
                "input lives only during that backward"
            )
        where = f"ComfyUI's casts are fresh memory here ({self.fresh})"
        if not self.casting:  # wrapped all the same: a layer that starts casting mid-run
            return f"cast contract off: no Linear casts its weight ({self.fresh})"
        if not parts:
            return f"cast contract off: {where}; autograd keeps the casts, block checkpointing drops them"
        return f"cast contract in part: {where}; " + "; ".join(parts)


ALWAYS = ContractPlan(reuse="the contract asked for on every casting Linear")


def plan_for(diffusion_model: torch.nn.Module, device, dtype, checkpointing: bool, fp8_backward: bool):
    """This run's `ContractPlan` (module docstring): ComfyUI's set-up first, then, where that
    says no reuse, what the model's casts measure (`shared_cast_memory`)."""
    reuse, fresh = reuse_by_design()
    if reuse is None:
        ops = [m for m in diffusion_model.modules() if is_linear(m) and hasattr(m, "comfy_cast_weights")]
        shared, cast = shared_cast_memory(ops, device, dtype)
        if shared:
            reuse = f"measured: {shared} of {cast} casts held side by side got memory an earlier one held"
        elif cast:
            fresh += f"; measured: {cast} casts held side by side, none sharing memory"
        else:
            fresh += "; no layer casts"
        return ContractPlan(reuse, fresh, checkpointing, fp8_backward, casting=cast > 0)
    return ContractPlan(reuse, fresh, checkpointing, fp8_backward)


def recast_in_backward(diffusion_model: torch.nn.Module, plan: ContractPlan = ALWAYS):
    """Give the ComfyUI Linears of `diffusion_model` (`is_linear`, LoRA base layers included) and
    its norm ops (`is_cast_norm`) that `plan` names the cast contract (`RecastInBackward`: a
    re-cast or a recompute in the backward); returns the function that takes it off again (the
    MODEL is shared: call it when training ends). Layers are found now: attach the LoRA first or
    after, either way the base layers are the same objects."""
    wrapped = []
    for layer in diffusion_model.modules():
        comfy_op = hasattr(layer, "comfy_cast_weights")  # not the LoRA's own torch Linears
        if not ((is_linear(layer) or is_cast_norm(layer)) and comfy_op) or isinstance(
            vars(layer).get("forward"), RecastInBackward
        ):
            continue
        way = plan.way(layer)
        if way is not None:
            layer.forward = RecastInBackward(layer, by_recast=way == "recast")
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
