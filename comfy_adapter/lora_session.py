"""The training session: a LoRA trained on the diffusion model inside a ComfyUI MODEL (the
adapter between `trainer_core` and ComfyUI; the blocks, ids and probes it uses are still the
Flux families' own, see ARCHITECTURE.md).

`lora_session(model, config)` is a context manager that
1. clones the MODEL (`with_reference_ids`: our reference position ids) and makes ComfyUI's own
   blocks trainable on the clone (`flux_blocks`: block patches, norm pre-hooks), with
   ComfyUI's training mode on (`flux_blocks.comfy_training_mode`);
2. (fp8_scaled only) gives the clone's block linears scaled fp8 weights *before* loading
   (`fp8_scaled`), so the GPU never holds the full-precision model;
3. loads the clone the way sampling does (`load_models_gpu`: fully or partially, by ComfyUI's
   own accounting), so any weight patches the MODEL carries (a LoRA from the stock loader,
   ...) are applied: we train exactly the model the user loaded. From then until the run ends
   ComfyUI's model management leaves the clone alone (`comfy_loading.held_for_training`).
   The load runs under inference mode, as the executor's loads do (a GPU load moves every
   weight: `comfy_loading.as_the_executor_loads`), and then every weight autograd cannot use
   (inference tensors, and weights whose version counter is missing) is swapped for an
   autograd-usable copy (`trainer_core.autograd_safe`);
4. attaches peft LoRA layers (on the compute device, also for layers a partial load left on
   the CPU; around `nn.Linear` and ComfyUI's quantized Linear alike) to the shared diffusion
   model for the duration of the `with` block, makes every Linear that casts its weight cast
   again in the backward instead of letting autograd keep the cast (`cast_contract`), checks on one
   small input that the training path computes what ComfyUI's own forward computes for this
   model, and runs one backward without checkpointing, where autograd checks for in-place
   changes (`forward_guard`: a ComfyUI release that breaks the patches stops the run
   before any step), optionally swaps blocks (`block_swap`), and undoes all of it on exit,
   whatever happens. The MODEL object the user holds never gets a patch, and once the block
   exits its module tree is the original one again.

Device discipline: the cached samples stay on the CPU; `predict` moves each batch to the
load device and the loss is computed where the model computed (`flow_step`).

`LoraSession.predict` is the model call of the objective: for a batch whose samples share
their sizes it is exactly the call `BaseModel._apply_model` makes (ComfyUI's Flux `forward`
with `ref_latents` and `ref_latents_method`, through its wrappers and patches; inputs cast
the same way); a padded mixed-size batch goes through `forward_orig` with per-sample ids and
an attention mask (`reference_ids.forward_token_batch`). With timestep-zero references
(ComfyUI 0.33's `index_timestep_zero`, FLUX.2) every sample gets ComfyUI's own call alone.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..trainer_core import lora_file
from ..trainer_core.block_swap import BlockSwapper, choose_swapped
from ..trainer_core.config import TrainConfig
from ..trainer_core.flow_step import EmptyText, flow_matching_loss
from ..trainer_core.lora_adapters import AttachedLora, attach_lora
from ..trainer_core.lora_file import LoraModule
from ..trainer_core.lora_metadata import write_lora
from ..trainer_core.lora_targets import target_module_names
from ..trainer_core.position_ids import TIMESTEP_ZERO_LAYOUTS, TokenGrid
from ..trainer_core.token_batch import TokenBatch, pack_latent
from .autograd_safe import is_packed, make_autograd_safe_, put_back_
from .cast_contract import linear_names, recast_in_backward
from .comfy_loading import as_the_executor_loads, held_for_training, is_dynamic
from .comfy_quantized import check_quantized_model, fp8_backward
from .flux_blocks import comfy_training_mode, install_trainable_blocks
from .forward_guard import check_training_backward, check_training_forward
from .fp8_scaled import fp8_scaled_weights
from .model_family import check_layout_fits, token_grid
from .reference_ids import forward_token_batch, with_reference_ids


def sampling_options(patcher) -> dict:
    """What sampling hands the model: the patcher's transformer options with its wrappers
    merged in (`sampler_helpers.prepare_model_patcher` does the same). A fresh dict per call,
    because Flux writes block indices into it."""
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
    lora: AttachedLora
    config: TrainConfig
    empty_text: EmptyText | None = None
    swapper: BlockSwapper | None = None

    @property
    def diffusion_model(self):
        return self.patcher.model.diffusion_model

    @functools.cached_property
    def grid(self) -> TokenGrid:
        """How this model turns latents into tokens and ids (FLUX.1 or FLUX.2)."""
        return token_grid(self.diffusion_model)

    def transformer_options(self) -> dict:
        return sampling_options(self.patcher)

    def predict(
        self, batch: TokenBatch, sigma: torch.Tensor, context: torch.Tensor, pooled: torch.Tensor
    ) -> torch.Tensor:
        """(B, L, D) velocity for every token of `batch` (non-target rows are zero or junk)."""
        if self.config.layout in TIMESTEP_ZERO_LAYOUTS and batch.tokens.shape[0] > 1:
            return self._predict_one_by_one(batch, sigma, context, pooled)
        base_model = self.patcher.model
        dtype, device = _compute_dtype(base_model), self.patcher.load_device
        tokens = batch.tokens.to(device, dtype)
        timestep = sigma.to(device, torch.float32)
        context = context.to(device, dtype)
        pooled = pooled.to(device, dtype)
        guidance = None
        if self.diffusion_model.params.guidance_embed:
            guidance = torch.full((tokens.shape[0],), self.config.guidance, device=device, dtype=dtype)
        options = self.transformer_options()
        if not batch.is_uniform():
            moved = TokenBatch(
                tokens,
                batch.ids.to(device),
                batch.valid.to(device),
                batch.target.to(device),
                batch.target_sizes,
                batch.grid,
                batch.reference_sizes,
            )
            return forward_token_batch(
                self.diffusion_model, moved, timestep, context, pooled, guidance, options
            )
        x, references = batch.split_latents(tokens)
        out = self.diffusion_model(
            x,
            timestep,
            context=context,
            y=pooled,
            guidance=guidance,
            ref_latents=references or None,
            control=None,
            transformer_options=options,
            ref_latents_method=self.config.layout,
        )
        packed = pack_latent(out, batch.grid.patch_size)
        rest = tokens.shape[1] - packed.shape[1]
        return torch.cat([packed, packed.new_zeros(packed.shape[0], rest, packed.shape[2])], dim=1)

    def _predict_one_by_one(self, batch: TokenBatch, sigma, context, pooled) -> torch.Tensor:
        """Timestep-zero references, one sample per forward: ComfyUI's Flux (0.33) doubles the
        timestep batch for them, which a batch of several meets with one guidance value per
        sample and fails, and it takes one reference range for the whole batch, which padded
        samples do not share. Each sample gets exactly ComfyUI's own call."""
        rows = [
            self.predict(batch.sample(i), sigma[i : i + 1], context[i : i + 1], pooled[i : i + 1])
            for i in range(batch.tokens.shape[0])
        ]
        length = batch.tokens.shape[1]
        return torch.cat([torch.nn.functional.pad(row, (0, 0, 0, length - row.shape[1])) for row in rows])

    def save(self, path, metadata: dict[str, str], modules: Mapping[str, LoraModule] | None = None) -> Path:
        """Write the current LoRA (or `modules`, already taken from it) atomically to `path`: kohya
        keys in the config's save_precision, `metadata` plus the hashes and finish time."""
        dtype = lora_file.precision_dtype(self.config.save_precision)
        return write_lora(Path(path), modules or self.lora.modules(), metadata, dtype, time.time())

    def loss(self, samples, generator: torch.Generator, rows: slice | None = None) -> torch.Tensor:
        """The objective on one batch of `flow_step.Sample`s (the `loss_fn` of `loop.train`);
        `rows`: data parallel, this process's rows of the global batch `samples`."""
        return flow_matching_loss(
            self.predict,
            samples,
            self.config,
            generator,
            self.empty_text,
            self.grid,
            rows,
        )


