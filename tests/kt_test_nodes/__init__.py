"""A test-only custom-node pack, installed only into the e2e tests' ComfyUI (never shipped):
nodes that build the tiny Flux, the small Flux VAE and the tiny CLIP with ComfyUI's own
classes, and their FLUX.2 counterparts (tiny FLUX.2, a VAE with FLUX.2's latents, a CLIP
without pooled output), so the product's nodes run unchanged, fast, in a real server. Plus
probes."""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import sys
from pathlib import Path

import torch

_TESTS = Path(__file__).resolve().parents[1]
for _path in (_TESTS, _TESTS.parent / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from kt_testing.bad_files import BREAK_KINDS, break_folder_after_writes  # noqa: E402
from kt_testing.cast_replay import CAST_REPLAY_ENV, REPLAYED, replay  # noqa: E402
from kt_testing.device_moves import DEVICE_MOVES_ENV, emulate_everywhere  # noqa: E402
from kt_testing.dynamic_vram import (  # noqa: E402
    DYNAMIC_VRAM_ENV,
    EMULATION_MARK,
    GEOMETRY,
    AnonymousPeak,
    emulate,
    mapped_weights,
)
from kt_testing.flux_widths import FLUX_WIDTHS_ENV, read_flux_widths  # noqa: E402
from kt_testing.klein import klein_patcher, klein_text_encoder  # noqa: E402
from kt_testing.probes import model_output  # noqa: E402
from kt_testing.qwen_image import (  # noqa: E402
    QWEN_WIDTHS_ENV,
    read_qwen_widths,
    small_wan_vae,
    tiny_qwen_image_clip,
)
from kt_testing.tiny_models import (  # noqa: E402
    small_flux2_vae,
    small_flux_vae,
    tiny_clip,
    tiny_flux2_patcher,
    tiny_flux_patcher,
)


def _builder_node(return_type: str, build, seed: int, doc: str):
    """A node with one `seed` widget whose output is `build(seed=seed)`: a stand-in for a stock
    loader that builds its tiny part with ComfyUI's own classes."""

    class Builder:
        __doc__ = doc
        CATEGORY = "kontext trainer tests"
        RETURN_TYPES = (return_type,)
        FUNCTION = "build"

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"seed": ("INT", {"default": seed, "min": 0, "max": 1000})}}

        def build(self, seed):
            return (build(seed=seed),)

    return Builder


TinyFluxModel = _builder_node("MODEL", tiny_flux_patcher, 3, "Stands in for UNETLoader: a tiny FLUX.1.")
SmallFluxVAE = _builder_node("VAE", small_flux_vae, 1, "Stands in for VAELoader: FLUX.1's latents.")
TinyCLIP = _builder_node("CLIP", tiny_clip, 2, "Stands in for the FLUX.1 text encoders.")
TinyFlux2Model = _builder_node(
    "MODEL", tiny_flux2_patcher, 3, "Stands in for UNETLoader with a FLUX.2 [dev] file (image_model flux2)."
)
SmallFlux2VAE = _builder_node(
    "VAE", small_flux2_vae, 1, "Stands in for VAELoader with FLUX.2's VAE: 128 latent channels at 1/16."
)
TinyQwenImageTextEncoder = _builder_node(
    "CLIP",
    tiny_qwen_image_clip,
    2,
    "Stands in for CLIPLoader type qwen_image: a narrow Qwen2.5-VL with a small vision tower.",
)
SmallWanVAE = _builder_node(
    "VAE", small_wan_vae, 1, "Stands in for VAELoader with Qwen-Image's VAE (Wan 2.1)."
)
TinyFlux2TextEncoder = _builder_node(
    "CLIP",
    functools.partial(tiny_clip, pooled=False),
    2,
    "Stands in for CLIPLoader type flux2 (Mistral-3): a tiny CLIP with no pooled output, its "
    "48-wide context matching the tiny FLUX.2's context_in_dim.",
)


class PoisonDataset:
    """Replaces one training sample's target latent with NaN (a broken image's effect)."""

    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ("KONTEXT_DATASET",)
    FUNCTION = "poison"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"dataset": ("KONTEXT_DATASET",), "index": ("INT", {"default": 1, "min": 0})}}

    def poison(self, dataset, index):
        entries = list(dataset.entries)
        latent = dataset.cache.load("latents", entries[index].target_key)["latent"]
        key = "0" * 63 + "f"
        dataset.cache.put("latents", key, {"latent": torch.full_like(latent, float("nan"))})
        entries[index] = dataclasses.replace(entries[index], target_key=key)
        return (dataclasses.replace(dataset, entries=entries),)


