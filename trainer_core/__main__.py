"""`python -m trainer_core ...` and `torchrun -m trainer_core ...`: the README's command line,
whose code is `application/cli.py`; this file is only the door to it.

It makes the pack one package, `kontext_trainer`, before any module of it is imported, and makes
this `trainer_core` that package's `kontext_trainer.trainer_core`, so every module of the pack
exists once in the process. The pack's own `__init__.py` (ComfyUI's entry point) runs once the
CLI has booted ComfyUI. This is the one file under trainer_core/ that leads to ComfyUI: only
Python's `-m` runs it, and no module imports it.
"""

import importlib
import importlib.util
import sys
from pathlib import Path

PACKAGE = "kontext_trainer"  # the name the pack is imported under by the command line


def pack_cli():
    """The pack's `application.cli` module, with the pack set up as one package."""
    if PACKAGE not in sys.modules:
        root = Path(__file__).resolve().parents[1]
        spec = importlib.util.spec_from_file_location(
            PACKAGE, root / "__init__.py", submodule_search_locations=[str(root)]
        )
        pack = importlib.util.module_from_spec(spec)  # its __init__.py runs after ComfyUI's boot
        sys.modules[PACKAGE] = pack
        core = sys.modules[__spec__.parent]
        sys.modules[f"{PACKAGE}.trainer_core"] = core
        pack.trainer_core = core
    return importlib.import_module(f"{PACKAGE}.application.cli")


if __name__ == "__main__":
    sys.exit(pack_cli().main())