def comfy_keeps_placement(module: torch.nn.Module) -> bool:
    """True for a layer ComfyUI's partial ("lowvram") load left on the offload device and casts
    per use (`ModelPatcher.load` marks it with `prev_comfy_cast_weights`): block swap leaves
    such layers where ComfyUI put them."""
    return hasattr(module, "prev_comfy_cast_weights")


def block_swapper(patcher, blocks_to_swap: int, poison: bool = False) -> BlockSwapper:
    """Swap `blocks_to_swap` blocks (single blocks first) between the patcher's load device
    and its offload device (ComfyUI's own pair: GPU and CPU, or CPU and CPU).

    Co-operation with ComfyUI's model management: the clone is loaded the normal way first
    (`load_models_gpu`, which applies the MODEL's weight patches); the swapper then moves the
    swapped blocks' frozen weights that ComfyUI put on the GPU to host buffers and, when
    training ends, brings exactly those back, so ComfyUI finds the model as it loaded it.
    Layers a partial load left on the CPU are not touched (`comfy_keeps_placement`). While
    training, ComfyUI's accounting still counts the swapped weights as on the GPU: it
    over-estimates our use, the safe side. `poison` is for tests (see BlockSwapper)."""
    flux = patcher.model.diffusion_model
    blocks = [*flux.double_blocks, *flux.single_blocks]
    swapped = choose_swapped(len(flux.double_blocks), len(flux.single_blocks), blocks_to_swap)
    return BlockSwapper(
        blocks,
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
        check_layout_fits(model, config.layout)  # also here: the headless path, tests
        check_quantized_model(model, config.fp8_mode)
        clone = with_reference_ids(model)
        if config.fp8_mode == "fp8_scaled":  # before loading: the GPU only ever holds the fp8 copies
            undo.enter_context(fp8_scaled_weights(clone))
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
        names = target_module_names(linear_names(diffusion_model), config.targets)
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
        # no weight ComfyUI's cast hands a layer outlives that layer's forward (cast_contract)
        undo.callback(recast_in_backward(diffusion_model))
        # before any step: the training path computes what ComfyUI's own forward computes
        remove_hooks = install_trainable_blocks(clone, config.gradient_checkpointing)
        try:
            check_training_forward(clone, sampling_options(clone), _compute_dtype(clone.model), config.layout)
        finally:
            remove_hooks()
        # and a backward without checkpointing (where autograd's in-place check runs) is sound
        remove_hooks = install_trainable_blocks(clone, checkpointing=False)
        try:
            check_training_backward(
                clone, sampling_options(clone), _compute_dtype(clone.model), lora.parameters(), config.layout
            )
        finally:
            remove_hooks()
        swapper = None
        if config.blocks_to_swap and not is_dynamic(clone):  # dynamic VRAM streams already (notes)
            swapper = block_swapper(clone, config.blocks_to_swap, poison=poison_swapped)
            undo.callback(swapper.restore)
            swapper.prepare()
        undo.callback(install_trainable_blocks(clone, config.gradient_checkpointing, swapper))
        undo.enter_context(comfy_training_mode(True))
        undo.callback(diffusion_model.train, diffusion_model.training)
        diffusion_model.train(config.dropout > 0)
        yield LoraSession(clone, lora, config, empty_text, swapper)
