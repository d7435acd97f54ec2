"""The KVSP holder role: blocks and leases over HTTP, served from a TieredStore."""

from .app import HolderSettings, create_app

__all__ = ["HolderSettings", "create_app"]
