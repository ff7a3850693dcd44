"""The pack's V3 extension: the one place that lists the nodes ComfyUI registers."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

# Every node id starts with this, so ours can never clash with ComfyUI's or another pack's.
NODE_ID_PREFIX = "KontextTrainer_"


def node_classes() -> list[type[io.ComfyNode]]:
    """The pack's nodes, in menu order. Grows as nodes land (see README, "Nodes")."""
    return []


class KontextTrainerExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return node_classes()


async def comfy_entrypoint() -> KontextTrainerExtension:
    return KontextTrainerExtension()
