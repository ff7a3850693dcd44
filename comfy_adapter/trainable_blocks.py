"""Training ComfyUI's own transformer blocks through its block patches: what every family's
blocks share. A family (`families/<family>/`) says which blocks, which of their norms read a
residual stream, and how its block is called; this module gives it the parts.

ComfyUI's blocks add their residuals in place (`img += ...`). A plain backward through them
fails ("modified by an inplace operation") and a checkpointed one can silently compute wrong
gradients (ARCHITECTURE.md, "ComfyUI facts"). The pack keeps no copy of their code (a copy broke
on ComfyUI 0.33); three things make the blocks themselves trainable:

1. **Norm pre-hooks** (`copy_norm_inputs`): every norm that reads a residual stream gets a copy
   of its input, so the block's later `+=` cannot change what the norm saved for backward.
   Autograd's own version check stays on: an in-place op a later ComfyUI adds to a tensor
   autograd saved raises instead of computing wrong gradients.
2. **A copy of the residual inputs**: the family's `TrainableBlock.__call__` hands its block
   copies of the streams it adds into, so a checkpoint recomputes from the inputs as they were.
3. **Bound at forward time**: the block module is the one the patch was made for, and the
   keyword arguments ComfyUI passes blocks in this call only (0.33 Flux: `modulation_dims_img` /
   `modulation_dims` for references at timestep 0; Qwen-Image: the text mask and
   `timestep_zero_index`) are read when the forward runs (`call_time_kwargs`, under the names
   the family gives). ComfyUI's `original_block` is a closure over its forward's loop
   variable, so calling it later (a checkpoint's recompute) would run another block.

Patches are registered per block with `ModelPatcher.set_model_patch_replace(fn, "dit", kind, i)`
on the training clone only; each block can run under non-reentrant `torch.utils.checkpoint`, so
only block inputs are kept between forward and backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.utils.checkpoint


@contextlib.contextmanager
def comfy_training_mode(on: bool = True):
    """`comfy.model_management.in_training` set to `on` inside, the previous value back after.

    ComfyUI 0.33 runs RoPE through comfy-kitchen's fused op unless this flag is True, and
    autograd cannot differentiate that op ("no autograd formula"); its own trainer sets the flag
    around its loop. Training keeps it on from the forward through the backward (a checkpoint
    recomputes RoPE); previews turn it off again. ComfyUI versions without the flag: no-op."""
    import comfy.model_management as mm

    if not hasattr(mm, "in_training"):
        yield
        return
    previous = mm.in_training
    mm.in_training = on
    try:
        yield
    finally:
        mm.in_training = previous


def _copy_of_input(module, args):
    return (args[0].clone(), *args[1:])


def copy_norm_inputs(blocks: Iterable[torch.nn.Module], norm_names: tuple[str, ...], title: str):
    """Register the norm pre-hooks on the norms `norm_names` of every block; returns a function
    that removes them (the MODEL is shared: call it when training ends). `title`: the family's,
    for the message when a ComfyUI release renamed them all."""
    handles = []
    for block in blocks:
        for name in norm_names:
            norm = getattr(block, name, None)
            if isinstance(norm, torch.nn.Module):
                handles.append(norm.register_forward_pre_hook(_copy_of_input))
    if not handles:
        raise RuntimeError(
            f"Kontext Trainer: this ComfyUI's {title} blocks have none of the norms "
            f"{', '.join(norm_names)}; training them is not supported with this ComfyUI version"
        )

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


def call_time_kwargs(
    extra: dict, merged: tuple[str, ...] = ("extra_kwargs",), named: tuple[str, ...] = ()
) -> dict:
    """The keyword arguments ComfyUI gives the block in this forward only (a copy), read from its
    `original_block` closure, as the family names them: `merged`, closure variables holding a
    dict of them (Flux's `extra_kwargs`); `named`, closure variables passed under their own names
    (Qwen-Image's `encoder_hidden_states_mask` and, 0.33, `timestep_zero_index`). A name the
    closure lacks (a ComfyUI version that passes none) is left out."""
    original = extra.get("original_block")
    code = getattr(original, "__code__", None)
    if code is None:
        return {}
    cells = dict(zip(code.co_freevars, original.__closure__ or (), strict=True))
    found = {}
    for name in merged:
        if name in cells:
            found.update(cells[name].cell_contents)
    for name in named:
        if name in cells:
            found[name] = cells[name].cell_contents
    return found


class TrainableBlock:
    """A `patches_replace["dit"][(kind, i)]` entry running ComfyUI's block `block` (the family's
    subclass says how it is called). Calls the block swapper (if any) around the block's
    forward, inside the checkpointed function, so the recompute in backward is scheduled too.
    `index`: the block's place in the family's execution order (`ModelFamily.blocks`)."""

    def __init__(self, block, checkpointing: bool, index: int, swapper=None):
        self.block, self.checkpointing, self.index, self.swapper = block, checkpointing, index, swapper

    def run(self, function: Callable, *args):
        """`function(*args)` around the swapper, checkpointed when asked and grad is on."""

        def forward(*inputs):
            if self.swapper is None:
                return function(*inputs)
            self.swapper.before(self.index)
            try:
                return function(*inputs)
            finally:
                self.swapper.after(self.index)

        if self.checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False)
        return forward(*args)

    def __call__(self, args: dict, extra: dict) -> dict:
        raise NotImplementedError


def install_block_patches(patcher, blocks: Iterable[tuple[str, int, TrainableBlock]]) -> None:
    """Register each `(kind, i, replacement)` as the clone's `patches_replace["dit"][(kind, i)]`
    (in its model_options only: the MODEL the user holds is not touched)."""
    for kind, i, replacement in blocks:
        patcher.set_model_patch_replace(replacement, "dit", kind, i)


def without_trainable_blocks(options: dict) -> dict:
    """`options` without our block patches: the forward as a sampler runs it (the guard)."""
    replace = dict(options.get("patches_replace", {}))
    replace["dit"] = {k: v for k, v in replace.get("dit", {}).items() if not isinstance(v, TrainableBlock)}
    return {**options, "patches_replace": replace}
