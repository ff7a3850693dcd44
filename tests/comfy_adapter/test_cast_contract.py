"""Training never keeps a weight ComfyUI's cast handed a layer (comfy_adapter/cast_contract.py), under
the CPU replay of ComfyUI 0.33's reused cast memory (kt_testing/cast_replay.py).

Each test first shows the replay engaged (casts counted) and that a step which lets autograd
keep the cast (the mechanism taken out, as on 70adb75) fails with the named symptom: wrong
gradients with no error under dynamic VRAM's buffers, "modified by an inplace operation" under
the shared stream buffers. With the mechanism, the gradients equal the plain run's (no replay)
bit for bit, with and without block checkpointing: that equality is the check that the backward
read no reused cast (a `saved_tensors_hooks` alias check cannot see inside a checkpoint, see
`test_dynamic_vram_buffers_break_a_step_that_keeps_casts_and_not_ours`)."""

from __future__ import annotations

import contextlib
import functools
import importlib

import pytest
import torch
import torch.utils.checkpoint

from kt_testing import cast_replay
from kt_testing.contract import contract_as
from kt_testing.gradients import randomise_lora
from kt_testing.probes import tiny_samples
from kt_testing.tiny_models import (
    TINY_QWEN_IMAGE_CONFIG,
    fp8_flux_patcher,
    tiny_flux_patcher,
    tiny_qwen_image_patcher,
)


@pytest.fixture(scope="module")
def ft(pack_import):
    return pack_import("comfy_adapter.lora_session")


def step(
    ft,
    samples,
    checkpointing: bool,
    replay: str | None = None,
    keep_casts: bool = False,
    make_model=None,
    every_module: bool = False,
):
    """(loss, LoRA gradients, saved tensors that alias the replay buffer) of one step on a
    tiny Flux (or `make_model()`); `keep_casts`: without the cast contract (70adb75's behaviour).
    The aliases are those autograd saved outside any checkpoint: inside one, checkpoint's own
    hooks replace ours."""
    config = ft.TrainConfig(rank=2, alpha=2.0, targets="attention", gradient_checkpointing=checkpointing)
    model = make_model() if make_model else tiny_flux_patcher(seed=6)
    aliases = []
    kept = contract_as(ft, None) if keep_casts else contextlib.nullcontext()
    with torch.inference_mode(False), contextlib_replay(replay, every_module) as memory, kept:
        if memory is not None:
            cast_replay.replay_for_patcher(model, memory)
        with ft.lora_session(model, config) as session:
            randomise_lora(session, seed=3)

            def pack_saved(tensor):
                stored = getattr(tensor, "_qdata", tensor)  # a quantized weight's packed values
                if memory is not None and stored.untyped_storage().data_ptr() == memory.base.data_ptr():
                    aliases.append(tuple(tensor.shape))
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack_saved, lambda t: t):
                loss = session.loss(samples, torch.Generator().manual_seed(11))
            grads = torch.autograd.grad(loss, session.lora.parameters())
    return loss.detach(), grads, aliases


def contextlib_replay(kind, every_module: bool = False):
    return cast_replay.replay(kind, every_module) if kind else contextlib.nullcontext()


@pytest.fixture(scope="module")
def samples(pack_import):
    return tiny_samples(pack_import("trainer_core.flow_step").Sample, 2, 4, [(8, 6)])


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_dynamic_vram_buffers_break_a_step_that_keeps_casts_and_not_ours(ft, samples, checkpointing):
    """Kept casts alias the reused buffer (seen without block checkpointing) and give wrong
    gradients; ours give the plain run's gradients bit for bit. No alias check on our step: each
    casting layer runs under its own checkpoint, whose hooks replace `step`'s pack hook, so that
    hook never sees what the layer saves and "no aliases" held whatever the backward read. The
    recompute itself saves the cast (a Linear whose input needs a gradient saves its weight) and
    uses it at once, so an alias check inside the recompute would not state the contract either;
    what the backward read is what the bit-equal gradients check, and the kept-casts run shows
    they differ when it is wrong."""
    reference_loss, reference, _ = step(ft, samples, checkpointing)
    before = cast_replay.REPLAYED["casts"]
    loss, kept, aliases = step(ft, samples, checkpointing, replay="dynamic", keep_casts=True)
    assert cast_replay.REPLAYED["casts"] > before  # the replay engaged
    assert torch.equal(loss, reference_loss)  # the forward reads each cast at once: right
    if not checkpointing:
        assert aliases  # autograd kept views of the reused buffer...
    wrong = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(kept, reference, strict=True))
    print(f"\nkept casts: worst relative gradient error {wrong:.2e}")
    assert wrong > 1e-2  # ...and the backward read another layer's weight, with no error

    loss, ours, _ = step(ft, samples, checkpointing, replay="dynamic")
    assert torch.equal(loss, reference_loss)
    assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))


