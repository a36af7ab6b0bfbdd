"""What the connector decides that is not vLLM: it imports no vLLM, and its tests
run in the fast tier. ``kvpool.vllm`` adapts vLLM's calls onto it.

    kvpool.connector.shards   a rank's KV tensors cut into the shards it holds
    kvpool.connector.drain    save jobs by request, refused objects to retry, and
                              finished requests whose blocks wait for their saves

What a chunk is made of and where a hit may end is the pure core's
(``kvpool.chunks``).
"""
