"""diffusers reads the LoRA files we write (kohya's Flux keys) as the change we meant.

`FluxPipeline.lora_state_dict` converts a kohya Flux file (`_convert_kohya_flux_lora_to_diffusers`:
fused q/k/v split into diffusers' separate layers, alpha / rank folded into the weights) and
`load_lora_into_transformer` attaches it to a `FluxTransformer2DModel` as peft LoRA layers: what
`FluxPipeline.load_lora_weights` does for the transformer (a pipeline instance would add its text
encoder step, which warns "No LoRA keys associated to CLIPTextModel" for every transformer-only
LoRA). Checked on the pack's default target preset: diffusers logs no warning, every layer of the
file becomes LoRA layers (diffusers' split rules, written out below), and each LoRA layer adds
exactly our (alpha / rank) * up @ down, mapped into diffusers' layout by diffusers' own Flux
checkpoint converter (so the q/k/v split and row order come from diffusers, not from us). Once
for files written by hand (fp32 and bf16) and once for the file of a real multi-reference
(DreamOmni2 layout) training run through ComfyUI's executor.

diffusers' converter hard-codes FLUX.1's widths for a single block's `linear1` (3072 for q, k,
v and 12288 for the MLP), so the model here is FLUX.1-wide (hidden 3072, 24 heads of 128) with
one double and one single block; text and pooled inputs are the tiny CLIP's narrow ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import re
from pathlib import Path

import pytest
import torch

from demo_assets import DEMO_FLUX_CONFIG
from kt_testing.comfy_runtime import from_the_pack
from kt_testing.datasets import write_one_folder
from kt_testing.executor import InGraph, run_node
from kt_testing.graphs import cache_name, dataset_inputs
from kt_testing.tiny_models import build_flux_model, flux_patcher, small_flux_vae, tiny_clip
from trainer_core.config import TrainConfig
from trainer_core.lora_file import SAVE_PRECISIONS, LoraModule, load
from trainer_core.lora_metadata import ModelNames, RunFacts, training_metadata, write_lora

# diffusers reading our files: the same on every ComfyUI (the training run's path is tested on both
# elsewhere); runs once in `make test` (on 0.3.75, in its e2e run: scripts/test.sh)
pytestmark = pytest.mark.version_independent

# FLUX.1's names (comfy_adapter/families/flux)
FLUX1_NAMES = ModelNames(
    "flux1", "flux-1-dev/lora", "flux", "networks.lora_flux", "https://github.com/black-forest-labs/flux"
)

# FLUX.1's width (diffusers' kohya converter needs it), the least depth; context 48 / pooled 32
# as the tiny CLIP makes them (ComfyUI's Flux uses the first vec_in_dim pooled values).
FLUX_3072_CONFIG = {**DEMO_FLUX_CONFIG, "vec_in_dim": 32, "context_in_dim": 48}
# The same model as diffusers configures it (its in_channels are the packed 2x2 patches).
DIFFUSERS_CONFIG = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 48,
    "pooled_projection_dim": 32,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}

# The diffusers layers a Flux layer's LoRA lands on (diffusers' kohya split rules: the fused
# q/k/v layers become one LoRA per part), inside `transformer_blocks.N` / `single_transformer_blocks.N`.
DOUBLE_LAYERS = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn.proj": ("attn.to_out.0",),
    "img_mlp.0": ("ff.net.0.proj",),
    "img_mlp.2": ("ff.net.2",),
    "img_mod.lin": ("norm1.linear",),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn.proj": ("attn.to_add_out",),
    "txt_mlp.0": ("ff_context.net.0.proj",),
    "txt_mlp.2": ("ff_context.net.2",),
    "txt_mod.lin": ("norm1_context.linear",),
}
SINGLE_LAYERS = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation.lin": ("norm.linear",),
}

RANK = 4
BF16_STEP = 2.0**-8  # bf16 keeps 8 significant bits


def target_module_names(linear_names, preset):
    """The Flux family's target presets (the pack's module, as ComfyUI loaded it)."""
    return from_the_pack("comfy_adapter.families.flux.lora_targets").target_module_names(linear_names, preset)


def expected_lora_layers(flux_names) -> set[str]:
    """The diffusers layers that get a LoRA when the Flux layers `flux_names` have one."""
    layers = set()
    for name in flux_names:
        kind, index, layer = name.split(".", 2)
        block, parts = (
            (f"transformer_blocks.{index}", DOUBLE_LAYERS[layer])
            if kind == "double_blocks"
            else (f"single_transformer_blocks.{index}", SINGLE_LAYERS[layer])
        )
        layers.update(f"{block}.{part}" for part in parts)
    return layers


def fill_(module: torch.nn.Module, seed: int) -> None:
    """Cheap reproducible weights for a model ComfyUI built uninitialised: each parameter is a
    block of N(0, 0.02^2) values of prime length, repeated (a fresh draw of 530M values would
    cost seconds; the values only have to be finite and varied)."""
    block = torch.randn(1_000_003, generator=torch.Generator().manual_seed(seed)) * 0.02
    with torch.no_grad():
        for param in module.parameters():
            flat = param.view(-1)
            for start in range(0, flat.numel(), block.numel()):
                end = min(flat.numel(), start + block.numel())
                flat[start:end].copy_(block[: end - start])


def flux_3072(dtype: torch.dtype, seed: int):
    """A `comfy.model_base.Flux` with the config above, built by ComfyUI's own classes."""
    return build_flux_model(FLUX_3072_CONFIG, seed, dtype, init=fill_)