def test_stream_buffers_fail_loudly_without_the_contract_and_train_with_it(ft, samples):
    """The shared stream buffers (views of one base tensor): a refill bumps the version, so
    autograd's check (run by the guard's backward, before any step) names it. With the contract:
    the plain run's gradients bit for bit (why no alias check: see the dynamic VRAM test)."""
    _, reference, _ = step(ft, samples, checkpointing=True)
    with pytest.raises(RuntimeError, match="modifies, in place, a tensor the backward needs"):
        step(ft, samples, checkpointing=True, replay="stream", keep_casts=True)
    _, ours, _ = step(ft, samples, checkpointing=True, replay="stream")
    assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))


def test_the_contract_is_taken_off_when_training_ends(ft, samples):
    model = tiny_flux_patcher(seed=6)
    config = ft.TrainConfig(rank=2, alpha=2.0, targets="attention")
    with torch.inference_mode(False), cast_replay.replay("dynamic") as memory:
        cast_replay.replay_for_patcher(model, memory)
        with ft.lora_session(model, config) as session:
            layer = session.diffusion_model.double_blocks[0].img_mlp[0]
            assert "forward" in vars(layer)  # the re-cast sits on frozen Linears too
    assert "forward" not in vars(model.model.diffusion_model.double_blocks[0].img_mlp[0])


def fp8_weights():
    return fp8_flux_patcher(seed=6)


def contract_of(ft, make_model, checkpointing: bool, replay: str | None = None):
    """(the session's plan, {layer name: "recast" / "recompute"} of the wrapped Linears)."""
    model = make_model()
    config = ft.TrainConfig(rank=2, alpha=2.0, targets="attention", gradient_checkpointing=checkpointing)
    with torch.inference_mode(False), contextlib_replay(replay) as memory:
        if memory is not None:
            cast_replay.replay_for_patcher(model, memory)
        with ft.lora_session(model, config) as session:
            wrapped = {
                name.removesuffix(".base_layer"): "recast" if vars(m)["forward"].by_recast else "recompute"
                for name, m in session.diffusion_model.named_modules()
                if type(vars(m).get("forward")).__name__ == "RecastInBackward"
            }
            return session.contract, wrapped


def comfy_flux_norms_cast() -> bool:
    """FLUX's QKNorm is ComfyUI's RMSNorm op (0.33), not Flux's own norm module (0.3.75)."""
    norm = tiny_flux_patcher(seed=6).model.diffusion_model.double_blocks[0].img_attn.norm.query_norm
    return hasattr(norm, "comfy_cast_weights")


def casting_linear_names(model) -> set:
    return {
        name
        for name, m in model.model.diffusion_model.named_modules()
        if getattr(m, "comfy_cast_weights", False) and isinstance(m, torch.nn.Linear)
    }


