"""A whole deployment on one machine, and the scenarios it shows (``kvstore demo``).

:class:`Cluster` starts real processes on loopback, all over mutual TLS with
development certificates: a holder ``h1`` (the shared cache server), one
process with the Index Service and the Placement Controller, and inference
instances ``a`` and ``b`` (``--roles holder,instance``: each serves and
publishes its own tiers) on the reference engine, which write every
completed block to ``h1`` too, so that it survives them (CK1).

The scenarios drive it as a front end would (:class:`~kvstore.client.FrontEnd`)
and return what happened; the end-to-end tests assert on it, and
``kvstore demo`` prints it.

- :func:`prefix_reuse`: ``a`` serves a prompt; ``b``, placed by the PC for
  a prompt sharing its prefix, prefetches the prefix and recomputes only the
  rest (PL1, PL2, PF1, CK6's loading).
- :func:`migration`: ``a`` is killed (SIGKILL) in the middle of a session;
  the PC sees its status expire, moves the session to ``b`` with a new
  epoch, and the front end's output goes on there, each index once (CK3-CK7).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .protocol.keys import block_keys, scope_id

INSTANCES = ("a", "b")
SCOPE_KEY = bytes(range(32))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}:\n{log.read_text()[-4000:]}")


@dataclass
class Node:
    name: str
    roles: str
    port: int
    config: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvstore",
                    "serve",
                    "--roles",
                    self.roles,
                    "--config",
                    str(self.config),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_for_port(self.port, timeout, self.log)

    def kill(self) -> None:
        """SIGKILL: nothing of the process gets to run."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=20)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class Cluster:
    root: Path
    #: Least time between a session's tokens (so that a kill lands mid-way).
    token_interval_ms: float = 0.0
    status_ttl_ms: int = 1500
    block_tokens: int = 16
    instances: tuple[str, ...] = INSTANCES
    nodes: dict[str, Node] = field(default_factory=dict)
    uris: dict[str, str] = field(default_factory=dict)
    engine: Any = None

    @property
    def scope_id(self) -> str:
        return scope_id(SCOPE_KEY).hex()

    def prepare(self) -> None:
        from .instance.reference import ReferenceEngine
        from .security import create_dev_certificates

        root = self.root
        root.mkdir(parents=True, exist_ok=True)
        create_dev_certificates(root / "certs", ["pc", "h1", *self.instances, "frontend", "ops"])
        # One set of weights for every instance: same files, same compat_id.
        self.engine = ReferenceEngine(root / "engine", block_tokens=self.block_tokens)
        descriptor = self.engine.descriptor.to_json()
        (root / "descriptor.json").write_text(json.dumps(descriptor))
        (root / "scope.key").write_text(SCOPE_KEY.hex() + "\n")
        ports = {name: free_port() for name in ("control", "h1", *self.instances)}
        base = {name: f"https://127.0.0.1:{port}" for name, port in ports.items()}
        uris = self.uris
        uris.update(
            index=f"{base['control']}/is/", pc=f"{base['control']}/pc/", h1=f"{base['h1']}/kvsp/"
        )
        for name in self.instances:
            uris[name] = f"{base[name]}/ii/"
            uris[f"{name}-holder"] = f"{base[name]}/kvsp/"
        principals: dict[str, Any] = {
            "urn:kvstore:pc": {"roles": ["pc"], "read_scopes": ["*"]},
            "urn:kvstore:h1": {"roles": ["holder"], "holder": uris["h1"], "write_scopes": ["*"]},
            "urn:kvstore:frontend": {"read_scopes": ["*"], "write_scopes": ["*"]},
            "urn:kvstore:ops": {"roles": ["admin"], "read_scopes": ["*"]},
        }
        for name in self.instances:
            principals[f"urn:kvstore:{name}"] = {
                "roles": ["instance", "holder"],
                "instance": uris[name],
                "holder": uris[f"{name}-holder"],
                "read_scopes": ["*"],
                "write_scopes": ["*"],
            }
        (root / "policy.json").write_text(json.dumps({"principals": principals}, indent=1))

        def server(port: int) -> str:
            return (
                f'[server]\nhost = "127.0.0.1"\nport = {port}\n'
                'certfile = "certs/server.pem"\nkeyfile = "certs/server.key"\n'
                'cafile = "certs/ca.pem"\n'
            )

        def cert(name: str) -> str:
            return (
                f'client_certfile = "certs/client-{name}.pem"\n'
                f'client_keyfile = "certs/client-{name}.key"\n'
            )

        tiers = '[[storage.tiers]]\nbackend = "host"\ncapacity = 268435456\n'
        configs = {
            "control": server(ports["control"])
            + f'[index]\nuri = "{uris["index"]}"\npolicy = "policy.json"\n'
            + 'descriptors = ["descriptor.json"]\n'
            + f'[controller]\nuri = "{uris["pc"]}"\npolicy = "policy.json"\n'
            + f'index_uri = "{uris["index"]}"\ndescriptors = ["descriptor.json"]\n'
            + "prefetch = true\nprefetch_deadline_ms = 3000\nmigrate_interval_s = 0.2\n"
            + cert("pc"),
            "h1": server(ports["h1"])
            + f'[holder]\nuri = "{uris["h1"]}"\npolicy = "policy.json"\n'
            + f'index_uri = "{uris["index"]}"\n'
            + cert("h1")
            + tiers,
        }
        for name in self.instances:
            configs[name] = (
                server(ports[name])
                + f'[holder]\nuri = "{uris[name + "-holder"]}"\npolicy = "policy.json"\n'
                + f'index_uri = "{uris["index"]}"\n'
                + cert(name)
                + f'[instance]\nuri = "{uris[name]}"\npolicy = "policy.json"\n'
                + f'controller_uri = "{uris["pc"]}"\nindex_uri = "{uris["index"]}"\n'
                + cert(name)
                + f"status_ttl_ms = {self.status_ttl_ms}\n"
                + 'engine = "reference"\nengine_dir = "engine"\n'
                + f"block_tokens = {self.block_tokens}\n"
                + f'scope_keys = ["scope.key"]\nstore_blocks_to = ["{uris["h1"]}"]\n'
                + "checkpoint_tokens = 8\nrelease_tokens = 4\n"
                + f"token_interval_ms = {self.token_interval_ms}\n"
                + tiers
            )
        roles = {"control": "index,pc", "h1": "holder"}
        for name, text in configs.items():
            (root / f"{name}.toml").write_text(text)
            self.nodes[name] = Node(
                name,
                roles.get(name, "holder,instance"),
                ports[name],
                root / f"{name}.toml",
                root / f"{name}.log",
            )

    def start(self) -> None:
        if not self.nodes:
            self.prepare()
        for node in self.nodes.values():
            node.start()

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def context(self, name: str) -> Any:
        from .tls import client_context

        certs = self.root / "certs"
        return client_context(
            str(certs / "ca.pem"),
            str(certs / f"client-{name}.pem"),
            str(certs / f"client-{name}.key"),
        )

    def keys(self, tokens: list[int]) -> list[str]:
        compat = bytes.fromhex(self.engine.descriptor.compat_id_hex)
        return [k.hex() for k in block_keys(SCOPE_KEY, compat, tokens, self.block_tokens)]

    async def admin(self, method: str, path: str, body: Any = None) -> Any:
        import aiohttp

        connector = aiohttp.TCPConnector(ssl=self.context("ops"))
        async with (
            aiohttp.ClientSession(connector=connector) as http,
            http.request(method, self.uris["pc"] + path, json=body) as response,
        ):
            answer = await response.json(content_type=None)
            if response.status >= 300:
                raise RuntimeError(f"{method} {path}: {response.status} {answer}")
            return answer

    async def set_state(self, name: str, state: str) -> None:
        from .protocol.wire import role_id

        await self.admin("PUT", f"instances/{role_id(self.uris[name])}/state", {"state": state})

    async def wait_active(self, names: tuple[str, ...], timeout: float = 30.0) -> None:
        """Until the PC places on each of ``names`` (their status arrived, S1)."""
        deadline = time.monotonic() + timeout
        probe = {
            "scope_id": self.scope_id,
            "compat_id": self.engine.descriptor.compat_id_hex,
            "block_keys": ["0" * 64],
            "tokens": 1,
        }
        while True:
            try:
                answer = await self.admin("POST", "place", probe)
                found = {c["instance"] for c in answer["candidates"]}
                if {self.uris[n] for n in names} <= found:
                    return
            except RuntimeError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"instances {names} never became active at the PC")
            await asyncio.sleep(0.2)

    def uninterrupted(self, prompt: list[int], n: int, sampler: dict[str, Any]) -> list[int]:
        """The output of the same session computed here, in one piece."""
        from .instance.engine import sample
        from .protocol.control import Sampler

        spec = Sampler(
            sampler.get("method", "greedy"),
            sampler.get("seed", 0),
            0,
            False,
            {"p": 1.0, "temperature": 1.0, **sampler.get("params", {})},
        )
        run = self.engine.prefill(prompt)
        out: list[int] = []
        for step in range(n):
            out.append(sample(run.logits, spec, step))
            self.engine.extend(run, out[-1])
        return out


