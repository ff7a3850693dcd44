"""What a CUDA load does to the weights, on the CPU (ARCHITECTURE.md, "ComfyUI facts": inference mode).

On a GPU, ComfyUI loads a model with `module.to("cuda")` and unloads it with
`module.to("cpu")`: `Module._apply` swaps every parameter's and buffer's `.data` for a new
tensor, made in the inference mode of the thread that asked for the load. A Parameter that a
loader node created in the executor (under `torch.inference_mode()`) whose `.data` was last
swapped *outside* inference mode is half an inference tensor: `is_inference()` says False, yet
reading its version counter raises "Inference tensors do not track version counter", and so
does every op on it (F.linear, also under `torch.no_grad()` or `inference_mode`). On the CPU
nothing moves, so nothing of this happens unless a test makes it happen:

- `emulate_device_moves(patcher)`: ComfyUI's own load and unload callbacks
  (`CallbacksMP.ON_LOAD` after every `ModelPatcher.load`, `ON_DETACH` after every unload that
  moves the weights to the offload device) on
  `patcher` and its clones swap every tensor's `.data` for a copy, in the caller's inference
  mode, as the device move would. A conversion always made outside inference mode would be
  stricter than a GPU: it would also break ComfyUI's own CLIPTextEncode in the executor (its
  Linear layers), which works on every GPU because the executor loads under inference mode.
- `emulate_everywhere()`: the same for every ModelPatcher made from then on (each MODEL, VAE
  and CLIP a loader builds); the test node pack calls it in a server started with
  `KT_TEST_DEVICE_MOVES=1` (`DEVICE_MOVES_ENV`).
"""

from __future__ import annotations

import functools
import logging

DEVICE_MOVES_ENV = "KT_TEST_DEVICE_MOVES"
UNLOAD_MARK = "kt test: moved off the device"  # logged at every emulated unload
_KEY = "kt_test_device_moves"


def move_like_a_device(module) -> None:
    """`module.to(other_device)` as it affects autograd: each tensor's `.data` becomes a new
    tensor, made in the current inference mode."""
    module._apply(lambda tensor: tensor.clone())


def _after_load(patcher, *args) -> None:
    move_like_a_device(patcher.model)


def _after_detach(patcher, unpatch_all: bool) -> None:
    if unpatch_all:  # `detach` moves the weights to the offload device only then
        move_like_a_device(patcher.model)
        logging.getLogger(__name__).info("%s: %s", UNLOAD_MARK, type(patcher.model).__name__)


def emulate_device_moves(patcher):
    """Register the emulation on `patcher` (clones inherit it); returns `patcher`."""
    from comfy.patcher_extension import CallbacksMP

    if not patcher.get_callbacks(CallbacksMP.ON_LOAD, _KEY):
        patcher.add_callback_with_key(CallbacksMP.ON_LOAD, _KEY, _after_load)
        patcher.add_callback_with_key(CallbacksMP.ON_DETACH, _KEY, _after_detach)
    return patcher


def emulate_everywhere() -> None:
    """Every ModelPatcher made from now on in this process gets `emulate_device_moves`."""
    import comfy.model_patcher

    cls = comfy.model_patcher.ModelPatcher
    if getattr(cls.__init__, "_kt_device_moves", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        emulate_device_moves(self)

    __init__._kt_device_moves = True
    cls.__init__ = __init__
