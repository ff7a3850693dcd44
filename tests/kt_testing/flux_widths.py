"""A server whose stock UNETLoader reads a FLUX.1 file's head count (the test pack does it where
FLUX_WIDTHS_ENV is "1"). ComfyUI 0.3.75's detection reads a FLUX.1 file's widths but fixes its
heads at 24, so the narrow demo Flux (`demo_assets.NARROW_FLUX_CONFIG`: 256 wide, 2 heads of 128)
loads through the stock loader only on 0.33, whose detection reads them too. For a file of the
stock widths the hook gives what ComfyUI detected (3072 / 128 = 24); everything after the head
count is ComfyUI's own (the file's form, the model config, the loader's casts)."""

from __future__ import annotations

FLUX_WIDTHS_ENV = "KT_TEST_FLUX_WIDTHS"


def read_flux_widths() -> None:
    """Wrap `comfy.model_detection.detect_unet_config` (which `model_config_from_unet` calls by
    its module name): for a FLUX.1 file, the head count its tensors give (stream width from
    `img_in`, head width from the first block's query norm)."""
    import comfy.model_detection

    detect = comfy.model_detection.detect_unet_config
    if getattr(detect, "reads_flux_widths", False):
        return

    def with_flux_widths(state_dict, key_prefix, *args, **kwargs):
        config = detect(state_dict, key_prefix, *args, **kwargs)
        if not config or config.get("image_model") != "flux":
            return config
        head = state_dict[f"{key_prefix}double_blocks.0.img_attn.norm.query_norm.scale"].shape[0]
        return config | {"num_heads": config["hidden_size"] // head}

    with_flux_widths.reads_flux_widths = True
    comfy.model_detection.detect_unet_config = with_flux_widths
