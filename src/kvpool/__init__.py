"""kvpool: a cluster-wide KV-cache pool for LLM inference."""

__version__ = "0.1.0"
