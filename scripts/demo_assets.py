"""Stock-loadable demo assets with seeded random weights (no model hub is reachable).

Writes, once, into a cache folder outside git:
  diffusion_models/kontext-trainer-demo-flux.safetensors  Flux, hidden 3072, 1 double + 1 single
      block, text/pooled inputs 768 so the CLIP-L below drives it (the stock UNETLoader needs
      hidden 3072: its detection hard-codes 24 heads and axes [16, 56, 56]); saved under the
      real files' (BFL's) tensor names, which every supported ComfyUI loads, whichever wrote it.
  vae/kontext-trainer-demo-ae.safetensors                 the Flux VAE with BFL's `ae` key names.
  text_encoders/kontext-trainer-demo-clip-l.safetensors   a CLIP-L text encoder.
Then links them into a ComfyUI models/ folder. Run inside a ComfyUI environment
(ComfyUI's root on sys.path): the weights are shaped by ComfyUI's own classes.

The FLUX.1 examples name the real files users download; `on_demo_files` turns such a graph into
the one the demo queues on these three files.

    python scripts/demo_assets.py --models-dir /path/to/ComfyUI/models
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

# Bump when the generated content changes, so stale caches are never reused.
ASSET_VERSION = "v1"
FLUX_FILE = ("diffusion_models", "kontext-trainer-demo-flux.safetensors")
VAE_FILE = ("vae", "kontext-trainer-demo-ae.safetensors")
CLIP_FILE = ("text_encoders", "kontext-trainer-demo-clip-l.safetensors")

# The real FLUX.1 files the examples' loaders name -> the demo's file that stands in for each.
# The examples' DualCLIPLoader (type flux: clip_l + t5xxl) becomes a CLIPLoader of the demo's
# CLIP-L alone: ComfyUI builds T5-XXL at its full size from a fixed config whatever the file
# holds (comfy/text_encoders/t5_config_xxl.json: 4.7 B parameters, about 4.9 GB even in fp8),
# and its 4096-wide text would need a Flux other than the demo's (text input 768, CLIP-L's).
DEMO_STAND_INS = {
    ("UNETLoader", "unet_name"): {
        "flux1-dev-kontext_fp8_scaled.safetensors": FLUX_FILE[1],
        "flux1-dev.safetensors": FLUX_FILE[1],
    },
    ("VAELoader", "vae_name"): {"ae.safetensors": VAE_FILE[1]},
}
FLUX_TEXT_ENCODERS = ("clip_l.safetensors", "t5xxl_fp8_e4m3fn_scaled.safetensors")

DEMO_FLUX_CONFIG = {
    "image_model": "flux",
    "in_channels": 16,
    "out_channels": 16,
    "vec_in_dim": 768,
    "context_in_dim": 768,
    "hidden_size": 3072,
    "mlp_ratio": 4.0,
    "num_heads": 24,
    "depth": 1,
    "depth_single_blocks": 1,
    "axes_dim": [16, 56, 56],
    "theta": 10000,
    "patch_size": 2,
    "qkv_bias": True,
    "guidance_embed": True,
}

# The demo Flux at 1/12 of its width: ComfyUI 0.33's detection reads the width from the file (24
# heads of 128 at 3072, 2 at 256); 0.3.75's fixes 24 heads, so only 0.33 loads it. For tests of
# flows where the model's size is not what is tested (ten times quicker a step on a CPU).
NARROW_FLUX_CONFIG = {**DEMO_FLUX_CONFIG, "hidden_size": 256, "num_heads": 2}

# What ComfyUI's model detection adds to a Flux config in versions whose `FluxParams` needs it
# (0.33: the axes text ids count on; none for FLUX.1, the 4th for FLUX.2).
TXT_IDS_DIMS = {"flux": [], "flux2": [3]}


def for_this_comfyui(unet_config: dict) -> dict:
    """`unet_config` as the running ComfyUI's Flux takes it (a copy)."""
    import dataclasses

    from comfy.ldm.flux.model import FluxParams

    config = dict(unet_config)
    if "txt_ids_dims" in {field.name for field in dataclasses.fields(FluxParams)}:
        config.setdefault("txt_ids_dims", TXT_IDS_DIMS[config["image_model"]])
    return config


# The Flux VAE (ae.safetensors) topology, as ComfyUI's VAE class builds it for those key names.
FLUX_AE_DDCONFIG = {
    "double_z": True,
    "z_channels": 16,
    "resolution": 256,
    "in_channels": 3,
    "out_ch": 3,
    "ch": 128,
    "ch_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_resolutions": [],
    "dropout": 0.0,
}


