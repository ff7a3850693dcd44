"""make_autograd_safe_: a module made under torch.inference_mode (as every ComfyUI loader makes
its weights) cannot be trained, nor pass gradients through its frozen layers; after the swap
it can, with bit-equal values, the same flags, tied weights still tied and untouched tensors
still the same objects."""

from __future__ import annotations

import mmap
import warnings

import numpy
import pytest
import torch

from comfy_adapter.autograd_safe import make_autograd_safe_


def loaded_under_inference_mode() -> torch.nn.Sequential:
    torch.manual_seed(0)
    with torch.inference_mode():
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))


def sgd_step(module: torch.nn.Module) -> None:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()


def input_gradient(module: torch.nn.Module) -> torch.Tensor:
    """The frozen-base case of LoRA training: the gradient flows through frozen weights."""
    x = torch.randn(5, 4, requires_grad=True)
    module(x).sum().backward()
    return x.grad


def test_an_inference_mode_module_cannot_be_trained_without_the_swap():
    with pytest.raises(RuntimeError, match=r"(?i)inference tensor"):
        sgd_step(loaded_under_inference_mode())
    frozen = loaded_under_inference_mode().requires_grad_(False)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        input_gradient(frozen)


def test_after_the_swap_it_trains_and_passes_gradients():
    module = loaded_under_inference_mode()
    before = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    assert make_autograd_safe_(module) == 6  # 2 Linears and the LayerNorm: weight and bias each
    sgd_step(module)
    after = module.state_dict()
    assert all(not torch.equal(before[name], after[name]) for name in before)  # every parameter moved

    frozen = loaded_under_inference_mode().requires_grad_(False)
    make_autograd_safe_(frozen)
    assert input_gradient(frozen).shape == (5, 4)


def test_values_dtypes_and_flags_are_kept_bit_for_bit():
    with torch.inference_mode():
        module = torch.nn.Linear(8, 4, dtype=torch.bfloat16)
        module.register_buffer("table", torch.arange(6, dtype=torch.int64))
    module.bias.requires_grad_(False)
    before = {
        name: (t.clone(), t.dtype, t.requires_grad) for name, t in module.state_dict(keep_vars=True).items()
    }
    assert make_autograd_safe_(module) == 3
    for name, tensor in module.state_dict(keep_vars=True).items():
        value, dtype, requires_grad = before[name]
        assert not tensor.is_inference()
        assert torch.equal(tensor, value) and tensor.dtype == dtype and tensor.requires_grad == requires_grad
    assert isinstance(module.weight, torch.nn.Parameter) and isinstance(module.bias, torch.nn.Parameter)
    assert not isinstance(module.table, torch.nn.Parameter) and "table" in module._buffers


def test_tied_weights_stay_tied_and_normal_tensors_keep_their_identity():
    with torch.inference_mode():
        embed = torch.nn.Embedding(5, 3)
        unembed = torch.nn.Linear(3, 5, bias=False)
    unembed.weight = embed.weight  # one inference Parameter in two modules
    normal = torch.nn.Linear(3, 3)  # made outside inference mode: nothing to replace
    module = torch.nn.ModuleDict({"embed": embed, "unembed": unembed, "normal": normal})
    kept = dict(normal.named_parameters())
    assert make_autograd_safe_(module) == 1  # the shared tensor is copied once
    assert module.embed.weight is module.unembed.weight and not module.embed.weight.is_inference()
    assert all(getattr(normal, name) is parameter for name, parameter in kept.items())
    assert make_autograd_safe_(module) == 0  # nothing left to replace


def moved_after_an_inference_mode_load(convert) -> torch.nn.Sequential:
    """What the GPU showed (ARCHITECTURE.md, "ComfyUI facts": inference mode): weights created under inference
    mode (a loader in the executor), then converted by `Module._apply` outside it (the move to
    CUDA, a dtype change): `is_inference()` is False, and the version counter is missing."""
    module = loaded_under_inference_mode()
    convert(module)
    return module


CONVERSIONS = {
    "device-move": lambda module: module._apply(lambda t: t.clone()),  # .to("cuda") on the CPU
    "dtype": lambda module: module.to(torch.float64),
}