def test_the_contract_is_decided_once_per_run_from_what_the_casts_do(ft):
    """Issue 41, item 2. On the CPU ComfyUI runs neither dynamic VRAM nor stream cast buffers,
    so the plan measures the casts: fp8 weights cast (a dtype change) into fresh memory, and
    with block checkpointing nothing is wrapped (autograd keeps fresh casts; the checkpoint
    drops them); without it, every casting Linear takes the re-cast (memory). A model that casts
    nothing: off. The dynamic VRAM replay hands every cast the same memory: measured, on, and
    every casting Linear wrapped; the log line says which and why."""
    plan, wrapped = contract_of(ft, tiny_flux_patcher, checkpointing=True)
    print(f"\nplain: {plan.describe()}")
    assert plan.reuse is None and not wrapped
    assert plan.describe().startswith("cast contract off: no Linear casts its weight")
    plan, _ = contract_of(ft, tiny_flux_patcher, checkpointing=False)
    assert plan.describe().startswith("cast contract off: no Linear casts its weight")

    casting = casting_linear_names(fp8_weights())
    assert casting  # fp8 weights: every Linear casts to the compute dtype
    plan, wrapped = contract_of(ft, fp8_weights, checkpointing=True)
    print(f"fp8 weights, checkpointed: {plan.describe()}")
    assert plan.reuse is None and not wrapped
    assert "measured: 8 casts held side by side, none sharing memory" in plan.describe()
    plan, wrapped = contract_of(ft, fp8_weights, checkpointing=False)
    print(f"fp8 weights, not checkpointed: {plan.describe()}")
    assert plan.describe().startswith("cast contract in part")
    assert "block checkpointing is off" in plan.describe()
    assert wrapped == dict.fromkeys(casting, "recast")

    plan, wrapped = contract_of(ft, tiny_flux_patcher, checkpointing=True, replay="dynamic")
    print(f"dynamic VRAM replay: {plan.describe()}")
    assert plan.describe().startswith("cast contract on: measured: 7 of 8 casts held side by side")
    replayed = {
        name
        for name, m in tiny_flux_patcher(seed=6).model.diffusion_model.named_modules()
        if isinstance(m, torch.nn.Linear) and m.weight.nbytes > cast_replay.DYNAMIC_MODULE_BYTES
    }
    norms = {name: way for name, way in wrapped.items() if name.endswith(("query_norm", "key_norm"))}
    linears = {name: way for name, way in wrapped.items() if name not in norms}
    assert replayed and set(linears) >= replayed and set(linears.values()) == {"recast"}
    # 0.33: QKNorm is ComfyUI's RMSNorm op, recomputed (0.3.75's own norm is no cast op)
    assert set(norms.values()) <= {"recompute"} and bool(norms) == comfy_flux_norms_cast()


def test_comfyuis_own_state_says_where_casts_are_reused(pack, monkeypatch):
    """Where ComfyUI reuses cast memory by design (ARCHITECTURE.md, "ComfyUI facts"), read from
    its own state as a GPU process sets it: dynamic VRAM (`aimdo_enabled`, 0.33); without it,
    0.33's per-stream cast buffers when offload streams are on and cudaMallocAsync is off;
    0.3.75 has neither."""
    import comfy.model_management as mm
    from comfy.cli_args import args

    cast_contract = importlib.import_module(f"{pack.__name__}.comfy_adapter.cast_contract")
    assert cast_contract.reuse_by_design()[0] is None  # a CPU process
    if not hasattr(mm, "get_cast_buffer"):
        assert cast_contract.reuse_by_design() == (None, "this ComfyUI has no cast buffers")
        return
    import comfy.memory_management

    monkeypatch.setattr(mm, "NUM_STREAMS", 2)  # ComfyUI's default on NVIDIA
    monkeypatch.setattr(args, "cuda_malloc", True)
    assert cast_contract.reuse_by_design()[0] is None
    monkeypatch.setattr(args, "cuda_malloc", False)
    assert "per-stream cast buffers" in cast_contract.reuse_by_design()[0]
    monkeypatch.setattr(args, "cuda_malloc", True)
    monkeypatch.setattr(comfy.memory_management, "aimdo_enabled", True)
    assert "dynamic VRAM" in cast_contract.reuse_by_design()[0]


def in_place_block(layer):
    """A block that changes a casting Linear's input in place after the Linear read it."""

    def block(x):
        hidden = x * 2
        out = layer(hidden)
        hidden.add_(1)  # a later in-place step on the layer's input
        return out * hidden  # saves `hidden`: the block's recompute runs the step again

    return block


def casting_linear(op: str):
    import comfy.ops

    layer = getattr(comfy.ops, op).Linear(4, 4)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.zeros_(layer.bias)
    layer.comfy_cast_weights = True  # it casts per call: the contract applies
    return layer


@pytest.mark.parametrize("block_checkpointed", [False, True], ids=["plain", "in_a_checkpointed_block"])
def test_an_in_place_change_to_a_linear_input_is_caught_at_the_recompute(pack, block_checkpointed):
    """An in-place step on a recomputed layer's input between its forward and its backward is
    reported in autograd's words. The layer: ComfyUI's `fp8_ops` Linear, whose forward is not
    the plain cast (it tries an fp8 matmul first), so it takes the per-layer recompute. Plain,
    PyTorch catches it itself (the layer's checkpoint saves its inputs for the backward, and
    autograd version-checks them). In a block under gradient checkpointing (`TrainableBlock.run`'s
    non-reentrant checkpoint), the layer's checkpoint nests in the block's, whose hooks pack
    everything saved, so autograd checks no version: the recompute's own check is the only one
    (without it, the gradient comes out wrong with no error), and the message is its own."""
    cast_contract = importlib.import_module(f"{pack.__name__}.comfy_adapter.cast_contract")
    layer = casting_linear("fp8_ops")
    block = in_place_block(layer)
    remove = cast_contract.recast_in_backward(torch.nn.Sequential(layer))
    try:
        assert not vars(layer)["forward"].by_recast
        x = torch.randn(2, 4, requires_grad=True)
        if block_checkpointed:
            out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            words = "modified by an inplace operation: the input of a Linear changed"
        else:
            out, words = block(x), "modified by an inplace operation"
        with pytest.raises(RuntimeError, match=words):
            out.sum().backward()
    finally:
        remove()
    assert "forward" not in vars(layer)


