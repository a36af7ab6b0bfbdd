"""vLLM adapter: ``kv_connector_module_path="kvpool.vllm"`` loads ``KVPoolConnector``.

Importing this package imports vLLM; nothing else in kvpool imports it.
"""

from kvpool.vllm.connector import KVPoolConnector

__all__ = ["KVPoolConnector"]
