"""GET /kontext_trainer/progress: the current (or last) training job's state, so a page that
was reloaded mid-run can redraw its panel: the event payload fields plus every loss so far.
With no job yet: {"status": "idle"}."""

from __future__ import annotations

from .training_job import MANAGER

ROUTE = "/kontext_trainer/progress"


def progress_state() -> dict:
    job = MANAGER.current
    return {"status": "idle"} if job is None else job.state()


_registered = False


def register_routes() -> bool:
    """Add the route to ComfyUI's server (once); False when there is no server (library use)."""
    global _registered
    from aiohttp import web
    from server import PromptServer

    server = getattr(PromptServer, "instance", None)
    if server is None or _registered:
        return _registered
    _registered = True

    @server.routes.get(ROUTE)
    async def progress(request):
        return web.json_response(progress_state())

    return True
