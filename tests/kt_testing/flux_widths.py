"""Test servers whose stock UNETLoader reads widths from a diffusion-model file where ComfyUI's
detection fixes them at the real model's, so a narrow or tiny test model loads through it.

FLUX.1 (the test pack does it where FLUX_WIDTHS_ENV is "1"): ComfyUI 0.3.75's detection reads
a FLUX.1 file's widths but fixes its heads at 24, so the narrow demo Flux
(`demo_assets.NARROW_FLUX_CONFIG`: 256 wide, 2 heads of 128) loads through the stock loader only
on 0.33, whose detection reads them too. For a file of the stock widths the hook gives what
ComfyUI detected (3072 / 128 = 24); everything after the head count is ComfyUI's own (the file's
form, the model config, the loader's casts). Qwen-Image's widths: `kt_testing.qwen_image`."""

from __future__ import annotations

FLUX_WIDTHS_ENV = "KT_TEST_FLUX_WIDTHS"


def read_widths(image_model: str, widths) -> None:
    """Wrap `comfy.model_detection.detect_unet_config` (which `model_config_from_unet` calls by
    its module name): for a file ComfyUI detects as `image_model`, what
    `widths(state_dict, key_prefix, detected)` returns replaces those keys of the detected
    config. Once per `image_model`."""
    import comfy.model_detection

    detect = comfy.model_detection.detect_unet_config
    if image_model in getattr(detect, "reads_widths_of", ()):
        return

    def with_widths(state_dict, key_prefix, *args, **kwargs):
        config = detect(state_dict, key_prefix, *args, **kwargs)
        if not config or config.get("image_model") != image_model:
            return config
        return config | widths(state_dict, key_prefix, config)

    with_widths.reads_widths_of = (*getattr(detect, "reads_widths_of", ()), image_model)
    comfy.model_detection.detect_unet_config = with_widths


def read_flux_widths() -> None:
    """FLUX.1's head count from the file: stream width over the first block's query-norm width."""

    def heads(state_dict, key_prefix, detected):
        head = state_dict[f"{key_prefix}double_blocks.0.img_attn.norm.query_norm.scale"].shape[0]
        return {"num_heads": detected["hidden_size"] // head}

    read_widths("flux", heads)
