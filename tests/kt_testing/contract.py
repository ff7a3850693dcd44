"""The cast contract (comfy_adapter/cast_contract.py) set by hand for comparisons: the tests'
and benches' runs that show what the contract costs or prevents take the session's plan out of
its hands here, in one place."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def contract_as(lora_session, plan):
    """Sessions started inside (`lora_session`: the pack's `comfy_adapter.lora_session` module)
    install the cast contract as `plan` (e.g. `cast_contract.ALWAYS`: on every casting Linear,
    as where ComfyUI reuses cast memory) instead of their own plan; `plan` None: no contract at
    all, autograd keeps every cast (70adb75's behaviour)."""
    install = lora_session.recast_in_backward
    if plan is None:
        lora_session.recast_in_backward = lambda module, planned: lambda: None
    else:
        lora_session.recast_in_backward = lambda module, planned: install(module, plan)
    try:
        yield
    finally:
        lora_session.recast_in_backward = install