@pytest.mark.parametrize("block_checkpointed", [False, True], ids=["plain", "in_a_checkpointed_block"])
def test_a_re_cast_reads_no_input_so_an_in_place_change_leaves_its_gradient_exact(pack, block_checkpointed):
    """ComfyUI's plain cast Linear (`manual_cast`) takes the re-cast: its backward needs the
    cast weight and the output's gradient, not the input, so the same in-place step changes
    nothing. The gradient equals that of the same block without the in-place step, written
    out of place on a plain torch Linear (autograd's own linear backward), bit for bit, and the
    backward cast the weight once."""
    cast_contract = importlib.import_module(f"{pack.__name__}.comfy_adapter.cast_contract")
    layer = casting_linear("manual_cast")
    reference_layer = torch.nn.Linear(4, 4)
    reference_layer.load_state_dict(layer.state_dict())
    x = torch.randn(2, 4)

    def reference_block(x):
        hidden = x * 2
        return reference_layer(hidden) * (hidden + 1)

    expected = x.clone().requires_grad_()
    reference_block(expected).sum().backward()
    block = in_place_block(layer)
    remove = cast_contract.recast_in_backward(torch.nn.Sequential(layer))
    try:
        wrapper = vars(layer)["forward"]
        assert wrapper.by_recast
        ours = x.clone().requires_grad_()
        if block_checkpointed:
            out = torch.utils.checkpoint.checkpoint(block, ours, use_reentrant=False)
        else:
            out = block(ours)
        out.sum().backward()
        assert wrapper.recasts == 1
    finally:
        remove()
    assert torch.equal(ours.grad, expected.grad)


def quantized_tiny_flux():
    from kt_testing.quantized_files import quantized_flux_patcher

    return quantized_flux_patcher(seed=6)


def test_a_quantized_models_reused_casts_break_a_step_that_keeps_them_and_not_ours(ft, samples):
    """Dynamic VRAM's buffers holding ComfyUI's quantized weights (what an fp8 file's layers
    cast to under dynamic VRAM): the same failure without the contract, the same exact
    gradients with it (why no alias check: see the dynamic VRAM test). ComfyUI 0.33 only:
    0.3.75 casts a quantized weight by dequantizing it, always into fresh memory (and has no
    dynamic VRAM)."""
    import comfy.utils

    if not hasattr(comfy.utils, "convert_old_quants"):
        pytest.skip("ComfyUI 0.3.75 dequantizes every quantized cast into fresh memory")
    reference_loss, reference, _ = step(ft, samples, False, make_model=quantized_tiny_flux)
    before = cast_replay.REPLAYED["casts"]
    loss, kept, aliases = step(ft, samples, False, "dynamic", keep_casts=True, make_model=quantized_tiny_flux)
    assert cast_replay.REPLAYED["casts"] > before and aliases  # engaged, and autograd kept casts
    wrong = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(kept, reference, strict=True))
    print(f"\nkept quantized casts: worst relative gradient error {wrong:.2e}")
    assert not wrong <= 1e-2  # wrong, or NaN (TrainLoRA's "the gradient norm became nan")
    loss, ours, _ = step(ft, samples, False, "dynamic", make_model=quantized_tiny_flux)
    assert torch.equal(loss, reference_loss)
    assert all(torch.equal(a, b) for a, b in zip(ours, reference, strict=True))


