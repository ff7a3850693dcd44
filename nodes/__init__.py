"""ComfyUI glue: one thin module per node, plus the extension that registers them.

Import inside the pack only relatively: ComfyUI owns the top-level name `nodes`.
"""
