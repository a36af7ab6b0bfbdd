"""vLLM adapter: ``kv_connector_module_path="kvpool.vllm"`` loads ``KVPoolConnector``.

Importing this package imports vLLM. Nothing outside it imports it, and only it and
the programs that run an engine (the demo's engine, the CLI's checks that vLLM is
installed) import vLLM: ``tests/unit/test_house_rules.py`` holds both.
"""

from kvpool.vllm.connector import KVPoolConnector

__all__ = ["KVPoolConnector"]
