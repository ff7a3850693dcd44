"""The pack's V3 extension: the one place that lists the nodes ComfyUI registers."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from ..application.node_ids import NODE_ID_PREFIX  # noqa: F401  (re-exported for tests and tools)
from .load_kontext_dataset import LoadKontextDataset
from .multi_image_conditioning import MultiImageConditioning
from .preview_sampler import PreviewSampler
from .progress_route import register_routes
from .train_lora import TrainLoRA


def node_classes() -> list[type[io.ComfyNode]]:
    """The pack's nodes, in menu order. Grows as nodes land (see README, "Nodes")."""
    return [LoadKontextDataset, MultiImageConditioning, TrainLoRA, PreviewSampler]


class KontextTrainerExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return node_classes()


async def comfy_entrypoint() -> KontextTrainerExtension:
    register_routes()
    return KontextTrainerExtension()
