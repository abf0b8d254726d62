"""The KV cache: this rank's shard, prompt caches on disk, and the memory forecast checked
before prefill.
"""
