"""The KVSP Index Service: where replicas are, and what loading them would cost."""

from ..settings import IndexSettings
from .app import StatusBook, create_app
from .state import IndexFull, IndexState, MemoryState

__all__ = ["IndexFull", "IndexSettings", "IndexState", "MemoryState", "StatusBook", "create_app"]
