"""``kvstore config check`` and ``kvstore descriptor``: what a configuration,
and the engine an instance configuration builds, amount to, without serving."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .clibase import CliError, read_json
from .protocol.problems import KvspError


def cmd_config_check(args: argparse.Namespace) -> Any:
    """Validate a configuration as ``serve`` would read it (environment
    overrides included), building what can be built without serving."""
    from .config import ConfigError, load

    try:
        config = load(args.file)
        roles = (
            tuple(r.strip() for r in args.roles.split(","))
            if args.roles
            else config.roles_of_sections() or ("holder",)
        )
        problems = check_roles(config, roles)
    except ConfigError as exc:
        raise CliError(str(exc)) from exc
    if problems:
        # In the order found, one a line; the last one is the exit's error.
        for problem in problems[:-1]:
            print(f"kvstore: error: {problem}", file=sys.stderr)
        raise CliError(problems[-1])
    return f"{args.file}: ok for roles {','.join(roles)}"


def check_roles(config: Any, roles: tuple[str, ...]) -> list[str]:
    """What the roles need that the configuration lacks (every one found):
    the invariants of its values (:func:`kvstore.config.check`), then what
    the files it names hold."""
    from .config import ROLE_SECTIONS, check
    from .security import Policy, PolicyError

    out = check(config, roles)
    if out and out[0].startswith("roles:"):
        return out
    for role in roles:
        section = getattr(config, ROLE_SECTIONS[role])
        if not section.policy:
            continue  # named by check()
        try:
            Policy.load(section.policy)
        except PolicyError as exc:
            # One line per invalid member, each with its path in the document.
            out += [f"{ROLE_SECTIONS[role]}.policy: {problem}" for problem in exc.problems]
        except OSError as exc:
            out.append(f"{ROLE_SECTIONS[role]}.policy: {exc.strerror or exc}: {section.policy}")
        except ValueError as exc:
            out.append(f"{ROLE_SECTIONS[role]}.policy: {exc}")
    out += _check_parts(config, roles)
    return out


def _check_parts(config: Any, roles: tuple[str, ...]) -> list[str]:
    """What ``serve`` would refuse in the files the configuration names, and
    the backends it names: descriptors, the sealing key, TLS files."""
    import json as json_

    from .protocol.compat import parse_descriptor

    out: list[str] = []
    if "holder" in roles or "instance" in roles:
        out += _check_tier_paths(config)
        key = config.storage.encryption_key_file
        if key:
            try:
                if len(Path(key).read_bytes()) != 32:
                    out.append("storage.encryption_key_file: must hold exactly 32 octets")
            except OSError as exc:
                out.append(f"storage.encryption_key_file: {exc.strerror}: {key}")
    for section, role in (("holder", "holder"), ("index", "index"), ("controller", "pc")):
        if role not in roles:
            continue
        for file in getattr(config, section).descriptors:
            try:
                parse_descriptor(json_.loads(Path(file).read_text()))
            except (OSError, ValueError, KvspError) as exc:
                out.append(f"{section}.descriptors: {file}: {exc}")
    if all(getattr(config.server, k) for k in ("certfile", "keyfile", "cafile")):
        from .config import ConfigError
        from .listener import check_tls_files

        try:  # what serve reads, the very context it builds, before it starts
            check_tls_files(config)
        except ConfigError as exc:
            out.append(str(exc))
    return out


def _check_tier_paths(config: Any) -> list[str]:
    """Each LMDB directory writable (or makeable where it does not exist yet)."""
    import os

    out = []
    for index, tier in enumerate(config.storage.tiers):
        path = tier.options.get("path")
        if tier.backend != "lmdb" or not isinstance(path, str):
            continue
        where = Path(path)
        while not where.exists() and where != where.parent:
            where = where.parent  # the directory it would be made in
        if not where.is_dir():
            out.append(f"storage.tiers[{index}].path: {where} is not a directory")
        elif not os.access(where, os.W_OK | os.X_OK):
            out.append(f"storage.tiers[{index}].path: {where} is not writable")
    return out


def cmd_descriptor(args: argparse.Namespace) -> Any:
    """A Compatibility Descriptor and its Compatibility ID (C1, C2): of a file,
    of an instance configuration's engine, or of the reference engine; given
    a file and an engine, the file must be the engine's."""
    from .protocol.compat import parse_descriptor

    found = None
    if args.descriptor:
        try:
            found = parse_descriptor(read_json(args.descriptor))
        except KvspError as exc:
            raise CliError(f"{args.descriptor}: {exc}") from exc
    engine = None
    if args.config:
        engine = _config_engine_descriptor(args.config)
    elif args.engine:
        if args.block_tokens < 1:
            raise CliError("--block-tokens: at least 1")
        engine = _reference_descriptor(args.engine_dir, args.block_tokens, args.seed)
    if found is None and engine is None:
        raise CliError("descriptor: give --descriptor FILE, --config FILE or --engine reference")
    if found is not None and engine is not None and found.compat_id != engine.compat_id:
        mine, theirs = found.to_json(), engine.to_json()
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        raise CliError(
            f"{args.descriptor}: compat_id {found.compat_id_hex} is not the "
            f"engine's {engine.compat_id_hex} ({', '.join(differ)} differ)"
        )
    descriptor = engine or found
    assert descriptor is not None
    if args.json:
        out = {"compat_id": descriptor.compat_id_hex, "descriptor": descriptor.to_json()}
        if args.canonical:
            import rfc8785

            return rfc8785.dumps(out).decode()
        return out
    text = (
        descriptor.canonical().decode()
        if args.canonical
        else json.dumps(descriptor.to_json(), indent=2)
    )
    return f"compat_id {descriptor.compat_id_hex}\n{text}"


def _config_engine_descriptor(file: str) -> Any:
    """The descriptor of the engine ``kvstore serve --roles instance`` builds
    from the configuration's [instance] section (kvstore.build.build_sessions)."""
    from .config import ConfigError, load

    try:
        config = load(file)
    except ConfigError as exc:
        raise CliError(str(exc)) from exc
    cfg = config.instance
    if cfg.engine != "reference":
        raise CliError(
            f"instance.engine: {cfg.engine!r}; a descriptor needs an engine "
            '(available: "reference")'
        )
    if cfg.block_tokens < 1:
        raise CliError("instance.block_tokens: at least 1")
    from .build import engine_directory

    directory = engine_directory(config)
    return _reference_descriptor(directory, cfg.block_tokens, cfg.engine_seed)


def _reference_descriptor(directory: str | None, block_tokens: int, seed: int) -> Any:
    """The reference engine's descriptor: of the weights in ``directory`` when
    they exist there, else of those ``seed`` makes (drawn in a temporary
    directory: nothing is written to ``directory``)."""
    import tempfile

    try:
        from .instance.reference import ReferenceEngine

        if directory and (Path(directory) / "model.safetensors").is_file():
            return ReferenceEngine(directory, block_tokens=block_tokens, seed=seed).descriptor
        with tempfile.TemporaryDirectory(prefix="kvstore-engine-") as scratch:
            return ReferenceEngine(scratch, block_tokens=block_tokens, seed=seed).descriptor
    except ImportError as exc:  # torch, transformers: imported when the engine is made
        raise CliError(
            f"the reference engine needs {exc.name or exc}, which is not installed "
            "(pip install 'kvsp-kvstore[engine]')"
        ) from None
