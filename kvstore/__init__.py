"""kvstore: a KV Cache Storage Protocol (KVSP) implementation."""

__version__ = "0.1.0"