def test_a_resident_cast_view_cached_by_sampling_is_owned_without_a_copy(pack, monkeypatch):
    """ComfyUI 0.33's dynamic VRAM hands a layer whose weights are still resident in its vbar
    pages the views it cached at its last cast (`_v_weight`, `_v_bias`). Cached by sampling,
    under inference mode, they are inference tensors: autograd refuses to save them ("Inference
    tensors cannot be saved for backward"). The cast here returns the cached views as that
    branch does (a CPU has no vbar); training replaces them by normal tensors over the same
    memory and gets the exact gradient."""
    import comfy.ops

    cast_contract = importlib.import_module(f"{pack.__name__}.comfy_adapter.cast_contract")
    cast = comfy.ops.cast_bias_weight

    def resident_cast(s, *args, **kwargs):
        if not hasattr(s, "_v_weight"):
            return cast(s, *args, **kwargs)
        return s._v_weight, s._v_bias, None  # nothing to uncast

    monkeypatch.setattr(comfy.ops, "cast_bias_weight", resident_cast)
    layer = comfy.ops.manual_cast.Linear(4, 3)
    torch.nn.init.normal_(layer.weight)
    layer.comfy_cast_weights = True
    with torch.inference_mode():  # sampling's cast, cached
        layer._v_weight, layer._v_bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    cached = layer._v_weight
    remove = cast_contract.recast_in_backward(torch.nn.Sequential(layer))
    try:
        x = torch.randn(2, 4, requires_grad=True)
        layer(x).sum().backward()
    finally:
        remove()
    assert not layer._v_weight.is_inference() and layer._v_weight.data_ptr() == cached.data_ptr()
    assert torch.allclose(x.grad, cached.sum(0).expand(2, 4))


def qwen_samples(Sample):
    """Two Qwen-Image-Edit samples: Wan 2.1's 5-D latents, a 5-token caption, one reference."""
    gen = torch.Generator().manual_seed(4)
    width = TINY_QWEN_IMAGE_CONFIG["joint_attention_dim"]
    return [
        Sample(
            torch.randn(16, 1, 6, 8, generator=gen),
            torch.randn(5, width, generator=gen),
            torch.zeros(0),
            [torch.randn(16, 1, 8, 6, generator=gen)],
        )
        for _ in range(2)
    ]


NORM_MODELS = {
    # query / key norms of every block and the text norm: ComfyUI's RMSNorm op (both ComfyUIs)
    "qwen_image": (functools.partial(tiny_qwen_image_patcher, seed=6), qwen_samples),
    # QKNorm: ComfyUI's RMSNorm op on 0.33 (0.3.75's Flux has its own norm, cast into fresh memory)
    "flux": (functools.partial(tiny_flux_patcher, seed=6), None),
}


NORM_REORDERING = 1e-5


@pytest.mark.parametrize("family", sorted(NORM_MODELS))
def test_reused_casts_of_norms_break_a_step_that_keeps_them_and_not_ours(
    ft, pack_import, samples, monkeypatch, family
):
    """A partial load on 0.33 with cudaMallocAsync off casts every offloaded layer, norms
    included, into its stream's shared buffer: replayed here with every cast op's weight in one
    reused buffer (`every_module`). `rms_norm` keeps the weight it is handed for its backward:
    with the norms left out of the contract (a scratch copy of the mechanism) the gradients are
    wrong with no error; with them in, equal to the plain run's (checkpointed): bit for bit with
    one compute thread, to float32 summation order with more."""
    cast_contract = pack_import("comfy_adapter.cast_contract")
    make_model, make_samples = NORM_MODELS[family]
    model = make_model()
    norms = [m for m in model.model.diffusion_model.modules() if cast_contract.is_cast_norm(m)]
    if not norms:
        pytest.skip("this ComfyUI's Flux norms are not ComfyUI cast ops (0.3.75: fresh casts)")
    assert all(type(norm).__name__ == "RMSNorm" for norm in norms)
    batch = make_samples(pack_import("trainer_core.flow_step").Sample) if make_samples else samples
    reference_loss, reference, _ = step(ft, batch, True, make_model=make_model)
    with monkeypatch.context() as scratch:  # norms out of the contract: their kept casts reused
        scratch.setattr(cast_contract, "is_cast_norm", lambda module: False)
        _, kept, _ = step(ft, batch, True, "dynamic", make_model=make_model, every_module=True)
    wrong = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(kept, reference, strict=True))
    print(f"\n{family}: {len(norms)} norms; kept norm casts: worst relative gradient error {wrong:.2e}")
    assert not wrong <= 1e-2
    before = cast_replay.REPLAYED["casts"]
    loss, ours, _ = step(ft, batch, True, "dynamic", make_model=make_model, every_module=True)
    assert cast_replay.REPLAYED["casts"] > before
    assert torch.equal(loss, reference_loss)
    error = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, reference, strict=True))
    print(f"with the norms in the contract: {error:.1e}")
    # measured: 0 with one compute thread (as `make test` runs); with two, rms_norm's backward on
    # the recompute's own leaf sums in another order: up to NORM_REORDERING
    assert error <= NORM_REORDERING
