"""What the connector decides that is not vLLM: it imports no vLLM, and its tests
run in the fast tier. ``kvpool.vllm`` adapts vLLM's calls onto it.

    kvpool.connector.identity  what an engine is (layout, key space, block and
                               chunk size) and which of its groups free blocks early
    kvpool.connector.steps     what the scheduler half plans per step and the
                               workers report back (plain records)
    kvpool.connector.planner   the scheduler half: lookups, load and save plans,
                               roles, per-request limits and pins, suppression of
                               failed chunks, blocks held for saves, KV events
    kvpool.connector.costs     load or recompute: a hit is loaded only when its
                               measured load time beats computing its tokens
    kvpool.connector.worker    the worker half: each step's plan into transfer
                               jobs, reopening a lost pool, the report to the
                               scheduler
    kvpool.connector.results   a step's results for vLLM, and the worker half
                               that could not start (``IdleWorker``)
    kvpool.connector.opening   opening the halves on a pool: a tenant's pool, a
                               worker's store (shared memory or not), the
                               scheduler's lookup server and client
    kvpool.connector.shards    a rank's KV tensors cut into the shards it holds
    kvpool.connector.drain     save jobs by request, refused objects to retry, and
                               finished requests whose blocks wait for their saves
    kvpool.connector.counters  a worker's counters as plain data: per interval
                               (for vLLM's stats) and running totals

What a chunk is made of and where a hit may end is the pure core's
(``kvpool.chunks``).
"""
