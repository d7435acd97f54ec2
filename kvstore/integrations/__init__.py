"""kvstore as the remote tier of other engines' caches (issue 10).

LMCache (``kvstore.integrations.lmcache``) and SGLang's hierarchical cache
(``kvstore.integrations.sglang``) load third-party storage by module path;
both plug-ins sit on :mod:`kvstore.integrations.chunks`, which names an
engine's own chunk or page keys as KVSP blocks and moves them through
:class:`kvstore.client.HolderClient`.

Neither plug-in is imported by anything else in kvstore: each imports its
engine, which kvstore does not depend on.
"""
