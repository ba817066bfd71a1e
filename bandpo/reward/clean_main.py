"""Fork-server side: stand in for the program's ``__main__`` so reward workers never import it.

Every worker a fork server starts re-imports the parent's main module first (by path, or
by name under ``python -m``), unless the worker's ``__main__`` already is that module. That
import fails where the main module is no file (``python - <script``: ``<stdin>``) and costs a
full import of the entry script elsewhere. The reward pool preloads this module into its
fork server with the parent's main module described in ``MAIN_ENV`` (see
``bandpo.reward.pool._mp_context``); installing an empty module that carries that path or
name as ``__main__`` makes each worker's check find it "already imported". The workers run
only ``bandpo.reward`` functions, so they need nothing from the real main module.

Importing this module replaces ``__main__``: only the fork server may import it.
"""

import json
import os
import sys
import types
from importlib.machinery import ModuleSpec

MAIN_ENV = "BANDPO_REWARD_POOL_MAIN"  # = bandpo.reward.pool.CLEAN_MAIN_ENV

_info = json.loads(os.environ.get(MAIN_ENV) or "{}")
_stub = types.ModuleType("__mp_main__", "Empty stand-in for the parent's __main__ (bandpo reward pool).")
_stub.__file__ = _info.get("path")
_stub.__spec__ = ModuleSpec(_info["name"], None) if _info.get("name") else None
sys.modules["__main__"] = sys.modules["__mp_main__"] = _stub