async def generate(
    cluster: Cluster, instance: str, prompt: list[int], n: int, **extra: Any
) -> tuple[list[Any], dict[str, Any], Any]:
    """A front end's whole session: the delivered tokens, how it ended, and
    the client (its events)."""
    from .client import FrontEnd

    body = {"scope_id": cluster.scope_id, "tokens": prompt, "max_tokens": n, **extra}
    async with FrontEnd(cluster.uris["pc"], cluster.context("frontend")) as front:
        out = [t async for t in front.generate(cluster.uris[instance], body)]
        return out, front.last_end, front


PROMPT = "KVSP names KV blocks by keyed hash chains over token prefixes. "


async def prefix_reuse(cluster: Cluster, n: int = 16) -> dict[str, Any]:
    """``a`` serves a prompt; ``b`` is placed for one sharing its prefix."""
    import aiohttp

    from .instance.reference import encode_text

    await cluster.wait_active(INSTANCES)
    first = encode_text(PROMPT * 2)
    started = time.monotonic()
    out_a, end_a, _ = await generate(cluster, "a", first, n)
    ttft_a = end_a["stats"].get("ttft_ms")
    wall_a = time.monotonic() - started
    second = first + encode_text("What does a lease protect?")[1:]
    keys = cluster.keys(second)
    # Until the IS knows the blocks (a's replicas and h1's copies, P1).
    from .client import IndexClient
    from .protocol.records import LookupRequest

    compat = cluster.engine.descriptor.compat_id_hex
    shared = len(cluster.keys(first[:-1]))
    async with IndexClient(cluster.uris["index"], cluster.context("frontend")) as index:
        deadline = time.monotonic() + 20
        while (
            await index.lookup(LookupRequest(cluster.scope_id, compat, tuple(keys)))
        ).matched < shared:
            if time.monotonic() > deadline:
                raise RuntimeError("the prompt's blocks were never published")
            await asyncio.sleep(0.1)
    await cluster.set_state("a", "draining")  # so that the PC places on b
    try:
        request_ref = str(uuid.uuid4())
        connector = aiohttp.TCPConnector(ssl=cluster.context("frontend"))
        async with aiohttp.ClientSession(connector=connector) as http:
            body = {
                "scope_id": cluster.scope_id,
                "compat_id": compat,
                "block_keys": keys,
                "tokens": len(second),
                "request_ref": request_ref,
            }
            async with http.post(cluster.uris["pc"] + "place", json=body) as response:
                placement = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"place: {placement}")
        chosen = next(n for n in cluster.instances if cluster.uris[n] == placement["instance"])
        started = time.monotonic()
        out_b, end_b, _ = await generate(
            cluster, chosen, second, n, request_ref=request_ref, logprobs=True
        )
        wall_b = time.monotonic() - started
    finally:
        await cluster.set_state("a", "active")
    return {
        "first": {
            "instance": "a",
            "prompt_tokens": len(first),
            "stats": end_a["stats"],
            "tokens": [t.token for t in out_a],
            "wall_s": wall_a,
            "ttft_ms": ttft_a,
        },
        "placement": placement,
        "second": {
            "instance": chosen,
            "prompt_tokens": len(second),
            "stats": end_b["stats"],
            "tokens": [t.token for t in out_b],
            "wall_s": wall_b,
            "logprobs": [t.logprob for t in out_b],
            "prompt": second,
        },
        "shared_blocks": shared,
    }


