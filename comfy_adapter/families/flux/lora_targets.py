"""Which Linear layers of a Flux transformer get a LoRA: the target presets.

Flux double blocks have separate attention (`img_attn.qkv/proj`, `txt_attn.qkv/proj`), MLP
(`img_mlp.0/2`, `txt_mlp.0/2`) and modulation (`img_mod.lin`, `txt_mod.lin`) layers. Single
blocks fuse attention and MLP: `linear1` computes qkv and the MLP input together, `linear2`
the attention projection and the MLP output together. Their attention cannot be adapted
without their MLP, so every preset includes both fused layers.

FLUX.2 has the same block layers (no biases; its MLPs are SiLU-gated, `mlp.0` twice as wide)
but no per-block modulation: three model-wide layers (`double_stream_modulation_img.lin`,
`double_stream_modulation_txt.lin`, `single_stream_modulation.lin`) modulate every block, and
`all_linear` adapts those instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ....trainer_core.choices import TargetPreset, choose

_ATTENTION = ("img_attn.qkv", "img_attn.proj", "txt_attn.qkv", "txt_attn.proj")
_MLP = ("img_mlp.0", "img_mlp.2", "txt_mlp.0", "txt_mlp.2")
_MODULATION = ("img_mod.lin", "txt_mod.lin")
_SINGLE_FUSED = ("linear1", "linear2")
_SINGLE_MODULATION = ("modulation.lin",)
_GLOBAL_MODULATION = (
    "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.lin",
    "single_stream_modulation.lin",
)

# preset -> (double-block layers, single-block layers, model-wide layers)
TARGET_PRESETS: dict[TargetPreset, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    TargetPreset.ATTENTION: (_ATTENTION, _SINGLE_FUSED, ()),
    TargetPreset.ATTENTION_MLP: (_ATTENTION + _MLP, _SINGLE_FUSED, ()),
    TargetPreset.ALL_LINEAR: (
        _ATTENTION + _MLP + _MODULATION,
        _SINGLE_FUSED + _SINGLE_MODULATION,
        _GLOBAL_MODULATION,
    ),
}


def check_preset(preset: str) -> TargetPreset:
    return choose(TargetPreset, preset, "targets")


def target_module_names(linear_names: Iterable[str], preset: str) -> list[str]:
    """The names among `linear_names` (the model's Linear modules) that `preset` adapts, in
    the model's order."""
    double, single, model_wide = TARGET_PRESETS[check_preset(preset)]
    alternatives = [
        rf"double_blocks\.\d+\.({'|'.join(map(re.escape, double))})",
        rf"single_blocks\.\d+\.({'|'.join(map(re.escape, single))})",
        *map(re.escape, model_wide),
    ]
    pattern = re.compile("|".join(alternatives))
    return [name for name in linear_names if pattern.fullmatch(name)]
