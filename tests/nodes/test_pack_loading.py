"""The pack loads into the real ComfyUI runtime exactly as ComfyUI loads custom nodes."""

from __future__ import annotations

from pathlib import Path

from kt_testing.comfy_runtime import pack_node_classes
from kt_testing.paths import PACK_DIR_NAME, REPO_ROOT


def test_comfyui_loads_the_pack_through_the_v3_entrypoint(comfy_runtime):
    assert comfy_runtime.pack_loaded
    pack = comfy_runtime.pack_module
    assert callable(pack.comfy_entrypoint)
    assert not hasattr(pack, "NODE_CLASS_MAPPINGS"), "V3 only: no V1 mappings beside comfy_entrypoint"


def test_every_node_is_registered_under_our_prefix(comfy_runtime):
    pack = comfy_runtime.pack_module
    node_list = pack_node_classes(pack)
    prefix = pack.nodes.extension.NODE_ID_PREFIX
    registered = comfy_runtime.nodes.NODE_CLASS_MAPPINGS
    for node_cls in node_list:
        node_id = node_cls.GET_SCHEMA().node_id
        assert node_id.startswith(prefix), node_id
        assert registered[node_id] is node_cls
    ours = {
        k for k, v in registered.items() if getattr(v, "RELATIVE_PYTHON_MODULE", "").endswith(PACK_DIR_NAME)
    }
    assert ours == {n.GET_SCHEMA().node_id for n in node_list}


def test_web_directory_is_registered(comfy_runtime):
    web_dirs = comfy_runtime.nodes.EXTENSION_WEB_DIRS
    assert Path(web_dirs[PACK_DIR_NAME]).resolve() == (REPO_ROOT / "web").resolve()
