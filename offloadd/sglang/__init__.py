"""offloadd as SGLang 0.5.23's HiCache storage tier (L3), loaded by module path::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "offloadd",
        "module_path": "offloadd.sglang", "class_name": "OffloaddHiCacheStorage",
        "interface_v1": 1, "allocator": "shm"}'

SGLang is imported only when the class is asked for (``storage.py``); ``layout.py`` (page
geometry, namespace config, keys) is pure. See docs/sglang.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offloadd.sglang.storage import OffloaddHiCacheStorage

__all__ = ["OffloaddHiCacheStorage"]


def __getattr__(name: str) -> Any:
    # SGLang's backend factory resolves the class as an attribute of this package.
    if name == "OffloaddHiCacheStorage":
        from offloadd.sglang.storage import OffloaddHiCacheStorage

        return OffloaddHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
