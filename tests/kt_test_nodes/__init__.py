"""A test-only custom-node pack, installed only into the e2e tests' ComfyUI (never shipped):
nodes that build the tiny Flux, the small Flux VAE and the tiny CLIP with ComfyUI's own
classes, and their FLUX.2 counterparts (tiny FLUX.2, a VAE with FLUX.2's latents, a CLIP
without pooled output), so the product's nodes run unchanged, fast, in a real server. Plus
probes."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import torch

_TESTS = Path(__file__).resolve().parents[1]
for _path in (_TESTS, _TESTS.parent / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from kt_testing.probes import model_output  # noqa: E402
from kt_testing.tiny_models import (  # noqa: E402
    small_flux2_vae,
    small_flux_vae,
    tiny_clip,
    tiny_flux2_patcher,
    tiny_flux_patcher,
)


class TinyFluxModel:
    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 3, "min": 0, "max": 1000})}}

    def build(self, seed):
        return (tiny_flux_patcher(seed=seed),)


class SmallFluxVAE:
    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ("VAE",)
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 1, "min": 0, "max": 1000})}}

    def build(self, seed):
        return (small_flux_vae(seed=seed),)


class TinyCLIP:
    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ("CLIP",)
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 2, "min": 0, "max": 1000})}}

    def build(self, seed):
        return (tiny_clip(seed=seed),)


class TinyFlux2Model:
    """Stands in for UNETLoader with a FLUX.2 [dev] file (ComfyUI's image_model flux2)."""

    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 3, "min": 0, "max": 1000})}}

    def build(self, seed):
        return (tiny_flux2_patcher(seed=seed),)


class SmallFlux2VAE:
    """Stands in for VAELoader with FLUX.2's VAE: 128 latent channels at 1/16."""

    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ("VAE",)
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 1, "min": 0, "max": 1000})}}

    def build(self, seed):
        return (small_flux2_vae(seed=seed),)


class TinyFlux2TextEncoder:
    """Stands in for CLIPLoader type flux2 (Mistral-3): a tiny CLIP with no pooled output,
    its 48-wide context matching the tiny FLUX.2's context_in_dim."""

    CATEGORY = "kontext trainer tests"
    RETURN_TYPES = ("CLIP",)
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 2, "min": 0, "max": 1000})}}

    def build(self, seed):
        return (tiny_clip(seed=seed, pooled=False),)


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


NODE_CLASS_MAPPINGS = {
    "KTTest_TinyFluxModel": TinyFluxModel,
    "KTTest_SmallFluxVAE": SmallFluxVAE,
    "KTTest_TinyCLIP": TinyCLIP,
    "KTTest_TinyFlux2Model": TinyFlux2Model,
    "KTTest_SmallFlux2VAE": SmallFlux2VAE,
    "KTTest_TinyFlux2TextEncoder": TinyFlux2TextEncoder,
    "KTTest_PoisonDataset": PoisonDataset,
    "KTTest_FailingDataset": FailingDataset,
    "KTTest_ModelDifference": ModelDifference,
}
