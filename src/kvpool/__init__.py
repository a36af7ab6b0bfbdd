"""kvpool: a shared KV-cache pool for vLLM engines on Mooncake Store.

Core modules (pure, no I/O): ``layout`` (who holds, writes and reads what),
``keys`` (key schema and fingerprint), ``plan`` (whole-layout plans).
Importing ``kvpool`` imports nothing heavy.
"""

__version__ = "0.1.0"
