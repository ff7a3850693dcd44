"""ComfyUI's quantized diffusion-model files, made by ComfyUI's own quantization code.

Every weight is quantized by the running ComfyUI's `comfy.quant_ops.QuantizedTensor.from_float`
(per-tensor fp8 with one float32 scale, the layout ComfyUI reads back), then written in one of
the on-disk forms users download:

- `scaled_fp8`: the older form (`flux1-dev-kontext_fp8_scaled`): `<layer>.weight` in fp8,
  `<layer>.scale_weight`, and a `scaled_fp8` marker tensor of the fp8 dtype;
- `quantization_metadata`: "fp8mixed" (`flux2_dev_fp8mixed`): `<layer>.weight` and
  `<layer>.weight_scale`, the layers' formats in the file's `_quantization_metadata`;
- `comfy_quant`: what ComfyUI 0.33 writes itself: the same tensors plus one `<layer>.comfy_quant`
  tensor per layer (its JSON configuration as bytes); ComfyUI 0.3.75 does not read it.

`quantized_flux_model` builds a tiny model with ComfyUI's mixed-precision ops holding such
weights (the loader's result without a file: model detection needs the stock hidden size).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FORMS = ("scaled_fp8", "quantization_metadata", "comfy_quant")
FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def comfy_reads_comfy_quant() -> bool:
    """ComfyUI 0.33+ reads per-layer `comfy_quant` tensors (0.3.75 only file metadata)."""
    import comfy.utils

    return hasattr(comfy.utils, "convert_old_quants")


def forms_this_comfyui_loads() -> tuple[str, ...]:
    return FORMS if comfy_reads_comfy_quant() else FORMS[:2]


def quantize(weight: torch.Tensor, fmt: str = "float8_e4m3fn") -> dict[str, torch.Tensor]:
    """The weight's tensors as ComfyUI stores them ({"weight": values, "weight_scale": ...,
    more for block formats such as nvfp4's "weight_scale_2"}), from ComfyUI's own
    `QuantizedTensor.from_float`."""
    from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor

    if fmt not in QUANT_ALGOS:
        raise ValueError(f"this ComfyUI has no quantization format {fmt!r}")
    layout = QUANT_ALGOS[fmt]["comfy_tensor_layout"]
    if comfy_reads_comfy_quant():
        parts = QuantizedTensor.from_float(weight, layout).state_dict("weight")
        return {key: value for key, value in parts.items()}
    quantized = QuantizedTensor.from_float(weight, layout, dtype=FORMATS[fmt])
    return {"weight": quantized._qdata, "weight_scale": quantized._layout_params["scale"].float()}


def block_linear_layers(diffusion_model: torch.nn.Module) -> list[str]:
    """The block Linears (what ComfyUI's fp8 Flux files quantize), in model order."""
    return [
        name
        for name, module in diffusion_model.named_modules()
        if isinstance(module, torch.nn.Linear) and "blocks." in name
    ]


def quantized_tensors(state_dict: dict, layers: list[str], fmt: str, prefix: str = ""):
    """`state_dict` with `layers` quantized: (tensors, {layer: its configuration})."""
    out, config = dict(state_dict), {}
    for layer in layers:
        for key, value in quantize(state_dict[f"{prefix}{layer}.weight"], fmt).items():
            out[f"{prefix}{layer}.{key}"] = value
        config[f"{prefix}{layer}"] = {"format": fmt}
    return out, config


def in_form(tensors: dict, config: dict, form: str) -> tuple[dict, dict]:
    """(tensors, file metadata) of the quantized `tensors` in one on-disk `form`."""
    if form == "quantization_metadata":
        return tensors, {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": config})}
    if form == "comfy_quant":
        out = dict(tensors)
        for layer, conf in config.items():
            out[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
        return out, {}
    if form == "scaled_fp8":
        formats = {conf["format"] for conf in config.values()}
        if formats != {"float8_e4m3fn"}:
            raise ValueError("the older scaled_fp8 form holds float8_e4m3fn layers only")
        out = {}
        for key, value in tensors.items():
            layer = key.removesuffix(".weight_scale")
            out[f"{layer}.scale_weight" if layer in config else key] = value
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
        return out, {}
    raise ValueError(f"unknown form {form!r}: one of {', '.join(FORMS)}")


def write_quantized_file(path: Path, state_dict: dict, form: str, fmt: str = "float8_e4m3fn") -> Path:
    """A diffusion-model file the stock UNETLoader reads: every block Linear of `state_dict`
    (a Flux or Qwen-Image diffusion model's, unprefixed) quantized to `fmt`, written in `form`."""
    from safetensors.torch import save_file

    layers = sorted(
        {k.removesuffix(".weight") for k in state_dict if "blocks." in k and k.endswith(".weight")}
    )
    layers = [name for name in layers if state_dict[f"{name}.weight"].ndim == 2]
    tensors, metadata = in_form(*quantized_tensors(state_dict, layers, fmt), form)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata or None)
    return path


def quantized_flux_model(unet_config: dict, seed: int, fmt: str = "float8_e4m3fn", compute=torch.float32):
    """A tiny `comfy.model_base.Flux` / `Flux2` whose block Linears are ComfyUI's quantized
    Linear (`mixed_precision_ops`) holding `fmt` weights quantized from the plain model of the
    same seed, computing in `compute`; returns (quantized model, plain model). The quantized one
    is built under inference mode, as a loader node builds it in the executor (ComfyUI 0.3.75's
    quantized Linear can only be moved in the inference mode it was made in)."""
    import comfy.supported_models

    from .tiny_models import build_flux_model, for_this_comfyui

    plain = build_flux_model(unet_config, seed)
    layers = block_linear_layers(plain.diffusion_model)
    state = {
        k: v.to(compute) if v.is_floating_point() else v
        for k, v in plain.diffusion_model.state_dict().items()
    }
    tensors, config = quantized_tensors(state, layers, fmt)
    family = {"flux": comfy.supported_models.Flux, "flux2": comfy.supported_models.Flux2}
    model_config = family[unet_config["image_model"]](for_this_comfyui(unet_config))
    if comfy_reads_comfy_quant():
        tensors, _ = in_form(tensors, config, "comfy_quant")
        model_config.quant_config = {"mixed_ops": True}
    else:
        model_config.layer_quant_config = config
    # the stock loader's choice for quantized files: computed in a manual-cast dtype
    model_config.set_inference_dtype(compute, compute)
    with torch.inference_mode():
        model = model_config.get_model({})
        missing, unexpected = model.diffusion_model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"quantized tiny model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval(), plain


def quantized_flux_patcher(seed: int, fmt: str = "float8_e4m3fn"):
    """A MODEL around the tiny Flux of `quantized_flux_model` (block Linears in ComfyUI's
    quantized Linear, computed in fp32), as a stock loader hands a quantized file over."""
    from .tiny_models import TINY_FLUX_CONFIG, flux_patcher

    return flux_patcher(quantized_flux_model(TINY_FLUX_CONFIG, seed, fmt)[0])
