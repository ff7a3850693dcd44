"""GET /kontext_trainer/progress: the current (or last) training job's state, so a page that
was reloaded mid-run can redraw its panel: the event payload fields plus the losses and every
held-out validation point (`validation`: [[step, loss], ...], few, always all of them).
With no job yet: {"status": "idle"}.

`?since=N` returns only the losses after the first N (`losses_from` says where they start):
the panel fills in the steps between two throttled events without fetching a long run's
million losses again and again."""

from __future__ import annotations

from ..trainer_core.job import MANAGER
from .progress_events import as_the_user_knows

ROUTE = "/kontext_trainer/progress"


def progress_state(since: int = 0) -> dict:
    job = MANAGER.current
    if job is None:
        return {"status": "idle"}
    state = job.state()
    since = min(max(since, 0), len(state["losses"]))
    message = as_the_user_knows(state.get("message") or "")  # as the events show it
    return {**state, "message": message, "losses": state["losses"][since:], "losses_from": since}


def parse_since(value: str | None) -> int:
    try:
        return max(int(value or 0), 0)
    except ValueError:
        return 0


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
        return web.json_response(progress_state(parse_since(request.query.get("since"))))

    return True
