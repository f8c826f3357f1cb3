"""offloadd's vLLM 0.33 plugin: ``spec_name="OffloaddSpec"``, ``spec_module_path="offloadd.vllm"``.

vLLM is imported only inside this package (the ``vllm`` extra), and only when the spec is
asked for: ``import offloadd.vllm.mirror`` and the other pure modules do not import vLLM.
See ``spec.py`` for the ``kv_connector_extra_config`` keys, ``manager.py`` for the scheduler
side and ``worker.py`` for the ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offloadd.vllm.spec import OffloaddSpec

__all__ = ["OffloaddSpec"]


def __getattr__(name: str) -> Any:
    # vLLM's spec_module_path resolves OffloaddSpec as an attribute of this package.
    if name == "OffloaddSpec":
        from offloadd.vllm.spec import OffloaddSpec

        return OffloaddSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