async def migration(
    cluster: Cluster, n: int = 64, kill_after: int = 12, sampler: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``a`` is SIGKILLed after the front end got ``kill_after`` tokens."""
    from .client import FrontEnd
    from .instance.reference import encode_text

    await cluster.wait_active(INSTANCES)
    prompt = encode_text(PROMPT + "After a failure, the session moves.")
    body: dict[str, Any] = {"scope_id": cluster.scope_id, "tokens": prompt, "max_tokens": n}
    if sampler is not None:
        body["sampler"] = sampler
    delivered: list[Any] = []
    killed_at = moved_at = None
    async with FrontEnd(
        cluster.uris["pc"], cluster.context("frontend"), follow_timeout_s=30
    ) as front:
        started = time.monotonic()
        async for token in front.generate(cluster.uris["a"], body):
            delivered.append(token)
            if token.epoch > 1 and moved_at is None:
                moved_at = time.monotonic()
            if len(delivered) == kill_after:
                cluster.nodes["a"].kill()
                killed_at = time.monotonic()
        events = front.events
        end = front.last_end
    resumed_at = next((e for e in events if e.get("event") == "session" and e["epoch"] > 1), None)
    return {
        "prompt": prompt,
        "tokens": [t.token for t in delivered],
        "indexes": [t.index for t in delivered],
        "epochs": [t.epoch for t in delivered],
        "events": events,
        "end": end,
        "killed_at_s": (killed_at or started) - started,
        "wall_s": time.monotonic() - started,
        "resumed": resumed_at,
        "kill_after": kill_after,
        "moved_after_s": None if moved_at is None or killed_at is None else moved_at - killed_at,
    }


async def as_pc(cluster: Cluster, method: str, instance: str, path: str, body: Any = None) -> Any:
    """A request to an instance with the PC's identity (SEC1)."""
    import aiohttp

    connector = aiohttp.TCPConnector(ssl=cluster.context("pc"))
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.request(method, cluster.uris[instance] + path, json=body) as response,
    ):
        answer = await response.json(content_type=None)
        if response.status >= 300:
            raise RuntimeError(f"{method} {instance} {path}: {response.status} {answer}")
        return answer


