"""Test support for Kontext Trainer: a real ComfyUI runtime, tiny models, stock assets.

Nothing here ships with the pack; it is imported by the tests only.
"""
