"""Making a module's inference tensors usable by autograd.

ComfyUI runs every node under `torch.inference_mode()`, so the weights a stock loader creates
are inference tensors, which autograd refuses to use (even frozen ones: a Linear saves its
weight to compute the input's gradient, and inference tensors keep no version counter).

A second kind looks normal and is not: a Parameter created under inference mode whose `.data`
was later swapped outside it (`Module._apply`, which is how a model moves to the GPU or
changes dtype) says `is_inference() == False`, yet it has no version counter, and every op
that makes a view of it (F.linear transposes its weight) raises "Inference tensors do not
track version counter", with or without grad or inference mode. So a tensor is judged by
what autograd needs: reading its version counter.
"""

from __future__ import annotations

import torch


def autograd_unsafe(tensor: torch.Tensor) -> bool:
    """True when autograd cannot record an op on `tensor`: an inference tensor, or one whose
    version counter cannot be read (see the module docstring)."""
    if tensor.is_inference():
        return True
    try:
        _ = tensor._version
    except RuntimeError:
        return True
    return False


def make_autograd_safe_(module: torch.nn.Module, replaced_log: list | None = None) -> int:
    """Replace the module's autograd-unsafe tensors (`autograd_unsafe`) by normal copies, in
    place; returns how many.

    Each unsafe parameter or buffer is swapped for a new tensor with the same name, value
    (bit-equal), dtype, device and `requires_grad` (a Parameter stays a Parameter), as
    ComfyUI's own weight patching swaps parameters; other workflows see bit-identical
    outputs. Safe tensors keep their identity, and a tensor shared by several modules (tied
    weights) is replaced by one copy, so they stay tied. Costs one
    tensor's copy at a time. Call it with inference mode off: a copy made inside is again an
    inference tensor. With `replaced_log`, each swap is appended to it as (table, name,
    original, copy) for `put_back_`."""
    replaced: dict[int, torch.Tensor] = {}
    for child in module.modules():
        for table in (child._parameters, child._buffers):
            for name, tensor in table.items():
                if tensor is None or not autograd_unsafe(tensor):
                    continue
                if id(tensor) not in replaced:  # tied weights stay tied
                    copy = tensor.data.clone()  # .data: no view that shares the missing counter
                    if isinstance(tensor, torch.nn.Parameter):
                        copy = torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
                    replaced[id(tensor)] = copy
                table[name] = replaced[id(tensor)]
                if replaced_log is not None:
                    replaced_log.append((table, name, tensor, replaced[id(tensor)]))
    return len(replaced)


def is_packed(tensor: torch.Tensor) -> bool:
    """A tensor subclass holding packed values (e.g. a quantized weight), not a plain tensor."""
    return type(tensor) not in (torch.Tensor, torch.nn.Parameter)


def put_back_(replaced_log: list, which=is_packed) -> int:
    """Put the originals of `make_autograd_safe_`'s swaps that `which` selects back, where the
    slot still holds the copy (a slot someone has set since keeps its new tensor); returns how
    many. Packed weights go back as they were loaded: ComfyUI 0.3.75 cannot take the state dict
    of a quantized weight under inference mode once it is a normal tensor."""
    count = 0
    for table, name, original, copy in reversed(replaced_log):
        if which(original) and table.get(name) is copy:
            table[name] = original
            count += 1
    replaced_log.clear()
    return count