def seeded_values(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """A reproducible fp32 value for one parameter: matrices ~ N(0, 1/fan_in), norm scales 1,
    other vectors ~ N(0, 0.02^2). Callers draw in a fixed order from one generator."""
    if len(shape) >= 2:
        return torch.randn(shape, generator=generator) / math.sqrt(math.prod(shape[1:]))
    if "norm" in name or name.endswith(".scale"):
        return torch.ones(shape)
    return torch.randn(shape, generator=generator) * 0.02


def seeded_state(module: torch.nn.Module, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The module's state dict with `seeded_values` for its floating-point parameters;
    buffers (e.g. CLIP's position ids) are kept as they are."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(module.named_parameters())
    out = {}
    for name, tensor in module.state_dict().items():
        if name not in params or not tensor.is_floating_point():
            out[name] = tensor.clone()
        else:
            out[name] = seeded_values(name, tensor.shape, gen).to(dtype).contiguous()
    return out


def real_file_names(model: torch.nn.Module) -> dict[str, str]:
    """The running ComfyUI's parameter name -> the name real Flux files use (BFL's
    `flux1-dev.safetensors`), for the names that differ: an RMSNorm's weight is `.scale` there.
    ComfyUI 0.33 builds its RMSNorm as torch's (`.weight`) and renames `_norm.scale` on load;
    0.3.75 holds `.scale` itself and detects Flux only by that name, so a file saved with 0.33's
    names breaks 0.3.75 ("Could not detect model type")."""
    return {
        f"{module_name}.weight": f"{module_name}.scale"
        for module_name, module in model.named_modules()
        if type(module).__name__ == "RMSNorm"
        and isinstance(getattr(module, "weight", None), torch.nn.Parameter)
    }


def flux_on_meta(config: dict = DEMO_FLUX_CONFIG) -> torch.nn.Module:
    import comfy.ldm.flux.model
    import comfy.ops

    with torch.device("meta"):
        return comfy.ldm.flux.model.Flux(operations=comfy.ops.disable_weight_init, **for_this_comfyui(config))


def flux_file_shapes(config: dict = DEMO_FLUX_CONFIG) -> dict[str, torch.Size]:
    """Name -> shape of each tensor of the demo Flux file (or another `config`'s), under the real
    files' names."""
    model = flux_on_meta(config)
    renamed = real_file_names(model)
    return {renamed.get(name, name): param.shape for name, param in model.named_parameters()}


def flux_state_dict(seed: int = 1, config: dict = DEMO_FLUX_CONFIG) -> dict[str, torch.Tensor]:
    """The demo Flux's seeded weights (or those of another `config`, e.g. `NARROW_FLUX_CONFIG`)
    under the real files' names (see `real_file_names`)."""
    model = flux_on_meta(config)
    renamed = real_file_names(model)
    state = _seeded_from_meta(model, seed, torch.bfloat16)
    return {renamed.get(name, name): value for name, value in state.items()}


def flux_ae_state_dict(seed: int = 2) -> dict[str, torch.Tensor]:
    from comfy.ldm.modules.diffusionmodules.model import Decoder, Encoder

    with torch.device("meta"):
        model = torch.nn.Module()
        model.encoder = Encoder(**FLUX_AE_DDCONFIG)
        model.decoder = Decoder(**FLUX_AE_DDCONFIG)
    return _seeded_from_meta(model, seed, torch.float16)


def clip_l_state_dict(seed: int = 3) -> dict[str, torch.Tensor]:
    import comfy.sd1_clip

    model = comfy.sd1_clip.SDClipModel(device="cpu", dtype=torch.float16)
    state = seeded_state(model, seed, torch.float16)
    # clip_l.safetensors key names: no "transformer." wrapper prefix, no logit_scale.
    return {k.removeprefix("transformer."): v for k, v in state.items() if k != "logit_scale"}


def _seeded_from_meta(model: torch.nn.Module, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded values for a model built on the meta device (so no memory is spent twice)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: seeded_values(name, param.shape, gen).to(dtype).contiguous()
        for name, param in model.named_parameters()
    }


def narrow_flux_loads() -> bool:
    """Whether the running ComfyUI's detection (what the stock UNETLoader reads) takes the
    narrow demo Flux as it is (0.33: the width's 2 heads; 0.3.75 fixes 24)."""
    import comfy.model_detection

    files = flux_file_shapes(NARROW_FLUX_CONFIG)
    shapes = {name: torch.empty(shape, device="meta") for name, shape in files.items()}
    detected = comfy.model_detection.detect_unet_config(shapes, "")
    return detected.get("num_heads") == NARROW_FLUX_CONFIG["num_heads"]


def write_narrow_flux(path: Path, seed: int = 1) -> Path:
    """The narrow demo Flux (`NARROW_FLUX_CONFIG`; ComfyUI 0.33 loads it) written to `path`."""
    _write_atomic(flux_state_dict(seed, NARROW_FLUX_CONFIG), path)
    return path


def _write_atomic(state: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    save_file(state, str(tmp), metadata={"kontext_trainer_demo_asset": ASSET_VERSION})
    os.replace(tmp, path)


def holds_names(path: Path, names) -> bool:
    """Whether the safetensors file at `path` holds exactly the tensors `names` (reads the header)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        return set(file.keys()) == set(names)


def ensure_assets(cache_dir: Path) -> dict[str, Path]:
    """Generate the three files under cache_dir/ASSET_VERSION unless already there. A cached Flux
    under other names than the real files' (one saved by an earlier version on ComfyUI 0.33) is
    written again."""
    root = cache_dir / ASSET_VERSION
    makers = {
        "flux": (FLUX_FILE, flux_state_dict),
        "vae": (VAE_FILE, flux_ae_state_dict),
        "clip": (CLIP_FILE, clip_l_state_dict),
    }
    paths = {}
    for key, ((folder, name), make) in makers.items():
        path = root / folder / name
        if key == "flux" and path.is_file() and not holds_names(path, flux_file_shapes()):
            print(f"[demo-assets] {folder}/{name}: not the real files' tensor names", file=sys.stderr)
            path.unlink()
        if not path.is_file():
            print(f"[demo-assets] generating {folder}/{name}", file=sys.stderr)
            _write_atomic(make(), path)
        paths[key] = path
    return paths


def link_into_models(paths: dict[str, Path], models_dir: Path) -> None:
    """Symlink the cached files into a ComfyUI models/ folder (no copies of 1 GB files)."""
    for path in paths.values():
        dest = models_dir / path.parent.name / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_symlink() or dest.exists():
            if dest.resolve() == path.resolve():
                continue
            dest.unlink()
        dest.symlink_to(path.resolve())


def on_demo_files(workflow: dict) -> dict:
    """An API-format FLUX.1 example as the demo runs it (a copy): UNETLoader and VAELoader on the
    demo's files (`DEMO_STAND_INS`), the DualCLIPLoader of clip_l + t5xxl a CLIPLoader of the
    demo's CLIP-L under the same node id, so every link stays as shipped. A loader whose file
    the demo has no stand-in for (FLUX.2, Qwen-Image-Edit) is a ValueError that names it."""
    swapped = {}
    for node_id, node in workflow.items():
        kind, values = node["class_type"], dict(node["inputs"])
        if kind == "DualCLIPLoader":
            encoders = {values["clip_name1"], values["clip_name2"]}
            if values["type"] != "flux" or encoders != set(FLUX_TEXT_ENCODERS):
                raise ValueError(f"node {node_id}: the demo has no stand-in for DualCLIPLoader {values}")
            kind = "CLIPLoader"
            values = {"clip_name": CLIP_FILE[1], "type": "stable_diffusion", "device": values["device"]}
        elif kind == "CLIPLoader":
            raise ValueError(f"node {node_id}: the demo has no stand-in for CLIPLoader {values['clip_name']}")
        for (loader, widget), stand_ins in DEMO_STAND_INS.items():
            if kind == loader and values[widget] not in stand_ins:
                raise ValueError(f"node {node_id}: the demo has no stand-in for {loader} {values[widget]}")
            if kind == loader:
                values[widget] = stand_ins[values[widget]]
        swapped[node_id] = {**node, "class_type": kind, "inputs": values}
    return swapped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(__file__).resolve().parents[1] / ".cache" / "assets"
    )
    parser.add_argument("--models-dir", type=Path, help="a ComfyUI models/ folder to link the files into")
    parser.add_argument("--comfyui", type=Path, help="ComfyUI root to import its classes from")
    args = parser.parse_args(argv)
    if args.comfyui:
        sys.path.insert(0, str(args.comfyui))
    from comfy.cli_args import args as comfy_args

    comfy_args.cpu = comfy_args.cpu or not torch.cuda.is_available()
    paths = ensure_assets(args.cache_dir)
    if args.models_dir:
        link_into_models(paths, args.models_dir)
    for path in paths.values():
        print(path)


if __name__ == "__main__":
    main()
