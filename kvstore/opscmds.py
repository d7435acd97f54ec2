"""``kvstore status``, ``top`` and ``events``: looking at running roles, and
the bridge beside a vLLM engine (:mod:`.cli` parses, these run)."""

from __future__ import annotations

import argparse
from typing import Any

from .clibase import CliError, _dev_context


def _ops_context(args: argparse.Namespace) -> Any:
    import ssl

    if not any(u.startswith("https:") for u in args.url):
        return None
    try:
        return _dev_context(args.certs, args.cafile, args.cert, args.key)
    except FileNotFoundError as exc:
        raise CliError(str(exc)) from exc
    except (OSError, ssl.SSLError) as exc:
        raise CliError(f"client certificate: {exc}") from exc


def cmd_status(args: argparse.Namespace) -> Any:
    """One summary of each role at the given base URIs."""
    import asyncio

    from .ops import gather, render

    views = asyncio.run(gather(args.url, _ops_context(args)))
    if args.json:
        return [v.summary() for v in views]
    from rich.console import Console

    Console().print(render(views))
    if any(v.error for v in views):
        raise CliError("; ".join(v.error for v in views if v.error))
    return None


def cmd_top(args: argparse.Namespace) -> Any:
    """The summary with rates, redrawn every ``--interval`` seconds until q or Ctrl-C."""
    import asyncio
    import contextlib

    from .ops import top

    context = _ops_context(args)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(top(args.url, context, args.interval, args.rounds))
    return None


def cmd_events(args: argparse.Namespace) -> Any:
    """The bridge beside a vLLM engine: its KV events into the IS as residency."""
    from .config import ConfigError

    try:
        from .fleet.run import run
    except ImportError as exc:
        raise CliError(f"events: the events extra is not installed ({exc})") from exc
    try:
        status = run(args.config)
    except ConfigError as exc:
        raise CliError(str(exc)) from exc
    except KeyboardInterrupt:
        status = 0
    if status:
        raise SystemExit(status)
    return None
