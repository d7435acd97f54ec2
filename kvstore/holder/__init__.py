"""The KVSP holder role: blocks and leases over HTTP, served from a TieredStore."""

from ..settings import HolderSettings
from .app import create_app

__all__ = ["HolderSettings", "create_app"]
