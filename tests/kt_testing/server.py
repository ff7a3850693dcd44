"""The real ComfyUI server subprocess used by the e2e tests (defined in scripts/comfy_server.py,
shared with the demo). It runs with --cpu unless KT_TEST_DEVICE=cuda (or `device="cuda"`)."""

from comfy_server import TEST_DEVICE_ENV, ComfyServer, comfy_device, free_port  # noqa: F401  (re-exported)
