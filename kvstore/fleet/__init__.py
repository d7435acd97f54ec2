"""The fleet beyond KVSP instances: engines that publish their own KV cache
events (vLLM), bridged into the Index Service as instance residency
(``kvstore events``, docs/events.md)."""