def layout(cluster: Cluster, map_id: str, version: int, shards: list[tuple[int, int, str]]) -> Any:
    return {
        "map": map_id,
        "version": version,
        "shards": [{"tokens": [a, b], "instance": cluster.uris[n]} for a, b, n in shards],
    }


async def resharding(cluster: Cluster, blocks: int = 8) -> dict[str, Any]:
    """Scenario 4 (RS1-RS7): a context of ``blocks`` blocks sharded over a
    and b is resharded to a, b and c, back to a and b, and then once more
    with c stopped (SIGSTOP), which aborts."""
    from .client import IndexClient
    from .instance.reference import encode_text
    from .protocol.records import LookupRequest

    size = cluster.block_tokens
    names = cluster.instances
    await cluster.wait_active(names)
    text = PROMPT * (1 + blocks * size // len(PROMPT))
    prompt = encode_text(text)[: blocks * size + 1]
    await generate(cluster, "a", prompt, 1)  # its blocks: in a's tiers and on h1
    keys = cluster.keys(prompt)[:blocks]
    compat = cluster.engine.descriptor.compat_id_hex
    async with IndexClient(cluster.uris["index"], cluster.context("frontend")) as index:
        deadline = time.monotonic() + 20
        while (
            await index.lookup(LookupRequest(cluster.scope_id, compat, tuple(keys)))
        ).matched < blocks:
            if time.monotonic() > deadline:
                raise RuntimeError("the context's blocks were never published")
            await asyncio.sleep(0.1)
    map_id = str(uuid.uuid4())
    half = blocks // 2 * size
    v1 = [(0, half, "a"), (half, blocks * size, "b")]
    third = blocks * size // 3 // size * size
    v2 = [(0, third, "a"), (third, 2 * third, "b"), (2 * third, blocks * size, "c")]
    owned = {n: [[a, b] for a, b, m in v1 if m == n] for n in names}
    for name in names:
        await as_pc(
            cluster,
            "PUT",
            name,
            f"contexts/{map_id}",
            {
                "scope_id": cluster.scope_id,
                "compat_id": compat,
                "block_keys": keys,
                "version": 1,
                "ranges": owned[name],
            },
        )
    await cluster.admin("PUT", f"maps/{map_id}", layout(cluster, map_id, 1, v1))

    async def held() -> dict[str, Any]:
        return {n: await as_pc(cluster, "GET", n, f"contexts/{map_id}") for n in names}

    before = await held()
    started = time.monotonic()
    out = await cluster.admin(
        "POST",
        f"maps/{map_id}/reshard",
        {"target": layout(cluster, map_id, 2, v2), "deadline_ms": 10000},
    )
    split_s = time.monotonic() - started
    after_split = await held()
    started = time.monotonic()
    back = await cluster.admin(
        "POST",
        f"maps/{map_id}/reshard",
        {"target": layout(cluster, map_id, 3, v1), "deadline_ms": 10000},
    )
    merge_s = time.monotonic() - started
    after_merge = await held()
    # An abort: c does not answer (stopped), the others drop what they fetched.
    node = cluster.nodes["c"]
    assert node.process is not None
    node.process.send_signal(signal.SIGSTOP)
    try:
        aborted: Any
        try:
            aborted = await cluster.admin(
                "POST",
                f"maps/{map_id}/reshard",
                {"target": layout(cluster, map_id, 4, v2), "deadline_ms": 1500},
            )
        except RuntimeError as exc:
            aborted = str(exc)
        after_abort = {
            n: await as_pc(cluster, "GET", n, f"contexts/{map_id}") for n in names if n != "c"
        }
        current = await cluster.admin("GET", f"maps/{map_id}")
    finally:
        node.process.send_signal(signal.SIGCONT)
    block_octets = cluster.engine.descriptor.block_octets
    return {
        "map": map_id,
        "v1": v1,
        "v2": v2,
        "block_octets": block_octets,
        "before": before,
        "split": out,
        "after_split": after_split,
        "split_s": split_s,
        "merge": back,
        "after_merge": after_merge,
        "merge_s": merge_s,
        "aborted": aborted,
        "after_abort": after_abort,
        "current": current,
    }


def main(root: str | None = None) -> int:
    """``kvstore demo``: scenarios 1 and 2 on this machine, printed."""
    import tempfile

    directory = Path(root) if root else Path(tempfile.mkdtemp(prefix="kvstore-demo-"))
    print(f"kvstore demo: processes, certificates and logs in {directory}")
    with Cluster(directory, token_interval_ms=40) as cluster:
        print(
            f"  holder h1 {cluster.uris['h1']}, IS {cluster.uris['index']}, "
            f"PC {cluster.uris['pc']}, instances a {cluster.uris['a']} and b {cluster.uris['b']}"
        )
        reuse = asyncio.run(prefix_reuse(cluster))
        first, second = reuse["first"], reuse["second"]
        print("\n1. Prefix reuse")
        print(
            f"  a served {first['prompt_tokens']} prompt tokens: computed "
            f"{first['stats']['computed_tokens']}, loaded {first['stats']['loaded_tokens']}, "
            f"time to first token {first['stats'].get('ttft_ms')} ms"
        )
        candidates = ", ".join(
            f"{c['instance']} cost {c['cost_us']:.0f} us" for c in reuse["placement"]["candidates"]
        )
        print(
            f"  the PC matched {reuse['placement']['matched']} blocks and placed the second "
            f"prompt on {second['instance']} ({candidates})"
        )
        print(
            f"  {second['instance']} served {second['prompt_tokens']} prompt tokens: loaded "
            f"{second['stats']['loaded_tokens']} ({second['stats'].get('loaded_blocks')} "
            f"blocks), recomputed {second['stats']['computed_tokens']}, time to first token "
            f"{second['stats'].get('ttft_ms')} ms"
        )
        expected = cluster.uninterrupted(second["prompt"], len(second["tokens"]), {})
        print(f"  its greedy output equals a full recompute: {expected == second['tokens']}")
        print("  (the reference model is tiny: recomputing a token costs it far less than a")
        print("  real model, so the cache saves compute here rather than time)")
        moved = asyncio.run(migration(cluster))
        print("\n2. Migration")
        print(
            f"  a was killed (SIGKILL) {moved['killed_at_s']:.2f} s into the session, after "
            f"{moved['kill_after']} tokens delivered"
        )
        if moved["resumed"] is not None:
            print(
                f"  the PC moved it to b at epoch {moved['resumed']['epoch']}, from output "
                f"index {moved['resumed']['resumed_from']}"
            )
        stats = moved["end"].get("stats", {})
        print(
            f"  b loaded {stats.get('loaded_tokens')} tokens of KV and recomputed "
            f"{stats.get('computed_tokens')}"
        )
        expected = cluster.uninterrupted(moved["prompt"], len(moved["tokens"]), {})
        once = moved["indexes"] == list(range(len(moved["indexes"])))
        print(
            f"  the front end got {len(moved['tokens'])} tokens, each index once: {once}; "
            f"equal to an uninterrupted run: {moved['tokens'] == expected}"
        )
        print(f"  epochs seen: {sorted(set(moved['epochs']))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
