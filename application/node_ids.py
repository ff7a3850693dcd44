"""The pack's node type names, as workflows store them: every one starts with one prefix, so it
can never clash with another pack's."""

NODE_ID_PREFIX = "KontextTrainer_"


def node_id(name: str) -> str:
    return NODE_ID_PREFIX + name
