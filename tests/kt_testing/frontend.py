"""JS snippets the browser tests evaluate in the ComfyUI frontend (1.32 with ComfyUI 0.3.75,
1.49 with 0.33)."""

from __future__ import annotations


def extension_registered(name: str, and_also: str = "true") -> str:
    """JS: has the frontend registered extension `name` (and is the expression `and_also` true)?
    (Frontend 1.49's `app.extensions` reads a store that throws until the app has mounted;
    1.32's is a plain list.)"""
    return (
        "() => { try { return !!window.comfyAPI?.app?.app?.extensions"
        f"?.some(e => e.name === '{name}') && ({and_also}) }} catch {{ return false }} }}"
    )