def flux_3072_patcher(seed: int):
    """The MODEL a loader would hand over (fp32: bf16 matmuls are far too slow on this CPU)."""
    return flux_patcher(flux_3072(torch.float32, seed))


@dataclasses.dataclass
class FluxBase:
    targets: list[str]  # Flux layers of the default target preset
    linear: list[str]  # every Linear layer of the Flux model
    shapes: dict[str, torch.Size]  # ComfyUI's Flux state dict: key -> shape
    transformer: torch.nn.Module  # diffusers' FluxTransformer2DModel with the same weights


@pytest.fixture(scope="module")
def flux_base(comfy_runtime):
    """The ComfyUI Flux's target layers and shapes, and diffusers' model of it: its weights
    converted by diffusers' own converter (every key must match), held in fp32 so that a LoRA
    loaded into it keeps fp32 precision (peft casts the adapter to the base layer's dtype)."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    flux = flux_3072(torch.bfloat16, seed=5).diffusion_model
    linear = [name for name, module in flux.named_modules() if isinstance(module, torch.nn.Linear)]
    targets = target_module_names(linear, TrainConfig().targets)
    state = dict(flux.state_dict())
    shapes = {key: value.shape for key, value in state.items()}
    state = bfl_names(state)
    with torch.device("meta"):  # no random init of 530M weights: every one is loaded below
        transformer = FluxTransformer2DModel(**DIFFUSERS_CONFIG)
    transformer = transformer.to_empty(device="cpu")
    transformer.load_state_dict(convert_flux_transformer_checkpoint_to_diffusers(state), strict=True)
    return FluxBase(targets, linear, shapes, transformer.eval())


@contextlib.contextmanager
def diffusers_log(caplog):
    """diffusers' library logger does not propagate to the root logger, where caplog listens:
    give it caplog's handler too (peft's loggers propagate)."""
    library = logging.getLogger("diffusers")
    level = library.level
    library.addHandler(caplog.handler)
    library.setLevel(logging.INFO)
    try:
        yield
    finally:
        library.removeHandler(caplog.handler)
        library.setLevel(level)


def warnings_of(caplog) -> list[str]:
    return [
        f"{record.name}: {record.getMessage()}"
        for record in caplog.records
        if record.levelno >= logging.WARNING and record.name.startswith(("diffusers", "peft"))
    ]


@contextlib.contextmanager
def loaded(transformer, path: Path, caplog):
    """The LoRA file loaded as `FluxPipeline.load_lora_weights` loads it into the transformer
    (kohya conversion, then peft layers), with diffusers' log captured; unloaded afterwards."""
    from diffusers import FluxPipeline

    caplog.clear()
    try:
        with diffusers_log(caplog):
            state = FluxPipeline.lora_state_dict(str(path))
            FluxPipeline.load_lora_into_transformer(state, network_alphas=None, transformer=transformer)
        yield
    finally:
        if lora_layers(transformer):
            transformer.unload_lora()