class FailingDataset:
    """The same dataset (same content hash: a resume accepts it) whose sample reads fail after
    `after_reads` of them, as a disk that goes away mid-run would."""

    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ("KONTEXT_DATASET",)
    FUNCTION = "wrap"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"dataset": ("KONTEXT_DATASET",), "after_reads": ("INT", {"default": 0, "min": 0})}
        }

    def wrap(self, dataset, after_reads):
        reads = []

        def sample(self, entry, **kwargs):
            reads.append(entry.name)
            if len(reads) > after_reads:
                raise OSError(f"kt test: reading sample {entry.name} failed")
            return type(dataset).sample(self, entry, **kwargs)

        failing = copy.copy(dataset)
        failing.__class__ = type("FailingDataset", (type(dataset),), {"sample": sample})
        return (failing,)


class DiskFull:
    """Passes the MODEL through, and from now on lets the pack serialize `after_writes` more
    safetensors files (LoRAs, snapshots, checkpoint parts, cache entries); before the next one
    it fills the real file system that holds `folder` (a small tmpfs the test mounted:
    `kt_testing.small_disk`) with a filler file, so that write fails as a full disk fails.
    `after_writes` -1: the filler goes, room again."""

    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "fill"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL",),
                "after_writes": ("INT", {"default": 0, "min": -1}),
                "folder": ("STRING", {"default": ""}),
            },
            # the dataset's node runs first (its cache writes are not counted)
            "optional": {"after": ("KONTEXT_DATASET",)},
        }

    def fill(self, model, after_writes, folder, after=None):
        from kt_testing.small_disk import FILLER, fill_up

        (module,) = [m for name, m in sys.modules.items() if name.endswith("trainer_core.lora_file")]
        original = getattr(module, "_kt_original_serialize", module.serialize)
        module._kt_original_serialize = original
        filler = Path(folder) / FILLER
        if after_writes < 0:
            module.serialize = original
            filler.unlink(missing_ok=True)
            return (model,)
        writes = []

        def serialize(*args, **kwargs):
            writes.append(1)
            if len(writes) == after_writes + 1:
                fill_up(filler)
            return original(*args, **kwargs)

        module.serialize = serialize
        return (model,)


class BreakFolder:
    """Passes the MODEL through; once the pack has written `after_writes` more safetensors files,
    ComfyUI's first `folder` path ("loras": models/loras) is moved aside and a file, or a link to
    a missing place, put where it was (`kt_testing.bad_files.break_folder_after_writes`; 0: now).
    The test puts it back (`restore_folder`)."""

    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "arm"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL",),
                "folder": ("STRING", {"default": "loras"}),
                "after_writes": ("INT", {"default": 0, "min": 0}),
                "kind": (list(BREAK_KINDS),),
            }
        }

    def arm(self, model, folder, after_writes, kind):
        import folder_paths

        (module,) = [m for name, m in sys.modules.items() if name.endswith("trainer_core.lora_file")]
        target = Path(folder_paths.get_folder_paths(folder)[0])
        break_folder_after_writes(module, target, after_writes, kind)
        return (model,)


class LoraPatches:
    """How many weight keys `model` has patched beyond `base`, the largest difference of their
    outputs (`output_on_its_device`: any FLUX.1, on its own load device, a GPU too), and that
    device (UI output)."""

    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ()
    FUNCTION = "compare"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "base": ("MODEL",)}}

    def compare(self, model, base):
        from kt_testing.probes import output_on_its_device

        added = set(model.patches) - set(base.patches)
        with_lora, without = output_on_its_device(model), output_on_its_device(base)
        return {
            "ui": {
                "patched_keys": [len(added)],
                "difference": [float((with_lora - without).abs().max())],
                "device": [str(model.load_device)],
            }
        }


class ModelDifference:
    """Max |difference| of two MODELs' outputs on a fixed input, shown as UI output."""

    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ()
    FUNCTION = "compare"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model_a": ("MODEL",), "model_b": ("MODEL",)}}

    def compare(self, model_a, model_b):
        outputs = [model_output(m, text=(77, 48), pooled=48) for m in (model_a, model_b)]
        return {"ui": {"difference": [float((outputs[0] - outputs[1]).abs().max())]}}


if os.environ.get(DEVICE_MOVES_ENV) == "1":  # this server's loads move weights as onto a GPU
    emulate_everywhere()
    logging.getLogger(__name__).warning(
        "kt test: loads move weights as onto a GPU (every ModelPatcher, on load and unload)"
    )


if os.environ.get(CAST_REPLAY_ENV):  # this server's casts reuse memory as 0.33's do on NVIDIA
    _REPLAY = replay(os.environ[CAST_REPLAY_ENV])  # held: a dropped one would close and undo itself
    _REPLAY.__enter__()  # for the server's lifetime
    logging.getLogger(__name__).warning(
        "kt test: casts of modules over 16 KiB reuse one buffer (%s)", os.environ[CAST_REPLAY_ENV]
    )


if os.environ.get(FLUX_WIDTHS_ENV) == "1":  # this server's UNETLoader loads the narrow demo Flux
    read_flux_widths()
    logging.getLogger(__name__).warning("kt test: UNETLoader reads FLUX.1 head counts from the file")


if os.environ.get(QWEN_WIDTHS_ENV) == "1":  # this server's UNETLoader loads the tiny Qwen's files
    read_qwen_widths()
    logging.getLogger(__name__).warning("kt test: UNETLoader reads Qwen-Image widths from the file")


