"""Where things are: the repo, the ComfyUI root the tests run against, the asset cache
(defined in scripts/comfy_server.py, shared with the demo)."""

from comfy_server import (  # noqa: F401  (re-exported)
    COMFYUI_ENV,
    PACK_DIR_NAME,
    REPO_ROOT,
    asset_cache_dir,
    comfyui_root,
    comfyui_site,
    make_base_directory,
)

# The tests' own node pack (tiny models, probes), installed only into test servers.
TEST_NODE_PACKS = {"kt_test_nodes": REPO_ROOT / "tests" / "kt_test_nodes"}
