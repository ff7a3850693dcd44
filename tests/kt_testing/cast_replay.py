"""ComfyUI 0.33's reused cast memory, on the CPU (issue 29; ARCHITECTURE.md, "ComfyUI facts": cast memory).

On NVIDIA, ComfyUI 0.33 hands a layer whose cast changes no dtype and runs no weight function
a view of memory it reuses: under dynamic VRAM (its default) a vbar page or an aimdo cast
buffer, refilled for a later layer through a *new tensor over the raw pointer* (no version
counter moves); without dynamic VRAM and with cudaMallocAsync off, offloaded layers get views
of the per-stream `STREAM_CAST_BUFFERS` (views of one base tensor: a refill bumps the version).
`ModelPatcherDynamic` marks every comfy-cast module over 16 KiB to cast per forward. A CPU run
sees none of this (`--cpu` turns dynamic VRAM off, and 0.33's CPU branch of `cast_bias_weight`
clones). `replay(kind)` makes a CPU process do it:

- after every `ModelPatcher.load` (ComfyUI's `ON_LOAD` callback on every patcher made from
  then on), each ComfyUI Linear (plain or quantized) whose stored weight is over 16 KiB gets
  `comfy_cast_weights = True`, as dynamic VRAM marks it (`every_module`: every cast op with a
  weight, norms included, of any size, as a partial load offloads what did not fit);
- `comfy.ops.cast_bias_weight` (which every ComfyUI Linear calls through the module) hands
  such a layer, when the cast returned the stored weight itself (no dtype change, no weight
  function), a copy of it in ONE shared buffer instead (a quantized weight: its packed values
  there, rebuilt as a quantized weight): `"dynamic"` fills the buffer through a
  fresh tensor and returns a fresh tensor over it (each with its own version counter, aimdo's
  way: the next cast overwrites the memory and nothing notices); `"stream"` returns a view of
  one base tensor filled with `copy_` (the version bumps, as with the stream buffers).

`REPLAYED` counts, so a test shows the replay engaged and on which weights: `"casts"` handed out
that way (`"quantized_casts"` of them quantized weights), layers `"marked"` (`"quantized_marked"`),
and `"fresh_casts"` of marked layers left as ComfyUI made them (a dtype-converting cast, e.g.
0.3.75's dequantizing cast of a quantized weight, or a weight function: fresh memory on a GPU too,
so not replayed).
`CAST_REPLAY_ENV` (`KT_TEST_CAST_REPLAY=dynamic|stream`) turns it on in a test server (the test
node pack calls `replay`).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

CAST_REPLAY_ENV = "KT_TEST_CAST_REPLAY"
DYNAMIC_MODULE_BYTES = 16 * 1024  # ModelPatcherDynamic streams modules over 16 KiB
REPLAYED = {"casts": 0, "marked": 0, "quantized_casts": 0, "quantized_marked": 0, "fresh_casts": 0}
REPLAY_MARK = "kt test: cast memory reused"  # logged once per process, at the first replayed cast
_KEY = "kt_test_cast_replay"


class ReusedMemory:
    """One buffer every replayed cast is copied into. A cast larger than the buffer (a model
    loaded later) replaces it with a larger one: tensors handed out before keep the old memory,
    every later cast shares the new one."""

    def __init__(self, kind: str, every_module: bool = False):
        if kind not in ("dynamic", "stream"):
            raise ValueError(f"unknown cast replay {kind!r}: dynamic or stream")
        self.kind, self.base, self.every_module = kind, None, every_module

    def reserve(self, nbytes: int) -> None:
        if self.base is None or self.base.numel() < nbytes:
            # a normal tensor (loads run under inference mode): its views track versions
            with torch.inference_mode(False):
                self.base = torch.empty(nbytes, dtype=torch.uint8)

    def hand_out(self, weight: torch.Tensor) -> torch.Tensor:
        self.reserve(weight.numel() * weight.element_size())
        nbytes = weight.numel() * weight.element_size()
        if self.kind == "stream":  # views of one base tensor: the fill bumps every view's version
            view = self.base[:nbytes].view(weight.dtype).view(weight.shape)
            view.copy_(weight.detach())
            return view
        storage = self.base.untyped_storage()

        def over_memory():  # a new tensor over the raw memory, with a version counter of its own
            return torch.empty(0, dtype=weight.dtype).set_(storage, 0, weight.shape)

        over_memory().copy_(weight.detach())
        return over_memory()


def _stored(weight: torch.Tensor) -> torch.Tensor:
    """The tensor holding a weight's bytes: a quantized weight's packed values, or itself."""
    return getattr(weight, "_qdata", weight)


def _mark_dynamic(memory: ReusedMemory, patcher, *args) -> None:
    for module in patcher.model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "comfy_cast_weights") or not isinstance(weight, torch.Tensor):
            continue  # not a ComfyUI cast op
        if not (memory.every_module or hasattr(module, "in_features")):
            continue  # Linears only (plain and quantized)
        stored = _stored(weight)
        nbytes = stored.numel() * stored.element_size()
        if nbytes > DYNAMIC_MODULE_BYTES or memory.every_module:
            module.comfy_cast_weights = True
            module.kt_cast_replayed = True
            memory.reserve(nbytes)
            REPLAYED["marked"] += 1
            REPLAYED["quantized_marked"] += stored is not weight


def _in_reused_memory(memory: ReusedMemory, weight: torch.Tensor) -> torch.Tensor:
    """`weight` with its stored bytes in the reused buffer: a plain tensor directly; a quantized
    weight rebuilt around packed values there (its scales as they are)."""
    if not hasattr(weight, "_qdata"):
        return memory.hand_out(weight)
    values = memory.hand_out(weight._qdata)
    if hasattr(weight, "_layout_cls"):  # comfy-kitchen (ComfyUI 0.33)
        return type(weight)(values, weight._layout_cls, weight._params)
    return type(weight)(values, weight._layout_type, weight._layout_params)  # ComfyUI 0.3.75


def _replaying(original, memory: ReusedMemory):
    @functools.wraps(original)
    def cast_bias_weight(s, *args, **kwargs):
        result = original(s, *args, **kwargs)
        weight = result[0]
        if not getattr(s, "kt_cast_replayed", False):
            return result
        if weight is not s.weight:  # converted or patched: fresh memory on a GPU as well
            REPLAYED["fresh_casts"] += 1
            return result
        if REPLAYED["casts"] == 0:
            logging.getLogger(__name__).warning("%s (%s)", REPLAY_MARK, memory.kind)
        REPLAYED["casts"] += 1
        REPLAYED["quantized_casts"] += hasattr(weight, "_qdata")
        return (_in_reused_memory(memory, weight), *result[1:])

    cast_bias_weight._kt_cast_replay = True
    return cast_bias_weight


@contextlib.contextmanager
def replay(kind: str = "dynamic", every_module: bool = False):
    """Replay the reused cast memory (`kind` "dynamic" or "stream") inside the block: every
    ModelPatcher made, and every layer cast, from now until the block ends. `every_module`:
    every ComfyUI cast op with a weight, of any size (its norms too), is marked, as a partial
    load on 0.33 with cudaMallocAsync off offloads the layers that did not fit, small ones
    included, and casts each into its stream's shared buffer."""
    import comfy.model_patcher
    import comfy.ops
    from comfy.patcher_extension import CallbacksMP

    memory = ReusedMemory(kind, every_module)
    mark = functools.partial(_mark_dynamic, memory)
    cls = comfy.model_patcher.ModelPatcher
    original_init, original_cast = cls.__init__, comfy.ops.cast_bias_weight

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.add_callback_with_key(CallbacksMP.ON_LOAD, _KEY, mark)

    cls.__init__ = __init__
    comfy.ops.cast_bias_weight = _replaying(original_cast, memory)
    try:
        yield memory
    finally:
        cls.__init__, comfy.ops.cast_bias_weight = original_init, original_cast


def replay_for_patcher(patcher, memory: ReusedMemory) -> None:
    """Also replay on a patcher made before `replay` began (a tiny test model)."""
    from comfy.patcher_extension import CallbacksMP

    patcher.add_callback_with_key(CallbacksMP.ON_LOAD, _KEY, functools.partial(_mark_dynamic, memory))
