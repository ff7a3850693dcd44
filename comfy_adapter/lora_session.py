"""The training session: a LoRA trained on the diffusion model inside a ComfyUI MODEL (the
adapter between `trainer_core` and ComfyUI). What the model's family changes, its blocks, ids,
guard probe and forward call, comes from its `families.ModelFamily`; this module is the same for
every family.

`lora_session(model, config)` is a context manager that
1. clones the MODEL (`family.with_reference_ids`: our reference position ids) and makes
   ComfyUI's own blocks trainable on the clone (`family.install_blocks`: block patches, norm
   pre-hooks, `trainable_blocks`), with ComfyUI's training mode on
   (`trainable_blocks.comfy_training_mode`);
2. (fp8_scaled only) gives the clone's block linears scaled fp8 weights *before* loading
   (`fp8_scaled`), so the GPU never holds the full-precision model;
3. loads the clone the way sampling does (`load_models_gpu`: fully or partially, by ComfyUI's
   own accounting), so any weight patches the MODEL carries (a LoRA from the stock loader,
   ...) are applied: we train exactly the model the user loaded. From then until the run ends
   ComfyUI's model management leaves the clone alone (`comfy_loading.held_for_training`).
   The load runs under inference mode, as the executor's loads do (a GPU load moves every
   weight: `comfy_loading.as_the_executor_loads`), and then every weight autograd cannot use
   (inference tensors, and weights whose version counter is missing) is swapped for an
   autograd-usable copy (`autograd_safe`);
4. attaches peft LoRA layers (on the compute device, also for layers a partial load left on
   the CPU; around `nn.Linear` and ComfyUI's quantized Linear alike) to the family's target
   layers of the shared diffusion model for the duration of the `with` block, makes every
   Linear that casts its weight cast again in the backward instead of letting autograd keep the
   cast (`cast_contract`), checks on the family's probe that the training path computes what
   ComfyUI's own forward computes for this model, and runs one backward without checkpointing,
   where autograd checks for in-place changes (`forward_guard`: a ComfyUI release that breaks
   the patches stops the run before any step), optionally swaps blocks (`block_swap`, in the
   family's `swap_order`), and undoes all of it on exit, whatever happens. The MODEL object
   the user holds never gets a patch, and once the block exits its module tree is the original
   one again.

Device discipline: the cached samples stay on the CPU; the family's `predict` moves each batch
to the load device and the loss is computed where the model computed (`flow_step`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..trainer_core import lora_file
from ..trainer_core.block_swap import BlockSwapper, first_swapped
from ..trainer_core.config import TrainConfig
from ..trainer_core.flow_step import EmptyText, flow_matching_loss
from ..trainer_core.lora_adapters import AttachedLora, attach_lora
from ..trainer_core.lora_file import LoraModule
from ..trainer_core.lora_metadata import write_lora
from ..trainer_core.token_batch import TokenBatch
from .autograd_safe import is_packed, make_autograd_safe_, put_back_
from .cast_contract import ContractPlan, linear_names, plan_for, recast_in_backward
from .comfy_loading import as_the_executor_loads, held_for_training, is_dynamic
from .comfy_quantized import check_quantized_model, fp8_backward
from .families import ModelFamily
from .forward_guard import check_training_backward, check_training_forward
from .fp8_scaled import fp8_scaled_weights
from .model_family import check_layout_fits
from .trainable_blocks import comfy_training_mode


def sampling_options(patcher) -> dict:
    """What sampling hands the model: the patcher's transformer options with its wrappers
    merged in (`sampler_helpers.prepare_model_patcher` does the same). A fresh dict per call,
    because a forward writes block indices into it."""
    import comfy.model_patcher
    import comfy.patcher_extension

    options = comfy.model_patcher.create_model_options_clone(patcher.model_options)
    transformer_options = options["transformer_options"]
    comfy.patcher_extension.merge_nested_dicts(
        transformer_options.setdefault("wrappers", {}), patcher.wrappers, copy_dict1=False
    )
    return transformer_options


def _compute_dtype(base_model) -> torch.dtype:
    return base_model.manual_cast_dtype or base_model.get_dtype()


@dataclass
class LoraSession:
    patcher: object  # the training clone (ModelPatcher)
    family: ModelFamily
    lora: AttachedLora
    config: TrainConfig
    empty_text: EmptyText | None = None
    swapper: BlockSwapper | None = None
    contract: ContractPlan | None = None  # where the cast contract applies (its `describe()`: the log line)

    @property
    def diffusion_model(self):
        return self.patcher.model.diffusion_model

    def pack(self, targets, references) -> TokenBatch:
        """The samples' latents as this model's tokens, in the run's layout (the family's
        packing: `ModelFamily.pack`)."""
        return self.family.pack(self.diffusion_model, self.config.layout, targets, references)

    def transformer_options(self) -> dict:
        return sampling_options(self.patcher)

    def predict(
        self, batch: TokenBatch, sigma: torch.Tensor, context: torch.Tensor, pooled: torch.Tensor
    ) -> torch.Tensor:
        """(B, L, D) velocity for every token of `batch` (non-target rows are zero or junk). The
        model gets the timestep its ComfyUI sampling gives it for `sigma` (`model_sampling`:
        sigma itself for Flux, sigma x 1000 for a discrete-flow model such as SD3), as
        `BaseModel._apply_model` computes it."""
        timestep = self.patcher.model.model_sampling.timestep(sigma)
        return self.family.predict(self, batch, timestep, context, pooled)

    def save(
        self,
        path,
        metadata: dict[str, str],
        modules: Mapping[str, LoraModule] | None = None,
        replace: bool = True,
    ) -> Path:
        """Write the current LoRA (or `modules`, already taken from it) atomically to `path`: kohya
        keys in the config's save_precision, `metadata` plus the hashes and finish time (`replace`
        off: FileExistsError rather than over an existing file)."""
        dtype = lora_file.precision_dtype(self.config.save_precision)
        return write_lora(Path(path), modules or self.lora.modules(), metadata, dtype, time.time(), replace)

    def noise_scaling(self, sigma: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """The noisy input at `sigma`, mixed as the model's ComfyUI sampling mixes it
        (`model_sampling.noise_scaling`: s * noise + (1 - s) * x0 for a flow model)."""
        return self.patcher.model.model_sampling.noise_scaling(sigma, noise, x0)

    def loss(self, samples, generator: torch.Generator, rows: slice | None = None) -> torch.Tensor:
        """The objective on one batch of `flow_step.Sample`s (the `loss_fn` of `loop.train`);
        `rows`: data parallel, this process's rows of the global batch `samples`."""
        return flow_matching_loss(
            self.predict,
            samples,
            self.config,
            generator,
            self.empty_text,
            self.pack,
            rows,
            self.noise_scaling,
            self.family.token_shift,
        )


