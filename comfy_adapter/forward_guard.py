"""A guard for the next ComfyUI release: before a run's first step, the training path and
ComfyUI's own inference forward compute the user's model on one small input, and a difference
beyond rounding stops the run before any step.

The training path is ComfyUI's forward with the pack's block patches (`trainable_blocks`, the
family's `install_blocks`), norm pre-hooks and ComfyUI's training mode; the inference path is
the same forward without the block patches and with the training mode off, as a sampler runs
it. Both see the same weights, LoRA layers included, so they can differ only where a ComfyUI
change breaks what the patches rely on (a block argument, the order of its outputs, a new in-place step).

Tolerance (relative RMS difference of the outputs): ComfyUI 0.33 samples with comfy-kitchen's
fused RoPE and trains with its eager RoPE; both rotate q and k in float32, so the two outputs
differ by float32 rounding passed through the blocks: about 1e-6 relative on the CPU here.
`TOLERANCE` allows 1e-4 for float32 / float64 compute; half-precision compute (bf16, fp16, also
fp8 weights computed in bf16) rounds every activation to 8 / 11 bits, so the two op orders can
differ by a few 1e-3, and 3e-2 is allowed. A broken patch differs by the size of a block's
contribution: order 1e-1 and more.

The probe is the family's (`ModelFamily.probe`): a small seeded input with one reference in
the run's layout, so the reference path (ids, and 0.33's
timestep-zero modulation) is compared too.

With gradient checkpointing, autograd hands the tensors a block saves to checkpoint's hooks
and its version check never runs: a ComfyUI release that modified a saved tensor in place
would train on wrong gradients, silently. `check_training_backward` therefore runs one
backward of the probe through the blocks without checkpointing (whatever the run's setting),
where autograd checks every saved tensor, and turns "modified by an inplace operation" into a
message naming the ComfyUI version, before any step.
"""

from __future__ import annotations

import torch

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}
HALF_TOLERANCE = 3e-2


def comfyui_version() -> str:
    try:
        import comfyui_version as version

        return version.__version__
    except ImportError:
        return "unknown"


def _cannot_train() -> str:
    return f"Kontext Trainer cannot train on this ComfyUI ({comfyui_version()})"


def relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours.double(), theirs.double()
    return float((ours - theirs).norm() / theirs.norm().clamp_min(1e-30))


def check_training_forward(
    patcher, family, transformer_options: dict, dtype: torch.dtype, layout: str | None = None
) -> float:
    """Raise (before any step) if the training path's output differs from ComfyUI's forward
    beyond `TOLERANCE`; returns the relative difference. With a `layout`, the probe has a
    reference in that layout (the patcher must carry the family's reference ids)."""
    from ..trainer_core.validation import evaluating
    from .trainable_blocks import comfy_training_mode, without_trainable_blocks

    model = patcher.model.diffusion_model
    args, kwargs = family.probe(model, patcher.load_device, dtype, layout)
    theirs_options = without_trainable_blocks(transformer_options)
    # no graph: nothing either forward casts is kept (ComfyUI may reuse it, cast_contract), and
    # no LoRA dropout (peft makes its dropout modules in train mode)
    with evaluating(model), torch.no_grad():
        # sampling's RoPE (comfy-kitchen's fused op on 0.33), which has no float64 kernel: a
        # float64 model (tests) is compared with the eager RoPE on both sides
        with comfy_training_mode(dtype == torch.float64):
            theirs = model(*args, transformer_options=theirs_options, **kwargs)
        with comfy_training_mode(True):
            try:
                ours = model(*args, transformer_options=dict(transformer_options), **kwargs)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:  # ComfyUI's own forward ran: the patches broke
                raise RuntimeError(
                    f"{_cannot_train()}: for this model ComfyUI's own {family.title} forward runs but "
                    f"the training path fails ({type(error).__name__}: {str(error).splitlines()[0]}), "
                    "so a ComfyUI update changed something the trainer relies on. Nothing was "
                    "trained. Please report it with your ComfyUI version."
                ) from error
    if ours.device.type == "meta":  # a device without values (device-discipline tests)
        return 0.0
    difference = relative_difference(ours, theirs)
    allowed = TOLERANCE.get(dtype, HALF_TOLERANCE)
    if not difference <= allowed:  # also NaN
        raise RuntimeError(
            f"{_cannot_train()}: for this model the training path and ComfyUI's own {family.title} "
            f"forward give different outputs (relative difference {difference:.1e}, allowed "
            f"{allowed:.0e}), so a ComfyUI update changed something the trainer relies on. "
            "Nothing was trained. Please report it with your ComfyUI version."
        )
    return difference


def check_training_backward(
    patcher, family, transformer_options: dict, dtype: torch.dtype, params, layout: str | None = None
) -> None:
    """Raise (before any step) if a backward through the training path (installed without
    checkpointing) trips autograd's in-place check."""
    from ..trainer_core.validation import evaluating
    from .trainable_blocks import comfy_training_mode

    model = patcher.model.diffusion_model
    args, kwargs = family.probe(model, patcher.load_device, dtype, layout)
    with evaluating(model), torch.enable_grad(), comfy_training_mode(True):  # eval: no dropout
        try:
            out = model(*args, transformer_options=dict(transformer_options), **kwargs)
            if out.device.type == "meta":  # no values to run a backward on
                return
            torch.autograd.grad(out.float().square().mean(), list(params), allow_unused=True)
        except RuntimeError as error:
            if "Inference tensors" in str(error):  # a weight made under inference mode reached autograd
                raise RuntimeError(
                    f"{_cannot_train()}: a weight ComfyUI hands a layer was made under inference mode "
                    "and autograd cannot keep it, so this ComfyUI loads weights in a way the trainer "
                    "does not know (dynamic VRAM?). Nothing was trained. Start ComfyUI with "
                    f"--disable-dynamic-vram, and please report it with your ComfyUI version. "
                    f"({str(error).splitlines()[0]})"
                ) from error
            if "modified by an inplace operation" not in str(error):
                raise
            raise RuntimeError(
                f"{_cannot_train()}: a step of its {family.title} forward modifies, in place, a tensor "
                "the backward needs, so gradients would be wrong (with gradient checkpointing, "
                "silently). Nothing was trained. "
                f"Please report it with your ComfyUI version. ({str(error).splitlines()[0]})"
            ) from error
