"""LoRA files: kohya's keys, which every tool reads; atomic writes.

A layer's LoRA is three tensors under kohya's name for it (`kohya_name`: sd-scripts' LoRA
networks name a layer `lora_unet_` and its module path with `_` for `.`, e.g.
`lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`): `.lora_down.weight` (rank x in),
`.lora_up.weight` (out x rank) and `.alpha` (a float32 scalar, whatever the save precision: the
scale alpha / rank stays exact). The applied change is W + strength * (alpha / rank) * up @ down
in ComfyUI's stock loaders (`model_lora_keys_unet` maps `lora_unet_*` to the model's weight), in
diffusers (`load_lora_weights` converts kohya files), in Forge and in kohya-format readers.
Underscores make the name ambiguous, so reading one back needs the model's layer names.

Files written by earlier versions (`diffusion_model.<module>.lora_A.weight` / `.lora_B.weight`
/ `.alpha`) still read here and in ComfyUI.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as serialize

from .atomic import write_atomic
from .choices import SavePrecision, choose

# save_precision -> the dtype of the lora_down / lora_up tensors (alpha stays float32)
SAVE_PRECISIONS = {
    SavePrecision.BF16: torch.bfloat16,
    SavePrecision.FP16: torch.float16,
    SavePrecision.FP32: torch.float32,
}
KEY_PREFIX = "diffusion_model."  # the earlier versions' keys
KOHYA_PREFIX = "lora_unet_"


def kohya_name(module_name: str) -> str:
    """kohya's name for a layer of the diffusion model (`double_blocks.0.img_attn.qkv` ->
    `lora_unet_double_blocks_0_img_attn_qkv`). ComfyUI, diffusers and Forge read it."""
    return KOHYA_PREFIX + module_name.replace(".", "_")


@dataclass
class LoraModule:
    down: torch.Tensor  # lora_down (peft's lora_A), (rank, in_features)
    up: torch.Tensor  # lora_up (peft's lora_B), (out_features, rank)
    alpha: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def delta(self) -> torch.Tensor:
        """The full-size weight change (alpha / rank) * B @ A, for checks and merging only."""
        return (self.alpha / self.rank) * (self.up.float() @ self.down.float())


def precision_dtype(save_precision: str) -> torch.dtype:
    return SAVE_PRECISIONS[choose(SavePrecision, save_precision, "save_precision")]


def to_state_dict(
    modules: Mapping[str, LoraModule], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """`modules` maps Flux module names (e.g. `double_blocks.0.img_attn.qkv`) to their LoRA; the
    tensors come out under kohya's names, lora_down and lora_up in `dtype`, alpha in float32."""
    state = {}
    for name, module in modules.items():
        if module.up.shape[1] != module.rank:
            raise ValueError(
                f"{name}: lora_up has {module.up.shape[1]} columns but lora_down has rank {module.rank}"
            )
        key = kohya_name(name)
        state[f"{key}.lora_down.weight"] = module.down.detach().to(dtype).contiguous().cpu()
        state[f"{key}.lora_up.weight"] = module.up.detach().to(dtype).contiguous().cpu()
        state[f"{key}.alpha"] = torch.tensor(float(module.alpha), dtype=torch.float32)
    return state


_PAIRS = ((".lora_A.weight", ".lora_B.weight"), (".lora_down.weight", ".lora_up.weight"))


def from_state_dict(state: Mapping[str, torch.Tensor], module_names: Sequence[str]) -> dict[str, LoraModule]:
    """LoRA modules from a state dict with kohya's names of the model's layers `module_names`
    (what this pack writes) or the earlier versions' `diffusion_model.<module>.lora_A/B` (and
    its `lora_down/lora_up` variant). Tensors keep the file's dtype. A missing alpha means
    alpha = rank, as ComfyUI assumes."""
    kohya = {kohya_name(name): name for name in module_names}
    modules = {}
    for key in state:
        for down_suffix, up_suffix in _PAIRS:
            if not key.endswith(down_suffix):
                continue
            stem = key[: -len(down_suffix)]
            if stem.startswith(KEY_PREFIX):
                name = stem[len(KEY_PREFIX) :]
            elif stem in kohya:
                name = kohya[stem]
            else:
                continue
            up_key = stem + up_suffix
            if up_key not in state:
                raise ValueError(f"the LoRA file has {key} but no {up_key}")
            down, up = state[key], state[up_key]
            alpha_key = f"{stem}.alpha"
            alpha = float(state[alpha_key]) if alpha_key in state else float(down.shape[0])
            modules[name] = LoraModule(down, up, alpha)
    return modules


def save_atomic(
    state: Mapping[str, torch.Tensor],
    path: Path,
    metadata: Mapping[str, str] | None = None,
    replace: bool = True,
) -> Path:
    """Write a safetensors file whole or not at all: a temp file in the same folder, flushed,
    then renamed over the destination. An existing file stays intact if anything fails; the
    new file gets the umask's permissions. With `replace` off an existing file is never
    replaced: FileExistsError (checked at the rename, atomically). The bytes are made first and
    written by Python's own file object, so a failed write is an OSError with the system's error
    number (safetensors' own writer words it in a message that changes between versions)."""
    data = serialize(dict(state), metadata=dict(metadata or {}))
    return write_atomic(path, lambda tmp: tmp.write_bytes(data), replace)


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file (never a pickle)."""
    with safe_open(str(path), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}, dict(handle.metadata() or {})