@pytest.mark.parametrize("convert", CONVERSIONS.values(), ids=CONVERSIONS.keys())
def test_half_inference_weights_fail_every_use_until_replaced(convert):
    module = moved_after_an_inference_mode_load(convert)
    dtype = module[0].weight.dtype
    assert not any(p.is_inference() for p in module.parameters())  # what a check by flag sees
    with pytest.raises(RuntimeError, match="Inference tensors do not track version counter"):
        _ = module[0].weight._version
    for context in (torch.no_grad(), torch.inference_mode()):  # not even inference works
        with context, pytest.raises(RuntimeError, match="do not track version counter"):
            module(torch.randn(2, 4, dtype=dtype))
    values = {name: t.data.clone() for name, t in module.state_dict(keep_vars=True).items()}
    assert make_autograd_safe_(module) == 6
    for name, tensor in module.state_dict(keep_vars=True).items():
        assert isinstance(tensor, torch.nn.Parameter) and tensor._version >= 0
        assert torch.equal(tensor, values[name]) and tensor.dtype == dtype
    x = torch.randn(5, 4, dtype=dtype, requires_grad=True)
    module(x).sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in module.parameters())


def test_weights_moved_inside_inference_mode_are_plain_inference_tensors():
    """The executor's own loads (inference mode on) leave tensors `is_inference()` finds; a
    safe module moved either way stays usable (ComfyUI later unloads it from any thread)."""
    module = loaded_under_inference_mode()
    with torch.inference_mode():
        module._apply(lambda t: t.clone())
    assert all(p.is_inference() for p in module.parameters())
    assert make_autograd_safe_(module) == 6
    module._apply(lambda t: t.clone())  # outside: made safe, it stays safe
    assert make_autograd_safe_(module) == 0
    input_gradient(module)


def read_only_mapping(tmp_path, values: torch.Tensor) -> mmap.mmap:
    """The bytes of `values` in a file, mapped read-only (ACCESS_READ: pages without write
    permission), as ComfyUI 0.33 maps a model file: a write into it is a segmentation fault."""
    path = tmp_path / "weights.bin"
    path.write_bytes(values.numpy().tobytes())
    with open(path, "rb") as handle:
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)


def test_shared_memory_makes_no_copy_and_keeps_the_tensors_attributes(tmp_path):
    """The frozen base of a LoRA under ComfyUI 0.33's dynamic VRAM: read-only memory-mapped
    inference weights. `share_memory=True` gives autograd-usable tensors over the same memory:
    no value is copied or written, and gradients still flow through the frozen layers.

    The pages are mapped without write permission, so a write through the shared copy (or by
    anything the swap runs) kills the test process with a segmentation fault: the test cannot
    pass if the shared copy writes. A copy instead of sharing fails the address checks."""
    torch.manual_seed(0)
    values = torch.randn(3, 4)
    mapping = read_only_mapping(tmp_path, values)
    with warnings.catch_warnings():  # torch warns that it cannot mark the tensor read-only
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        with torch.inference_mode():  # as the loader builds them: frombuffer over the mapped file
            mapped = torch.frombuffer(mapping, dtype=torch.float32).view(3, 4)
            module = torch.nn.Linear(4, 3, bias=False)
            module.weight = torch.nn.Parameter(mapped, requires_grad=False)
    file_address = numpy.frombuffer(mapping, dtype=numpy.uint8).ctypes.data
    assert mapped.data_ptr() == file_address  # the weight is the file's pages, not a copy
    module.weight._model_dtype = torch.bfloat16  # ComfyUI 0.33 tags weights it streams
    original = module.weight
    frozen = []
    assert make_autograd_safe_(module, frozen, share_memory=True) == 1
    shared = module.weight
    assert shared is not original and not shared.is_inference() and isinstance(shared, torch.nn.Parameter)
    assert shared.data_ptr() == file_address  # the same memory, still the file's: nothing copied
    assert torch.equal(shared, values) and shared._model_dtype == torch.bfloat16
    assert frozen == [(module._parameters, "weight", original, shared)]
    x = torch.randn(5, 4, requires_grad=True)
    module(x).sum().backward()
    assert torch.allclose(x.grad, values.sum(0).expand(5, 4))
    assert mapping[:] == values.numpy().tobytes()  # the file's bytes as written

    copied = loaded_under_inference_mode()  # the default still copies (free to train in place)
    pointers = [p.data_ptr() for p in copied.parameters()]
    make_autograd_safe_(copied)
    assert all(p.data_ptr() != q for p, q in zip(copied.parameters(), pointers, strict=True))


def test_without_storage_to_share_it_copies():
    from comfy_adapter.autograd_safe import shared_copy

    with torch.inference_mode():
        meta = torch.empty(2, 2, device="meta")
    assert shared_copy(meta) is None
