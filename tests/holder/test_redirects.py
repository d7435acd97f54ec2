"""No trailing-slash redirects: a 307 would skip authentication and carry
no Cache-Control (H5); an unknown path is a 404 problem instead."""

import hashlib

from tests.holder.conftest import SMALL
from tests.storage.helpers import SCOPE

CID = SMALL.compat_id_hex
KEY = hashlib.sha256(b"k1").hexdigest()


async def test_trailing_slash_redirect_has_no_store(served_as):
    a = served_as("alice")
    for p in ("leases/", f"blocks/{CID}/{SCOPE}/{KEY}/"):
        r = await a.request("POST" if p == "leases/" else "GET", p)
        assert r.status_code >= 400 or r.headers.get("cache-control") == "no-store", (
            p,
            r.status_code,
            dict(r.headers),
        )


async def test_no_redirect_without_a_certificate(served_as):
    # No 307 that would skip authentication: a trailing slash names no resource.
    m = served_as(None)  # no certificate at all
    r = await m.get(f"blocks/{CID}/{SCOPE}/{KEY}/")
    assert r.status_code in (401, 403, 404), (r.status_code, dict(r.headers))
    assert r.headers["cache-control"] == "no-store"
    assert r.headers["content-type"] == "application/problem+json"
