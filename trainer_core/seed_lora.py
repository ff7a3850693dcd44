"""Start a new run from an existing LoRA file for the model, whatever tool wrote it.

`read_seed_lora` reads the key formats LoRAs come in (safetensors only):
- kohya (sd-scripts), and ours: `lora_unet_<module with underscores>.lora_down.weight` /
  `.lora_up.weight` / `.alpha`;
- ComfyUI, and this pack's earlier versions: `diffusion_model.<module>.lora_A.weight` /
  `.lora_B.weight` / `.alpha`, the same with `.lora_down` / `.lora_up`, and both without the
  `diffusion_model.` prefix;
- diffusers, ai-toolkit, SimpleTuner: `transformer.<diffusers layer>.lora_A.weight` /
  `.lora_B.weight`, optionally `.alpha`; DiffSynth: the model's names with peft's adapter name,
  `.lora_A.default.weight` / `.lora_B.default.weight`, no alpha; OneTrainer / lycoris: the
  diffusers layer with underscores after `lora_transformer_` / `lycoris_`;
- peft's `base_model.model.` prefix on the model's names (fal's Kontext trainer) or diffusers
  names.

Where a diffusers layer sits in the model is the model family's table (`places`: diffusers
layer -> `Place`); a family without one reads the formats that use the model's own names.

A missing alpha means alpha = rank (scale 1), as ComfyUI and diffusers assume, unless the file's
metadata says otherwise (diffusers' `lora_adapter_metadata`: `transformer.lora_alpha`,
`transformer.alpha_pattern`, `transformer.use_rslora`; ComfyUI's stock loader ignores it).

diffusers layers that ComfyUI's model keeps fused (Flux: q, k, v -> `img_attn.qkv`, ...) become
one LoRA on the fused layer, exactly: lora_A stacks the parts' lora_A
(rank = the sum of the parts' ranks), lora_B places each part's lora_B, times its own
alpha / rank, in the part's rows and columns (block-diagonal), and alpha = rank, so
(alpha / rank) * B @ A is the sum of the parts' deltas, each in its row slice; an absent part
adds zero rows.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .lora_file import LoraModule, load

# (lora_A suffix, lora_B suffix), as the stock loader reads them
_PAIRS = (
    (".lora_A.weight", ".lora_B.weight"),
    (".lora_down.weight", ".lora_up.weight"),
    (".lora.down.weight", ".lora.up.weight"),
    (".lora_A.default.weight", ".lora_B.default.weight"),  # peft's adapter name kept (DiffSynth)
)
_UNDERSCORED = ("lora_unet_", "lora_transformer_", "lycoris_")
_PEFT = "base_model.model."


@dataclass(frozen=True)
class Place:
    """A diffusers layer's place in the model: the model's layer `target`; for a fused target
    the index of its row slice (`part`, of `parts` in row order); `swap_halves` when the two
    halves of the output rows come in the opposite order."""

    target: str
    part: int | None = None
    swap_halves: bool = False
    parts: int = 1


@dataclass
class _Pair:
    stem: str  # the key without its lora_A/lora_B suffix, as the file names it
    down: torch.Tensor
    up: torch.Tensor
    alpha: float
    place: Place


def read_seed_lora(
    path: Path,
    module_names: Sequence[str],
    rank: int,
    shapes: Mapping[str, tuple[int, int]] | None = None,
    places: Mapping[str, Place] | None = None,
) -> dict[str, LoraModule]:
    """The LoRA in the safetensors file `path` as `LoraModule`s (float32) on the modules
    `module_names` (the model's Linear module names, e.g. `double_blocks.0.img_attn.qkv`), in
    model order: the run's targets, with the file's weights, ranks and alphas. `places`: the
    model family's diffusers layer names (see the module docstring).

    Every LoRA layer of the file must have rank `rank` (the TrainLoRA widget). A fused module
    built from diffusers parts has rank = the sum of its parts' ranks (3 * rank for a qkv,
    4 * rank for a single block's linear1 with q, k, v and proj_mlp) and alpha = that rank; the
    stock loader reads each module's rank from its tensors, so such a file saves and loads as is.
    `shapes` (module -> (out_features, in_features)), when given, is checked against every module.

    Raises ValueError, naming the file and what to do, when the file is not a readable
    safetensors file, has no LoRA for the model, names layers this model does not have,
    holds non-LoRA weights (LoKr, LoHa, DoRA, diffs), or its ranks or shapes do not fit.
    Keys of other components (text encoders) are ignored."""
    path = Path(path)
    state, metadata = _read(path)
    names = list(module_names)
    pairs = _pairs(path, state, metadata, names, dict(places or {}))
    _check_ranks(path, pairs, rank)
    modules: dict[str, LoraModule] = {}
    for target, parts in _by_target(path, pairs).items():
        if parts[0].place.part is not None:  # diffusers parts of a layer the model fuses
            modules[target] = _fuse(path, target, parts, shapes)
        else:
            (pair,) = parts
            up = _swap_halves(pair.up) if pair.place.swap_halves else pair.up
            modules[target] = LoraModule(pair.down, up, pair.alpha)
    for target, module in modules.items():
        if shapes is not None and target in shapes:
            _check_shape(path, target, (module.up.shape[0], module.down.shape[1]), shapes[target])
    order = {name: i for i, name in enumerate(names)}
    return dict(sorted(modules.items(), key=lambda item: order[item[0]]))


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if path.suffix.lower() != ".safetensors":
        raise ValueError(
            f"{path}: only .safetensors LoRA files can be a starting point (pickled .ckpt / .pt "
            "files are not read); convert it to safetensors or choose another file"
        )
    try:
        return load(path)
    except Exception as error:  # safetensors raises its own error types for damaged files
        raise ValueError(
            f"{path} could not be read as a safetensors file ({error}); choose another file"
        ) from None


def _split(key: str) -> tuple[str, str, str] | None:
    """(stem, which, suffix) for a LoRA factor key (which: "down" or "up"), else None."""
    for down, up in _PAIRS:
        for which, suffix in (("down", down), ("up", up)):
            if key.endswith(suffix):
                return key[: -len(suffix)], which, suffix
    return None


def _is_transformer_key(key: str, tops: set[str]) -> bool:
    if key.startswith(("diffusion_model.", "transformer.", _PEFT, *_UNDERSCORED)):
        return True
    return key.split(".", 1)[0] in tops  # the model's own names without a prefix


def _place_of(stem: str, ours: set[str], kohya: dict[str, str], diffusers: dict[str, Place]) -> Place | None:
    if stem.startswith(
        _PEFT
    ):  # peft's own prefix, on the model's names (fal's Kontext trainer) or diffusers'
        stem = stem[len(_PEFT) :]
        return Place(stem) if stem in ours else diffusers.get(stem)
    if stem.startswith("diffusion_model."):
        name = stem[len("diffusion_model.") :]
        return Place(name) if name in ours else None
    if stem.startswith("transformer."):
        return diffusers.get(stem[len("transformer.") :])
    for prefix in _UNDERSCORED:
        if stem.startswith(prefix):
            rest = stem[len(prefix) :]
            if rest in kohya:
                return Place(kohya[rest])
            return next((p for name, p in diffusers.items() if name.replace(".", "_") == rest), None)
    return Place(stem) if stem in ours else None


def _examples(names: list[str], diffusers: dict[str, Place]) -> str:
    """Key names this model's LoRA files have, for messages."""
    first = next((n for n in names if re.search(r"\.\d+\.", n)), names[0] if names else "<layer>")
    examples = [
        f"diffusion_model.{first}.lora_A.weight",
        f"lora_unet_{first.replace('.', '_')}.lora_down.weight",
    ]
    if diffusers:
        examples.append(f"transformer.{next(iter(diffusers))}.lora_A.weight")
    return ", ".join(examples[:-1]) + " or " + examples[-1]


def _pairs(path: Path, state, metadata, names: list[str], diffusers: dict[str, Place]) -> list[_Pair]:
    ours, tops = set(names), {name.split(".", 1)[0] for name in names}
    kohya = {name.replace(".", "_"): name for name in names}
    peft_alpha = _peft_alphas(path, metadata)
    pairs, seen = [], []
    for key in sorted(state):
        if not _is_transformer_key(key, tops):
            seen.append(key)
            continue
        split = _split(key)
        if split is None:
            if key.endswith(".alpha"):
                continue  # read with its pair below
            raise ValueError(
                f"{path}: {key} is not a plain LoRA weight (LoKr, LoHa, DoRA and full-weight diffs "
                "cannot seed a run); choose a plain LoRA file (lora_A / lora_B or lora_down / lora_up)"
            )
        stem, which, suffix = split
        down_suffix, up_suffix = next(p for p in _PAIRS if suffix in p)
        if which == "up":
            if stem + down_suffix not in state:
                raise ValueError(
                    f"{path}: {key} has no matching {stem + down_suffix}; the file is incomplete"
                )
            continue
        if stem + up_suffix not in state:
            raise ValueError(f"{path}: {key} has no matching {stem + up_suffix}; the file is incomplete")
        place = _place_of(stem, ours, kohya, diffusers)
        if place is None:
            raise ValueError(
                f"{path}: {key} names a layer this model does not have; the LoRA does not fit this "
                "model (it is for another model family, or for a model with more blocks): choose a LoRA "
                "trained for this model"
            )
        down, up = state[key].float(), state[stem + up_suffix].float()
        if up.shape[1] != down.shape[0]:
            raise ValueError(
                f"{path}: {stem + up_suffix} has {up.shape[1]} columns but {key} has {down.shape[0]} rows; "
                "the file is damaged"
            )
        if f"{stem}.alpha" in state:
            alpha = float(state[f"{stem}.alpha"])
        elif stem.startswith("transformer.") and peft_alpha is not None:
            alpha = peft_alpha(stem[len("transformer.") :], down.shape[0])
        else:
            alpha = float(down.shape[0])
        _check_values(path, key, stem + up_suffix, down, up, f"{stem}.alpha", alpha)
        pairs.append(_Pair(stem, down, up, alpha, place))
    if not pairs:
        few = ", ".join(seen[:5]) or "none"
        raise ValueError(
            f"{path} has no LoRA weights for this model's diffusion model (keys seen: {few}); choose "
            f"a LoRA file for it (keys like {_examples(names, diffusers)})"
        )
    return pairs


def _check_values(path: Path, down_key: str, up_key: str, down, up, alpha_key: str, alpha: float) -> None:
    """A start LoRA's factors are finite and its alpha a finite, non-zero number (alpha 0 scales
    the LoRA to nothing), or a ValueError naming the file and the key."""
    for key, tensor in ((down_key, down), (up_key, up)):
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(
                f"{path}: {key} holds NaN or infinite values (the LoRA is damaged, or its training "
                "diverged); choose another file"
            )
    if not math.isfinite(alpha):
        raise ValueError(
            f"{path}: {alpha_key} is {alpha}; an alpha must be a finite number: choose another file"
        )
    if alpha == 0:
        raise ValueError(
            f"{path}: {alpha_key} is 0, so the LoRA's scale alpha / rank is 0 and it changes nothing; "
            "choose another file, or start from none"
        )


def _peft_alphas(path: Path, metadata: Mapping[str, str]):
    """alpha(diffusers layer, rank) from diffusers' `lora_adapter_metadata`, or None."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError:
        return None
    config = {
        key[len("transformer.") :]: value for key, value in config.items() if key.startswith("transformer.")
    }
    if config.get("use_dora"):
        raise ValueError(
            f"{path} is a DoRA (use_dora in its metadata), which cannot seed a run; choose a plain LoRA"
        )
    if "lora_alpha" not in config:
        return None
    patterns = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora"))

    def alpha(layer: str, rank: int) -> float:
        # peft matches a pattern against the end of the module name, as a regular expression
        value = next(
            (v for p, v in patterns.items() if _matches(p, layer)),
            config["lora_alpha"],
        )
        # rsLoRA scales by alpha / sqrt(rank); as alpha / rank that is alpha * sqrt(rank)
        return float(value) * math.sqrt(rank) if rslora else float(value)

    return alpha


def _matches(pattern: str, layer: str) -> bool:
    try:
        return re.fullmatch(rf"(.*\.)?(?:{pattern})", layer) is not None
    except re.error:
        return pattern == layer


def _check_ranks(path: Path, pairs: list[_Pair], rank: int) -> None:
    ranks = {}
    for pair in pairs:
        ranks.setdefault(pair.down.shape[0], pair.stem)
    if len(ranks) > 1:
        (r1, k1), (r2, k2) = list(ranks.items())[:2]
        raise ValueError(
            f"{path}: the LoRA file mixes ranks ({k1}: {r1}, {k2}: {r2}); only a LoRA with one rank "
            "can seed a run"
        )
    (file_rank,) = ranks
    if file_rank != rank:
        raise ValueError(
            f"{path}: the LoRA file has rank {file_rank} but rank is set to {rank}; set rank to "
            f"{file_rank} to start from it"
        )


def _by_target(path: Path, pairs: list[_Pair]) -> dict[str, list[_Pair]]:
    targets: dict[str, list[_Pair]] = {}
    for pair in pairs:
        group = targets.setdefault(pair.place.target, [])
        clash = next((p for p in group if p.place.part is None or p.place.part == pair.place.part), None)
        if clash is not None or (group and pair.place.part is None):
            other = (clash or group[0]).stem
            raise ValueError(
                f"{path}: {pair.place.target} is given twice ({other} and {pair.stem}); the file mixes "
                "formats, keep one of them"
            )
        group.append(pair)
    return targets


def _fuse(path: Path, target: str, parts: list[_Pair], shapes) -> LoraModule:
    """One LoRA on the fused `target` from its diffusers parts (see the module docstring)."""
    n_parts = parts[0].place.parts
    shape = shapes.get(target) if shapes is not None else None
    hidden = shape[1] if shape is not None else parts[0].down.shape[1]
    # every part is `hidden` rows (q, k, v) but the last, which takes the layer's other rows
    # (Flux's linear1: its MLP input); without the layer's shape, the last part's own rows
    last = next((p.up.shape[0] for p in parts if p.place.part == n_parts - 1), hidden)
    sizes = [hidden] * (n_parts - 1) + [shape[0] - (n_parts - 1) * hidden if shape is not None else last]
    rows = [sum(sizes[:i]) for i in range(n_parts)]
    parts = sorted(parts, key=lambda p: p.place.part)
    for pair in parts:
        expected = (sizes[pair.place.part], hidden)
        _check_shape(path, pair.stem, (pair.up.shape[0], pair.down.shape[1]), expected, f"slice of {target}")
    rank = sum(p.down.shape[0] for p in parts)
    up = torch.zeros(sum(sizes), rank)
    column = 0
    for pair in parts:
        r, row = pair.down.shape[0], rows[pair.place.part]
        up[row : row + pair.up.shape[0], column : column + r] = (pair.alpha / r) * pair.up
        column += r
    return LoraModule(torch.cat([p.down for p in parts]), up, float(rank))


def _check_shape(path: Path, name: str, got, expected, what: str = "layer") -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(
            f"{path}: {name} is a {got[0]}x{got[1]} LoRA but the model's {what} is "
            f"{expected[0]}x{expected[1]} (out x in); the LoRA does not fit this model: choose one "
            "trained for it"
        )


def _swap_halves(up: torch.Tensor) -> torch.Tensor:
    first, second = up.chunk(2, dim=0)
    return torch.cat([second, first])
