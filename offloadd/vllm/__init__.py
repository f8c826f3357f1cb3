"""offloadd's vLLM 0.33 plugin: ``spec_name="OffloaddSpec"``, ``spec_module_path="offloadd.vllm"``.

vLLM is imported only inside this package (the ``vllm`` extra). See ``spec.py`` for the
``kv_connector_extra_config`` keys, ``manager.py`` for the scheduler side and ``worker.py`` for
the ranks.
"""

from offloadd.vllm.spec import OffloaddSpec

__all__ = ["OffloaddSpec"]
