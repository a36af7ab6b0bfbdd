"""The prefix-lookup service: how many prompt tokens of a request are in the pool.

    wire       versioned msgspec messages and their codecs (no sockets)
    search     the prefix search in store rounds (pure)
    endpoint   endpoint parsing and the lock on an IPC socket path (no sockets)
    answers    ``LookupAnswers``: what a lookup or a reset answers (no sockets)
    server     ``LookupServer``: one per DP engine, those answers over ZMQ from a thread
    client     ``LookupClient``: the scheduler's side, a deadline on every call

``import kvpool.lookup`` imports neither pyzmq nor a store backend; pyzmq is
imported by ``server`` and ``client`` only.
"""