def comfy_keeps_placement(module: torch.nn.Module) -> bool:
    """True for a layer ComfyUI's partial ("lowvram") load left on the offload device and casts
    per use (`ModelPatcher.load` marks it with `prev_comfy_cast_weights`): block swap leaves
    such layers where ComfyUI put them."""
    return hasattr(module, "prev_comfy_cast_weights")


def block_swapper(patcher, family: ModelFamily, blocks_to_swap: int, poison: bool = False) -> BlockSwapper:
    """Swap `blocks_to_swap` blocks (the first ones of the family's `swap_order`) between the
    patcher's load device and its offload device (ComfyUI's own pair: GPU and CPU, or CPU and CPU).

    Co-operation with ComfyUI's model management: the clone is loaded the normal way first
    (`load_models_gpu`, which applies the MODEL's weight patches); the swapper then moves the
    swapped blocks' frozen weights that ComfyUI put on the GPU to host buffers and, when
    training ends, brings exactly those back, so ComfyUI finds the model as it loaded it.
    Layers a partial load left on the CPU are not touched (`comfy_keeps_placement`). While
    training, ComfyUI's accounting still counts the swapped weights as on the GPU: it
    over-estimates our use, the safe side. `poison` is for tests (see BlockSwapper)."""
    diffusion_model = patcher.model.diffusion_model
    swapped = first_swapped(family.swap_order(diffusion_model), blocks_to_swap)
    return BlockSwapper(
        family.blocks(diffusion_model),
        swapped,
        patcher.load_device,
        patcher.offload_device,
        poison=poison,
        keeps_placement=comfy_keeps_placement,
    )


def _without_pins(patcher, action) -> None:
    """Run `action` with ComfyUI's pinned (page-locked) host weights unpinned, then pin them
    again: `make_autograd_safe_` replaces tensors, and a replaced tensor must not stay
    registered as pinned (ComfyUI's partial "lowvram" loads pin the weights they offload)."""
    pinned = sorted(getattr(patcher, "pinned", ()))
    for key in pinned:
        patcher.unpin_weight(key)
    try:
        action()
    finally:
        for key in pinned:
            patcher.pin_weight_to_device(key)


def _rng_devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() else []


