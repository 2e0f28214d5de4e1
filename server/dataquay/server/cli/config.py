"""Commands about configuration: show what the daemon and the directory would
run with, and where each value comes from."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import dataquay.server.config as server_config
from dataquay.server.cli.common import print_table
from dataquay.server.config import SERVICES, ConfigFile, DaemonConfig, add_config_argument
from dataquay.server.node.cache.file import CacheFile
from dataquay.server.sizes import format_bytes


def _json_value(value: object) -> object:
    """A setting as JSON: paths as text, also inside a list of them (``dataset_roots``)."""
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def _text_value(value: object) -> str:
    """A value for the table: unset is "-", an empty string stays visible."""
    if value is None:
        return "-"
    if value == "":
        return '""'
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _default_cache_size(config: object) -> int | None:
    """What ``cache_size = 0`` gives a daemon started now: the capacity it
    would open its cache with (see ``CacheFile.default_capacity``); None for
    the directory's config or a size set."""
    if not isinstance(config, DaemonConfig) or config.cache_size:
        return None
    path = Path(config.cache_dir)
    while not path.exists() and path != path.parent:
        path = path.parent
    return CacheFile(path).default_capacity()


def cmd_config_show(args: argparse.Namespace) -> None:
    """Resolves both services' settings as `serve` and `directory` would
    without flags, so every value here is what the environment, the file or
    the default gives; a flag given to the service itself still beats them."""
    file = ConfigFile.find(args.config)
    resolved = {service.section: service.resolve({}, os.environ, file) for service in SERVICES}
    if args.json:
        document: dict[str, object] = {"config_file": str(file.path) if file is not None else None}
        for section, (config, sources) in resolved.items():
            settings: dict[str, dict[str, object]] = {
                name: {"value": _json_value(getattr(config, name)), "source": source}
                for name, source in sources.items()
            }
            if (effective := _default_cache_size(config)) is not None:
                settings["cache_size"]["effective"] = effective
            document[section] = settings
        print(json.dumps(document, indent=2))
        return
    if file is not None:
        print(f"config file: {file.path} (from {file.origin})")
    else:
        print(f"config file: none ({server_config.DEFAULT_CONFIG_FILE} does not exist)")
    for section, (config, sources) in resolved.items():
        print(f"\n[{section}]")
        rows = [(name, _text_value(getattr(config, name)), source) for name, source in sources.items()]
        if (effective := _default_cache_size(config)) is not None:
            rows = [
                (name, f"{effective} ({format_bytes(effective)}, 80% of the cache file system's free space)", source)
                if name == "cache_size"
                else (name, value, source)
                for name, value, source in rows
            ]
        print_table(rows, ("KEY", "VALUE", "SOURCE"))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config = sub.add_parser("config", help="inspect the configuration of the daemon and the directory")
    csub = config.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = csub.add_parser(
        "show", help="every setting of the daemon and the directory, its effective value and its source"
    )
    add_config_argument(show)
    show.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    show.set_defaults(func=cmd_config_show)
