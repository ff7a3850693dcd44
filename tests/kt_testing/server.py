"""The real ComfyUI server subprocess used by the e2e tests (defined in scripts/comfy_server.py,
shared with the demo)."""

from comfy_server import ComfyServer, free_port  # noqa: F401  (re-exported)
