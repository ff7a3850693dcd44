"""The five training steps `train_step.py` compares, one function per variant.

Each `run_<variant>(model, inputs, args)` does its own set-up (clone, adapters, optimizer) and
trains `args.warmup + args.steps` steps on one Kontext-style sample: a target latent and one
reference latent of the same size, CLIP-L-sized text (77 x 768) and pooled (768). It returns
a `Trained`: what it trained (layers, trainable parameters) and its losses. The clock lives
in `train_step.py`: an optimizer step hook and a forward pre-hook on the transformer, so
nothing here times itself.

ComfyUI variants get the stock-loaded MODEL; `diffusers` gets the same safetensors file,
converted with diffusers' own converter.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange

SIZE_CONTEXT, TEXT_WIDTH = 77, 768
LORA_LEARNING_RATE = 1e-4


@dataclass
class Inputs:
    target: torch.Tensor  # (1, 16, H, W) clean target latent
    reference: torch.Tensor  # (1, 16, H, W) clean reference latent
    context: torch.Tensor  # (1, 77, 768)
    pooled: torch.Tensor  # (1, 768)


@dataclass
class Trained:
    layers: str  # which layers got adapters, in words
    adapted: int  # how many weight tensors carry a trainable adapter or diff
    trainable: int  # trainable parameters (elements)
    losses: list[float]


def make_inputs(size: int, seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    side = size // 8
    return Inputs(
        torch.randn(1, 16, side, side, generator=gen),
        torch.randn(1, 16, side, side, generator=gen),
        torch.randn(1, SIZE_CONTEXT, TEXT_WIDTH, generator=gen),
        torch.randn(1, TEXT_WIDTH, generator=gen),
    )


PACK = {"name": ""}  # the pack's module name as ComfyUI loaded it (set by the worker)


def _pack(module: str):
    return importlib.import_module(f"{PACK['name']}.{module}")


def _numel(parameters) -> int:
    return sum(p.numel() for p in parameters if p.requires_grad)


# --- ours: exactly what TrainLoRA runs --------------------------------------------------------


def run_ours(model, inputs: Inputs, args, targets: str | None = None) -> Trained:
    ft = _pack("comfy_adapter.lora_session")
    flow_step = _pack("trainer_core.flow_step")
    loop = _pack("trainer_core.loop")
    sample = flow_step.Sample(inputs.target[0], inputs.context[0], inputs.pooled[0], [inputs.reference[0]])
    overrides = {"targets": targets} if targets else {}
    overrides["fp8_mode"] = getattr(args, "fp8_mode", "as_loaded")
    config = ft.TrainConfig(steps=args.warmup + args.steps, **overrides)  # every other field: default
    with torch.inference_mode(False), ft.lora_session(model, config) as session:
        parameters = session.lora.parameters()
        result = loop.train(config, parameters, lambda i: [sample], session.loss)
        layers = f"LoRA on {len(session.lora.names)} block linears (targets={config.targets})"
        return Trained(layers, len(session.lora.names), _numel(parameters), result.losses)


def run_ours_all(model, inputs: Inputs, args) -> Trained:
    return run_ours(model, inputs, args, targets="all_linear")


# --- native: ComfyUI's TrainLoraNode with its defaults ----------------------------------------


def run_native(model, inputs: Inputs, args) -> Trained:
    import comfy_extras.nodes_edit_model as nodes_edit_model
    import comfy_extras.nodes_train as nodes_train

    positive = [[inputs.context, {"pooled_output": inputs.pooled}]]
    # the reference the way a user adds it: a ReferenceLatent node on the conditioning
    (positive,) = nodes_edit_model.ReferenceLatent.execute(positive, {"samples": inputs.reference}).result
    if _crashes_on_reference(nodes_train.process_cond_list, positive):
        # 0.3.75 walks into the tensors of the `reference_latents` list until a 0-d tensor
        # raises ("iteration over a 0-d tensor"): a user gets that error. Measure what the node
        # would cost with that walk fixed (tensors in lists cloned like any other tensor).
        nodes_train.process_cond_list = _process_cond_list_fixed
    # Two copies of the one latent: a single LATENT input takes a code path of 0.3.75 that fails
    # (`multi_res` unset); with batch_size 1 it trains on one of them per step.
    latents = [{"samples": inputs.target}, {"samples": inputs.target}]
    algorithm = next(iter(nodes_train.adapter_maps))  # the widget's default ("lora")
    result = _execute_with_defaults(
        nodes_train.TrainLoraNode,
        model=[model],
        latents=latents,
        positive=[positive],
        batch_size=[1],
        steps=[args.warmup + args.steps],
        grad_accumulation_steps=[1],
        learning_rate=[0.0005],
        rank=[args.rank],  # default 8; every variant uses the same rank
        optimizer=["AdamW"],
        loss_function=["MSE"],
        seed=[0],
        training_dtype=["fp32"],  # default bf16; this machine computes in fp32 like the others
        lora_dtype=["fp32"],
        algorithm=[algorithm],
        gradient_checkpointing=[True],
        existing_lora=["[None]"],
    )
    # 0.3.75 returns (model, lora, loss map, steps); 0.33 (lora, loss map, steps)
    loss_map = next(out for out in result.result if isinstance(out, dict) and "loss" in out)
    lora_sd = next(out for out in result.result if isinstance(out, dict) and "loss" not in out)
    # the node turns requires_grad off when it returns: count by name (alpha is a frozen scalar)
    trained = {k: v for k, v in lora_sd.items() if not k.endswith(".alpha")}
    matrices = [k for k in trained if k.endswith(".lora_up.weight")]
    weight_diffs = [k for k in trained if k.endswith(".diff")]  # 1-D weights (norms with a `weight`)
    bias_diffs = [k for k in trained if k.endswith(".diff_b")]
    diffs = weight_diffs + bias_diffs
    layers = (
        f"LoRA on every 2-D weight ({len(matrices)} matrices, embeddings and final layer included) "
        f"+ full-size diffs on {len(bias_diffs)} biases and {len(weight_diffs)} 1-D weights"
    )
    trainable = sum(v.numel() for v in trained.values())
    return Trained(layers, len(matrices) + len(diffs), trainable, [float(x) for x in loss_map["loss"]])


def _execute_with_defaults(node, **given):
    """`node.execute` with `given`, and every other parameter at its widget's default as the
    node's schema states it (ComfyUI 0.33's TrainLoraNode has five more than 0.3.75's:
    quantized_backward, checkpoint_depth, offloading, bucket_mode, bypass_mode), in a list as
    an `is_input_list` node takes them."""
    import inspect

    defaults = {item.id: getattr(item, "default", None) for item in node.define_schema().inputs}
    wanted = [name for name in inspect.signature(node.execute).parameters if name != "cls"]
    missing = [name for name in wanted if name not in given and defaults.get(name) is None]
    if missing:
        raise RuntimeError(f"{node.__name__}.execute needs {missing}, which have no default")
    return node.execute(**{name: given.get(name, [defaults.get(name)]) for name in wanted})


def _crashes_on_reference(process_cond_list, positive) -> bool:
    try:
        process_cond_list([[c, dict(options)] for c, options in positive])
    except TypeError:
        return True
    return False


def _process_cond_list_fixed(d, prefix=""):
    """`nodes_train.process_cond_list` with one change: a tensor inside a list is cloned, not
    iterated."""
    if isinstance(d, torch.Tensor):
        return d.clone()
    if hasattr(d, "__iter__") and not hasattr(d, "items"):
        for index, item in enumerate(d):
            if isinstance(item, torch.Tensor) and isinstance(d, list):
                d[index] = item.clone()
            else:
                _process_cond_list_fixed(item, f"{prefix}.{index}")
        return d
    if hasattr(d, "items"):
        for k, v in list(d.items()):
            if isinstance(v, dict):
                _process_cond_list_fixed(v, f"{prefix}.{k}")
            elif isinstance(v, torch.Tensor):
                d[k] = v.clone()
            elif isinstance(v, (list, tuple)):
                for index, item in enumerate(v):
                    if isinstance(item, torch.Tensor) and isinstance(v, list):
                        v[index] = item.clone()
                    else:
                        _process_cond_list_fixed(item, f"{prefix}.{k}.{index}")
    return d


# --- bare: the reference step ----------------------------------------------------------------


def run_bare(model, inputs: Inputs, args) -> Trained:
    """Our default LoRA and block patches; per step only noise, ComfyUI's Flux call (target
    plus reference latent), MSE on the target's velocity, backward, AdamW."""
    import comfy.model_management

    ft = _pack("comfy_adapter.lora_session")
    trainable_blocks = _pack("comfy_adapter.trainable_blocks")
    flux_blocks = _pack("comfy_adapter.families.flux.blocks")
    lora_adapters = _pack("trainer_core.lora_adapters")
    lora_targets = _pack("comfy_adapter.families.flux.lora_targets")
    # ComfyUI's training mode (0.33: the eager RoPE, which has a backward), as ours trains
    with torch.inference_mode(False), trainable_blocks.comfy_training_mode(True):
        torch.manual_seed(0)
        clone = model.clone()
        comfy.model_management.load_models_gpu([clone])
        flux = clone.model.diffusion_model
        ft.make_autograd_safe_(flux)
        linears = _pack("comfy_adapter.cast_contract").linear_names(flux)
        names = lora_targets.target_module_names(linears, "attention_mlp")
        lora = lora_adapters.attach_lora(flux, names, args.rank, float(args.rank))
        flux_blocks.install(clone, checkpointing=True)
        optimizer = torch.optim.AdamW(lora.parameters(), lr=LORA_LEARNING_RATE, foreach=False)
        options = clone.model_options["transformer_options"]
        gen = torch.Generator().manual_seed(0)
        guidance = torch.ones(1)
        losses = []
        try:
            for _ in range(args.warmup + args.steps):
                sigma = torch.rand(1, generator=gen)
                noise = torch.randn(inputs.target.shape, generator=gen)
                noisy = (1 - sigma) * inputs.target + sigma * noise
                prediction = flux(
                    noisy,
                    sigma,
                    context=inputs.context,
                    y=inputs.pooled,
                    guidance=guidance,
                    ref_latents=[inputs.reference],
                    transformer_options=dict(options),
                )
                loss = F.mse_loss(prediction.float(), noise - inputs.target)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
            return Trained(
                f"LoRA on {len(names)} block linears (targets=attention_mlp)",
                len(names),
                _numel(lora.parameters()),
                losses,
            )
        finally:
            lora.detach()