if os.environ.get(DYNAMIC_VRAM_ENV) == "1":  # this server loads as 0.33 does on NVIDIA
    emulate()
    logging.getLogger(__name__).warning("%s (mapped weights, ModelPatcherDynamic)", EMULATION_MARK)

_ANON_PEAK = AnonymousPeak()


def _report_node(doc: str, report, takes_model: bool = False):
    """An output node showing `report(...)` (a dict of values) as UI output, one list per key;
    with `takes_model` it reads a MODEL input, otherwise it runs every time it is queued."""
    inputs = {"model": ("MODEL",)} if takes_model else {}

    class Report:
        __doc__ = doc
        CATEGORY = "kontext trainer tests"
        RETURN_TYPES = ()
        FUNCTION = "show"
        OUTPUT_NODE = True

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {**inputs, "nonce": ("INT", {"default": 0, "min": 0})}}

        def show(self, nonce, model=None):
            values = report(model) if takes_model else report()
            return {"ui": {key: v if isinstance(v, list) else [v] for key, v in values.items()}}

    if not takes_model:
        Report.IS_CHANGED = classmethod(lambda cls, nonce: float("nan"))  # always runs
    return Report


def _vbar_loads() -> dict:
    loads = [", ".join(f"{d}: {dtypes.count(d)}" for d in sorted(set(dtypes))) for dtypes in GEOMETRY]
    GEOMETRY.clear()
    return {"loads": loads}


MappedWeights = _report_node(
    "How a MODEL holds its weights (`kt_testing.dynamic_vram.mapped_weights`).", mapped_weights, True
)
VbarGeometry = _report_node(
    "The dynamic loads since this node last ran (emulated dynamic VRAM): for each, how many streamed "
    'weights would get vbar pages of each dtype ("torch.bfloat16: 13").',
    _vbar_loads,
)
AnonymousMemory = _report_node(
    "This server's base and peak anonymous memory (RssAnon, KiB) since this node last ran; then it "
    "starts measuring again.",
    lambda: _ANON_PEAK.reset(),
)


class CastReplayCount:
    """This server's cast replay counts so far (`kt_testing.cast_replay.REPLAYED`, UI output): casts
    handed out in reused memory, layers marked, and of them quantized."""

    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ()
    FUNCTION = "count"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"nonce": ("INT", {"default": 0, "min": 0})}}

    @classmethod
    def IS_CHANGED(cls, nonce):
        return float("nan")  # always runs

    def count(self, nonce):
        return {"ui": {key: [value] for key, value in REPLAYED.items()}}


class LatentDigest:
    """A LATENT's sum and absolute sum, shown as UI output (to compare two samplings)."""

    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ()
    FUNCTION = "digest"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",)}}

    def digest(self, samples):
        latent = samples["samples"].double()
        return {"ui": {"digest": [float(latent.sum()), float(latent.abs().sum())]}}


TinyKleinModel = _builder_node(
    "MODEL",
    klein_patcher,
    3,
    "Stands in for UNETLoader with a FLUX.2 [klein] file where ComfyUI's own loader cannot build "
    "one (0.3.75): the tiny klein, built with ComfyUI's classes.",
)
TinyKleinTextEncoder = _builder_node(
    "CLIP",
    klein_text_encoder,
    2,
    "Stands in for CLIPLoader type flux2 with a Qwen3-4B file: a tiny Qwen3 through ComfyUI's klein "
    "text encoder (0.33), or as Z-Image's text encoder where ComfyUI has no klein one (0.3.75).",
)


NODE_CLASS_MAPPINGS = {
    "KTTest_TinyFluxModel": TinyFluxModel,
    "KTTest_SmallFluxVAE": SmallFluxVAE,
    "KTTest_TinyCLIP": TinyCLIP,
    "KTTest_TinyFlux2Model": TinyFlux2Model,
    "KTTest_SmallFlux2VAE": SmallFlux2VAE,
    "KTTest_TinyFlux2TextEncoder": TinyFlux2TextEncoder,
    "KTTest_TinyKleinModel": TinyKleinModel,
    "KTTest_TinyKleinTextEncoder": TinyKleinTextEncoder,
    "KTTest_TinyQwenImageTextEncoder": TinyQwenImageTextEncoder,
    "KTTest_SmallWanVAE": SmallWanVAE,
    "KTTest_PoisonDataset": PoisonDataset,
    "KTTest_FailingDataset": FailingDataset,
    "KTTest_DiskFull": DiskFull,
    "KTTest_BreakFolder": BreakFolder,
    "KTTest_ModelDifference": ModelDifference,
    "KTTest_LoraPatches": LoraPatches,
    "KTTest_MappedWeights": MappedWeights,
    "KTTest_AnonymousMemory": AnonymousMemory,
    "KTTest_VbarGeometry": VbarGeometry,
    "KTTest_LatentDigest": LatentDigest,
    "KTTest_CastReplayCount": CastReplayCount,
}
