"""Node ids: every id of ours starts with one prefix, so it can never clash."""

NODE_ID_PREFIX = "KontextTrainer_"


def node_id(name: str) -> str:
    return NODE_ID_PREFIX + name
