"""scheduling: replay multi-turn agent traces through a vLLM-V1-like engine under KV-cache policies."""