# --- diffusers + peft: the independent peer ------------------------------------------------------

# The diffusers names of the layers ours adapts by default (`attention_mlp`): diffusers splits
# the fused qkv (double blocks) and linear1 (single blocks: qkv + MLP input) into separate Linears.
DIFFUSERS_ATTENTION_MLP = (
    r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj"
    r"|to_add_out)|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2))"
    r"|single_transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v)|proj_mlp|proj_out)"
)


def load_diffusers_flux(path) -> torch.nn.Module:
    """The demo checkpoint (ComfyUI / BFL key names) as diffusers' FluxTransformer2DModel, fp32."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    state = convert_flux_transformer_checkpoint_to_diffusers(load_file(str(path)))
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(
            in_channels=state["x_embedder.weight"].shape[1],
            num_layers=1 + max(int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks.")),
            num_single_layers=1
            + max(int(k.split(".")[1]) for k in state if k.startswith("single_transformer_blocks.")),
            joint_attention_dim=state["context_embedder.weight"].shape[1],
            pooled_projection_dim=state["time_text_embed.text_embedder.linear_1.weight"].shape[1],
            guidance_embeds=any("guidance_embedder" in k for k in state),
        )
    transformer.load_state_dict({k: v.float() for k, v in state.items()}, strict=True, assign=True)
    return transformer.requires_grad_(False)


def _image_ids(side: int, domain: int) -> torch.Tensor:
    """(side/2 * side/2, 3): (domain, row, column) per 2x2 patch, Kontext's reference layout."""
    rows, cols = torch.meshgrid(torch.arange(side // 2), torch.arange(side // 2), indexing="ij")
    return torch.stack([torch.full_like(rows, domain), rows, cols], dim=-1).reshape(-1, 3).float()


def run_diffusers(transformer, inputs: Inputs, args) -> Trained:
    """diffusers + peft as ai-toolkit / SimpleTuner run it: LoRA via `add_adapter`, gradient
    checkpointing, target and reference tokens concatenated (ids domain 0 / 1), AdamW."""
    from peft import LoraConfig

    torch.manual_seed(0)
    config = LoraConfig(
        r=args.rank,
        lora_alpha=args.rank,
        init_lora_weights="gaussian",
        target_modules=DIFFUSERS_ATTENTION_MLP,
    )
    transformer.add_adapter(config)
    transformer.enable_gradient_checkpointing()
    transformer.train()
    parameters = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=LORA_LEARNING_RATE, weight_decay=0.01)
    side = inputs.target.shape[-1]
    target = rearrange(inputs.target, "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=2, pw=2)
    reference = rearrange(inputs.reference, "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=2, pw=2)
    img_ids = torch.cat([_image_ids(side, 0), _image_ids(side, 1)])
    txt_ids = torch.zeros(inputs.context.shape[1], 3)
    gen = torch.Generator().manual_seed(0)
    guidance = torch.ones(1)
    losses = []
    for _ in range(args.warmup + args.steps):
        sigma = torch.rand(1, generator=gen)
        noise = torch.randn(target.shape, generator=gen)
        noisy = (1 - sigma) * target + sigma * noise
        prediction = transformer(
            hidden_states=torch.cat([noisy, reference], dim=1),
            encoder_hidden_states=inputs.context,
            pooled_projections=inputs.pooled,
            timestep=sigma,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )[0][:, : target.shape[1]]
        loss = F.mse_loss(prediction.float(), noise - target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    from peft.tuners.lora import LoraLayer

    adapted = sum(isinstance(m, LoraLayer) for m in transformer.modules())
    layers = f"LoRA on {adapted} block linears (attention_mlp's layers, qkv split in q, k, v)"
    return Trained(layers, adapted, _numel(parameters), losses)


VARIANTS = {
    "ours": run_ours,
    "ours_all": run_ours_all,
    "native": run_native,
    "bare": run_bare,
    "diffusers": run_diffusers,
}