@contextlib.contextmanager
def lora_session(
    model,
    config: TrainConfig,
    initial: Mapping[str, LoraModule] | None = None,
    empty_text: EmptyText | None = None,
    poison_swapped: bool = False,
    memory_required: int = 0,
    family: ModelFamily | None = None,
):
    """Yield a `LoraSession` training a new LoRA (or `initial`) on a clone of `model`.

    Runs with inference mode off (ComfyUI executes nodes under `torch.inference_mode`) and
    with torch's global RNG forked and seeded from `config.seed` (LoRA init, dropout), so the
    caller's random state is untouched and the same seed gives the same run.
    """
    import comfy.model_management

    with (
        torch.inference_mode(False),
        torch.random.fork_rng(devices=_rng_devices()),
        contextlib.ExitStack() as undo,
    ):
        torch.manual_seed(config.seed)
        # (also here: the headless path, tests; `family`: the run's, resolved once for it)
        family = check_layout_fits(model, config.layout, family=family)
        family.check_config(config)
        # `auto`: the model's own layout, from here on (ids, the guard, the session's config)
        own = family.resolve_layout(config.layout, model.model.diffusion_model)
        config = dataclasses.replace(config, layout=own)
        check_quantized_model(model, config.fp8_mode)
        clone = family.with_reference_ids(model)
        if config.fp8_mode == "fp8_scaled":  # before loading: the GPU only ever holds the fp8 copies
            undo.enter_context(fp8_scaled_weights(clone, family))
        if config.fp8_mode == "fp8_backward":  # ComfyUI's QuantLinearFunc reads it per forward
            undo.enter_context(fp8_backward(True))
        if is_dynamic(clone):  # a dirty load: no cast view cached by earlier sampling is reused
            clone.patches_uuid = uuid.uuid4()
        with as_the_executor_loads():
            comfy.model_management.load_models_gpu([clone], memory_required=memory_required)
        undo.enter_context(held_for_training(clone))
        diffusion_model = clone.model.diffusion_model
        swapped = []
        # the frozen base is never written: new tensors share the loaded ones' memory (no copy
        # of the model, also of a memory-mapped one under dynamic VRAM)
        _without_pins(clone, lambda: make_autograd_safe_(diffusion_model, swapped, share_memory=True))
        swapped[:] = [entry for entry in swapped if is_packed(entry[2])]  # only these go back
        undo.callback(put_back_, swapped)  # quantized weights return as loaded (see put_back_)
        names = family.lora_targets(linear_names(diffusion_model), config.targets)
        layers = dict(diffusion_model.named_modules())
        packed = {type(layers[n]) for n in names if not isinstance(layers[n], torch.nn.Linear)}
        lora = attach_lora(
            diffusion_model,
            names,
            config.rank,
            config.alpha,
            config.dropout,
            initial,
            clone.load_device,
            linear_types=tuple(packed),  # ComfyUI's quantized Linear (not an nn.Linear)
        )
        undo.callback(lora.detach)
        dtype = _compute_dtype(clone.model)
        # no weight ComfyUI's cast hands a layer outlives that layer's forward, where ComfyUI
        # may reuse cast memory (cast_contract: decided once, here, after the load)
        contract = plan_for(
            diffusion_model,
            clone.load_device,
            dtype,
            config.gradient_checkpointing,
            fp8_backward=config.fp8_mode == "fp8_backward",
        )
        undo.callback(recast_in_backward(diffusion_model, contract))
        # before any step: the training path computes what ComfyUI's own forward computes
        remove_hooks = family.install_blocks(clone, config.gradient_checkpointing)
        try:
            check_training_forward(clone, family, sampling_options(clone), dtype, config.layout)
        finally:
            remove_hooks()
        # and a backward without checkpointing (where autograd's in-place check runs) is sound
        remove_hooks = family.install_blocks(clone, checkpointing=False)
        try:
            check_training_backward(
                clone, family, sampling_options(clone), dtype, lora.parameters(), config.layout
            )
        finally:
            remove_hooks()
        swapper = None
        if config.blocks_to_swap and not is_dynamic(clone):  # dynamic VRAM streams already (notes)
            swapper = block_swapper(clone, family, config.blocks_to_swap, poison=poison_swapped)
            undo.callback(swapper.restore)
            swapper.prepare()
        undo.callback(family.install_blocks(clone, config.gradient_checkpointing, swapper))
        undo.enter_context(comfy_training_mode(True))
        undo.callback(diffusion_model.train, diffusion_model.training)
        diffusion_model.train(config.dropout > 0)
        yield LoraSession(clone, family, lora, config, empty_text, swapper, contract)