def lora_layers(transformer) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in transformer.named_modules() if hasattr(module, "lora_A")}


def bfl_names(state: dict) -> dict:
    """A BFL checkpoint's names, which diffusers' converter reads: ComfyUI 0.33's QK-norms hold
    `weight` where the checkpoint (and 0.3.75's module) says `scale`."""
    return {re.sub(r"(query_norm|key_norm)\.weight$", r"\1.scale", k): v for k, v in state.items()}


def diffusers_layout(flux_base: FluxBase, deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`deltas` (Flux layer -> weight change; consumed) as the change of every tensor of
    diffusers' model, mapped by diffusers' own checkpoint converter: zero where no delta."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    zero = torch.zeros(())
    state = {
        key: deltas.pop(key.removesuffix(".weight"), None) if key.endswith(".weight") else None
        for key in flux_base.shapes
    }
    assert not deltas, f"deltas for layers the model lacks: {sorted(deltas)}"
    state = {key: zero.expand(flux_base.shapes[key]) if v is None else v for key, v in state.items()}
    return convert_flux_transformer_checkpoint_to_diffusers(bfl_names(state))


def largest(tensor: torch.Tensor) -> float:
    return torch.linalg.vector_norm(tensor, float("inf")).item()  # max |x| without a temporary


@torch.no_grad()
def lora_errors(
    layers: dict[str, torch.nn.Module], expected: dict[str, torch.Tensor], scales: dict[str, float]
) -> dict[str, float]:
    """Per LoRA layer: what its forward adds to the base layer's (scaling * B @ A, peft's
    `lora_B(lora_A(x)) * scaling`) against the expected change of its weight, as
    max |difference| / max |expected| (`scales`: each expected change's max |x|)."""
    buffer = torch.empty(max(m.base_layer.weight.numel() for m in layers.values()))
    errors = {}
    for name, module in layers.items():
        (adapter,) = module.lora_A.keys()
        assert not module.use_dora[adapter] and not module.merged
        weight = module.base_layer.weight
        change = buffer[: weight.numel()].view(weight.shape)
        torch.mm(module.lora_B[adapter].weight, module.lora_A[adapter].weight, out=change)
        change.mul_(module.scaling[adapter])
        want = expected[f"{name}.weight"]
        scale = scales[f"{name}.weight"]
        errors[name] = largest(change.sub_(want)) / scale if scale > 0 else float("inf")
    return errors


def check_diffusers_reads(flux_base: FluxBase, path: Path, caplog, expectations, targets=None) -> None:
    """Load `path` into diffusers: no warning; a LoRA layer exactly where the split rules put
    one; and each LoRA layer adds the change that each `(make_deltas, tolerance)` of
    `expectations` maps there (Flux-layout deltas made lazily: each set takes 1.4 GB)."""
    with loaded(flux_base.transformer, path, caplog):
        assert warnings_of(caplog) == []
        layers = lora_layers(flux_base.transformer)
        assert set(layers) == expected_lora_layers(targets or flux_base.targets)
        for make_deltas, tolerance in expectations:
            expected = diffusers_layout(flux_base, make_deltas())
            # the change falls on the LoRA layers' weights and nowhere else
            scales = {key: largest(value) for key, value in expected.items()}
            changed = {key for key, scale in scales.items() if scale > 0}
            assert changed == {f"{name}.weight" for name in layers}
            errors = lora_errors(layers, expected, scales)
            del expected
            bad = {name: error for name, error in errors.items() if error > tolerance}
            assert not bad, f"LoRA layers off by more than {tolerance} (relative): {bad}"


def delta(down: torch.Tensor, up: torch.Tensor, alpha: float) -> torch.Tensor:
    """(alpha / rank) * up @ down in fp32: what ComfyUI and kohya apply."""
    return torch.mm(up.float(), down.float()).mul_(alpha / down.shape[0])


def random_modules(flux_base: FluxBase, alpha: float, seed: int, targets=None) -> dict[str, LoraModule]:
    gen = torch.Generator().manual_seed(seed)
    modules = {}
    for name in targets or flux_base.targets:
        out_features, in_features = flux_base.shapes[f"{name}.weight"]
        modules[name] = LoraModule(
            torch.randn(RANK, in_features, generator=gen) * 0.1,
            torch.randn(out_features, RANK, generator=gen) * 0.1,
            alpha,
        )
    return modules


def write_file(path: Path, modules, precision: str, alpha: float) -> Path:
    config = TrainConfig(rank=RANK, alpha=alpha, save_precision=precision)
    facts = RunFacts(path.stem, "flux1_kontext", 1024, 4, 4, "cafe", 1.7e9, 1, FLUX1_NAMES)
    return write_lora(path, modules, training_metadata(config, facts, 10), SAVE_PRECISIONS[precision], 1.7e9)


@pytest.fixture(scope="module")
def dreamomni2_run(comfy_runtime, tmp_path_factory):
    """A real 2-step training run with 2 references per sample in the DreamOmni2 layout,
    through ComfyUI's executor (LoadKontextDataset, then TrainLoRA on the 3072-wide Flux built
    inside the graph like a loader's): the LoRA file it saved."""
    import comfy.model_management
    import folder_paths

    root = write_one_folder(
        tmp_path_factory.mktemp("data") / "set", ["a", "b"], references=2, size=(128, 128)
    )
    vae, clip = InGraph(lambda: small_flux_vae(seed=1)), InGraph(lambda: tiny_clip(seed=2))
    inputs = dataset_inputs(vae, clip, root, cache_name(tmp_path_factory))
    # 128 px targets (8x8 tokens), 16 px references (1 token each): the least the loader takes
    inputs.update(resolution=128, reference_resolution=16)
    dataset = run_node("KontextTrainer_LoadKontextDataset", inputs).outputs[0]
    assert dataset.reference_count == 2

    settings = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    settings.update(steps=2, rank=RANK, alpha=3.0, learning_rate=1e-3, gradient_checkpointing=False)
    settings.update(layout="dreamomni2", seed=0)
    result = run_node(
        "KontextTrainer_TrainLoRA",
        {
            "model": InGraph(lambda: flux_3072_patcher(seed=5)),
            "dataset": dataset,
            "lora_name": "kt_diffusers_dreamomni2",
            "overwrite": True,
            "resume_from": "none",
            "preview": None,
            **settings,
        },
    )
    name, losses = result.outputs[1], result.outputs[2]["loss"]
    # Drop our references to the 2 GB model (the finished job keeps none: trainer_core/job.py).
    del result, dataset
    comfy.model_management.unload_all_models()
    gc.collect()
    assert len(losses) == 2
    return Path(folder_paths.get_folder_paths("loras")[0]) / name, settings


def test_diffusers_applies_a_trained_dreamomni2_file(dreamomni2_run, flux_base, caplog):
    path, settings = dreamomni2_run
    state, metadata = load(path)
    assert metadata["kontext_trainer.layout"] == "dreamomni2"
    # the file: kohya keys for every target layer, trained (up no longer zero), alpha 3
    kohya = {"lora_unet_" + name.replace(".", "_"): name for name in flux_base.targets}
    suffixes = (".lora_down.weight", ".lora_up.weight", ".alpha")
    assert set(state) == {stem + suffix for stem in kohya for suffix in suffixes}
    for stem in kohya:
        assert float(state[f"{stem}.alpha"]) == 3.0 and state[f"{stem}.lora_down.weight"].shape[0] == RANK
        assert state[f"{stem}.lora_up.weight"].abs().max() > 0, stem
        assert state[f"{stem}.lora_down.weight"].dtype == SAVE_PRECISIONS[settings["save_precision"]]

    def file_deltas():
        return {
            name: delta(state[f"{stem}.lora_down.weight"], state[f"{stem}.lora_up.weight"], 3.0)
            for stem, name in kohya.items()
        }

    # alpha / rank = 0.75: diffusers' rescaling of bf16 lora_down rounds once more (see CASES)
    tolerance = 2 * BF16_STEP if settings["save_precision"] == "bf16" else 1e-6
    check_diffusers_reads(flux_base, path, caplog, [(file_deltas, tolerance)])


# fp32 with alpha / rank = 0.75: exact. bf16 with 0.5 (a power of two, so diffusers' rescaling
# of lora_down in bf16 is exact): the file's bf16 values exactly. bf16 with 0.75: diffusers
# multiplies the bf16 lora_down by 0.75 in bf16, one more rounding (< 2^-9 per element).
# On the default preset, and on all_linear (the modulation layers too). (precision, alpha,
# tolerance, target preset)
CASES = {
    "fp32-alpha3": ("fp32", 3.0, 1e-6, None),
    "bf16-alpha2": ("bf16", 2.0, 1e-6, None),
    "bf16-alpha3": ("bf16", 3.0, 2 * BF16_STEP, None),
    "fp32-alpha3-all_linear": ("fp32", 3.0, 1e-6, "all_linear"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_diffusers_applies_our_file_as_our_delta(flux_base, tmp_path, caplog, case):
    precision, alpha, tolerance, preset = CASES[case]
    targets = target_module_names(flux_base.linear, preset) if preset else flux_base.targets
    if preset:
        assert any(name.endswith("mod.lin") for name in targets)  # more than the default preset
    modules = random_modules(flux_base, alpha, seed=11, targets=targets)
    path = write_file(tmp_path / f"kt_{case}.safetensors", modules, precision, alpha)
    dtype = SAVE_PRECISIONS[precision]

    def file_deltas():  # from the values the file holds (rounded to its dtype)
        return {n: delta(m.down.to(dtype), m.up.to(dtype), m.alpha) for n, m in modules.items()}

    def exact_deltas():  # from the values before saving
        return {n: delta(m.down, m.up, m.alpha) for n, m in modules.items()}

    expectations = [(file_deltas, tolerance)]
    if precision != "fp32":
        expectations.append((exact_deltas, 1e-2))  # within bf16 rounding of the intent
    check_diffusers_reads(flux_base, path, caplog, expectations, targets)


def test_a_file_diffusers_cannot_fully_apply_is_reported(flux_base, tmp_path, caplog):
    """The negative control of the warning check: a LoRA for a second double block, which this
    model lacks, is a warning diffusers logs and this file's capture sees."""
    modules = random_modules(flux_base, 3.0, seed=12)
    extra = modules["double_blocks.0.img_attn.proj"]
    modules["double_blocks.1.img_attn.proj"] = LoraModule(extra.down.clone(), extra.up.clone(), 3.0)
    path = write_file(tmp_path / "kt_too_deep.safetensors", modules, "fp32", 3.0)
    with loaded(flux_base.transformer, path, caplog):
        assert any("transformer_blocks.1.attn.to_out.0" in line for line in warnings_of(caplog))
