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

Either kind is replaced by a normal tensor: a copy, or (`share_memory`, for weights nothing
writes) a normal tensor over the same memory, which costs nothing and keeps a memory-mapped
model (ComfyUI 0.33's dynamic VRAM) in its file's pages.
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


def shared_copy(tensor: torch.Tensor) -> torch.Tensor | None:
    """A normal tensor (its own version counter) over the memory of `tensor`: no copy of the
    values. For a frozen weight that nothing writes, it is what autograd needs, at no cost: a
    memory-mapped file's weights (ComfyUI 0.33's dynamic VRAM) stay in the file's pages, a GPU
    weight is not doubled. A packed weight (ComfyUI's quantized tensor) is rebuilt around shared
    copies of its inner tensors, through the subclass's own flatten / unflatten. None where
    that is not possible (a packed tensor without flattening, a tensor without storage).
    Make it with inference mode off."""
    if is_packed(tensor):
        flatten = getattr(tensor, "__tensor_flatten__", None)
        if flatten is None:
            return None
        names, context = flatten()
        inner = {name: shared_copy(getattr(tensor, name)) for name in names}
        if any(value is None for value in inner.values()):
            return None
        return type(tensor).__tensor_unflatten__(inner, context, tensor.shape, tensor.stride())
    if tensor.device.type == "meta":
        return None
    try:
        shared = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return shared.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
    except (RuntimeError, NotImplementedError):
        return None


def make_autograd_safe_(
    module: torch.nn.Module, replaced_log: list | None = None, share_memory: bool = False
) -> int:
    """Replace the module's autograd-unsafe tensors (`autograd_unsafe`) by normal ones, in
    place; returns how many.

    Each unsafe parameter or buffer is swapped for a new tensor with the same name, value
    (bit-equal), dtype, device, `requires_grad` and Python attributes (ComfyUI tags weights,
    e.g. `_model_dtype`; a Parameter stays a Parameter), as ComfyUI's own weight patching
    swaps parameters; other workflows see bit-identical outputs. Safe tensors keep their
    identity, and a tensor shared by several modules (tied weights) is replaced by one new
    tensor, so they stay tied.

    `share_memory=False`: each new tensor is a copy (one tensor's copy at a time), free to be
    trained in place. `share_memory=True`, for a module whose tensors nothing writes while
    they are swapped (the frozen base of a LoRA): each new tensor shares the unsafe one's
    memory (`shared_copy`; a copy only where sharing is impossible), so no second copy of the
    model exists. Call it with inference mode off: a tensor made inside is again an inference
    tensor. With `replaced_log`, each swap is appended to it as (table, name, original, new)
    for `put_back_`."""
    replaced: dict[int, torch.Tensor] = {}
    for child in module.modules():
        for table in (child._parameters, child._buffers):
            for name, tensor in table.items():
                if tensor is None or not autograd_unsafe(tensor):
                    continue
                if id(tensor) not in replaced:  # tied weights stay tied
                    new = shared_copy(tensor) if share_memory else None
                    if new is None:
                        new = tensor.data.clone()  # .data: no view that shares the missing counter
                    if isinstance(tensor, torch.nn.Parameter):
                        new = torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
                    for key, value in vars(tensor).items():
                        if key not in vars(new):
                            setattr(new, key, value)
                    replaced[id(tensor)] = new
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
