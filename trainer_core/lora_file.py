"""LoRA files: keys the stock LoraLoader applies, kohya-style metadata, atomic writes.

Keys are `diffusion_model.<module>.lora_A.weight` (rank x in), `.lora_B.weight` (out x rank)
and `.alpha` (a scalar): ComfyUI's `model_lora_keys_unet` maps `diffusion_model.<module>` to
the Flux weight `<module>.weight` and applies W + strength * (alpha / rank) * B @ A.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .atomic import write_atomic

KEY_PREFIX = "diffusion_model."


@dataclass
class LoraModule:
    down: torch.Tensor  # lora_A, (rank, in_features)
    up: torch.Tensor  # lora_B, (out_features, rank)
    alpha: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def delta(self) -> torch.Tensor:
        """The full-size weight change (alpha / rank) * B @ A, for checks and merging only."""
        return (self.alpha / self.rank) * (self.up.float() @ self.down.float())


def to_state_dict(
    modules: Mapping[str, LoraModule], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """`modules` maps Flux module names (e.g. `double_blocks.0.img_attn.qkv`) to their LoRA."""
    state = {}
    for name, module in modules.items():
        if module.up.shape[1] != module.rank:
            raise ValueError(
                f"{name}: lora_B has {module.up.shape[1]} columns but lora_A has rank {module.rank}"
            )
        key = KEY_PREFIX + name
        state[f"{key}.lora_A.weight"] = module.down.detach().to(dtype).contiguous().cpu()
        state[f"{key}.lora_B.weight"] = module.up.detach().to(dtype).contiguous().cpu()
        state[f"{key}.alpha"] = torch.tensor(float(module.alpha))
    return state


_PAIRS = ((".lora_A.weight", ".lora_B.weight"), (".lora_down.weight", ".lora_up.weight"))
KOHYA_PREFIX = "lora_unet_"


def from_state_dict(
    state: Mapping[str, torch.Tensor], module_names: Sequence[str] = ()
) -> dict[str, LoraModule]:
    """LoRA modules from a state dict in our format (`diffusion_model.<module>.lora_A/B`),
    its `lora_down/lora_up` variant, or kohya's `lora_unet_<module_with_underscores>` (which
    needs the model's `module_names` to undo the underscores). A missing alpha means alpha =
    rank, as ComfyUI assumes."""
    kohya = {KOHYA_PREFIX + name.replace(".", "_"): name for name in module_names}
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


def kohya_metadata(
    rank: int,
    alpha: float,
    base_model: str,
    steps: int,
    resolution: int,
    extra: Mapping[str, object] | None = None,
) -> dict[str, str]:
    """kohya-style `ss_*` fields that LoRA browsers read, plus ours under `kontext_trainer.*`
    (layout, targets, sampler, trainer version, dataset hash, ...). All values are strings."""
    metadata = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(alpha),
        "ss_base_model_version": base_model,
        "ss_steps": str(steps),
        "ss_resolution": f"({resolution}, {resolution})",
    }
    for key, value in (extra or {}).items():
        metadata[f"kontext_trainer.{key}"] = value if isinstance(value, str) else json.dumps(value)
    return metadata


def save_atomic(
    state: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write a safetensors file whole or not at all: a temp file in the same folder, flushed,
    then renamed over the destination. An existing file stays intact if anything fails; the
    new file gets the umask's permissions."""
    return write_atomic(path, lambda tmp: save_file(dict(state), str(tmp), metadata=dict(metadata or {})))


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file (never a pickle)."""
    with safe_open(str(path), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}, dict(handle.metadata() or {})
