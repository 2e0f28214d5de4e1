"""Configuration of the daemon and the directory: frozen objects whose field
names are the flags.

Every field ``cache_dir`` is the flag ``--cache-dir`` and the environment
variable ``DATAQUAY_CACHE_DIR``; a flag beats the environment, which beats the
default. The directory's variables carry their own prefix
(``DATAQUAY_DIRECTORY_LISTEN``), so that a daemon and a directory started from
the same job script do not read each other's settings.
"""

from __future__ import annotations

import argparse
import os
from socket import gethostname
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Self

from dataquay.client.channels import default_socket_path
from dataquay.server.errors import ConfigError
from dataquay.server.sizes import parse_size

ENV_PREFIX = "DATAQUAY_"


def _home_dir(kind: str, fallback: str) -> Path:
    return Path(os.environ.get(kind) or Path.home() / fallback) / "dataquay"


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) <= 0:
        raise ValueError("expected a whole number above 0")
    return int(text)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("expected a number above 0")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError("expected a fraction from 0 to 1")
    return value


def _port(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 65535:
        raise ValueError("expected a port number 0-65535")
    return int(text)


def _option(default: Any, help: str, parse: Callable[[str], Any] = str, **extra: Any) -> Any:
    meta = {"help": help, "parse": parse, **extra}
    if callable(default) and not isinstance(default, type):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class FlagConfig:
    """Flags and environment variables for the fields of a config dataclass."""

    env_prefix: ClassVar[str] = ENV_PREFIX

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Adds one flag per field; unset flags stay None so the env can fill them."""
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            env = cls.env_prefix + f.name.upper()
            parser.add_argument(
                flag,
                dest=f.name,
                default=None,
                choices=f.metadata.get("choices"),
                help=f"{f.metadata['help']} [env {env}]",
            )

    @classmethod
    def from_sources(cls, flags: Mapping[str, str | None], env: Mapping[str, str] = os.environ) -> Self:
        """Builds the config from flag values and the environment, naming any bad value."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = flags.get(f.name)
            source = "--" + f.name.replace("_", "-")
            if raw is None:
                raw = env.get(cls.env_prefix + f.name.upper())
                source = cls.env_prefix + f.name.upper()
            if raw is None:
                continue
            choices = f.metadata.get("choices")
            if choices and raw not in choices:
                raise ConfigError(f"{source}: {raw!r} is not one of {', '.join(choices)}")
            try:
                values[f.name] = f.metadata["parse"](raw)
            except ConfigError as exc:
                raise ConfigError(f"{source}: {exc}") from None
            except ValueError as exc:
                raise ConfigError(f"{source}: bad value {raw!r}: {exc}") from None
        return cls(**values)


@dataclass(frozen=True)
class DaemonConfig(FlagConfig):
    """Everything ``dataquay serve`` needs to run one node's daemon."""

    socket: Path = _option(default_socket_path, "unix socket for local clients", Path)
    listen: str = _option(
        "127.0.0.1:7070", "TCP HOST:PORT for peers and remote tools; port 0 picks a free port"
    )
    cache_dir: Path = _option(
        lambda: _home_dir("XDG_CACHE_HOME", ".cache") / "cache",
        "directory of the LMDB cache; put it on the node-local SSD",
        Path,
    )
    cache_size: int = _option(
        0, "cache capacity (e.g. 200G); 0 = 80%% of the cache file system's space", parse_size
    )
    state_dir: Path = _option(
        lambda: _home_dir("XDG_STATE_HOME", ".local/state"),
        "directory for the dataset registry and manifests",
        Path,
    )
    pfs_threads: int = _option(8, "threads reading the parallel file system", _positive_int)
    pfs_bandwidth: int = _option(
        0, "cap on PFS reads in bytes/s (e.g. 500M); 0 = uncapped", lambda s: parse_size(s, "rate")
    )
    metrics_host: str = _option("0.0.0.0", "address of the Prometheus /metrics endpoint")
    metrics_port: int = _option(9470, "port of the Prometheus endpoint; 0 picks a free port", _port)
    max_batch: int = _option(4096, "most sample ids one read request may carry", _positive_int)
    node_name: str = _option(gethostname, "this node's name in the cluster")
    directory: str = _option("", "HOST:PORT of the directory service; empty runs this node standalone")
    peer_timeout: float = _option(
        5.0, "seconds a peer may take to answer a batch before its samples come from the PFS", _positive_float
    )
    exchange_bandwidth: int = _option(
        0,
        "cap on the per-epoch exchange this node sends, in bytes/s (e.g. 200M), so that training reads "
        "keep the network; 0 = uncapped",
        lambda s: parse_size(s, "rate"),
    )
    spare_copies_fill: float = _option(
        0.5,
        "cache fill (0-1) below which samples given away in an exchange are kept as spare copies, so a "
        "later epoch that hands them back moves nothing; 0 deletes them once delivered",
        _fraction,
    )
    ready_file: Path | None = _option(
        None, "write a JSON file with the bound addresses once serving", Path
    )
    log_level: str = _option("info", "debug, info, warning or error", choices=("debug", "info", "warning", "error"))
    log_format: str = _option("text", "text or json", choices=("text", "json"))


@dataclass(frozen=True)
class DirectoryConfig(FlagConfig):
    """Everything ``dataquay directory`` needs to run the cluster's directory."""

    env_prefix: ClassVar[str] = ENV_PREFIX + "DIRECTORY_"

    listen: str = _option(
        "127.0.0.1:7071", "TCP HOST:PORT daemons and tools connect to; port 0 picks a free port"
    )
    state_dir: Path = _option(
        lambda: _home_dir("XDG_STATE_HOME", ".local/state") / "directory",
        "directory for the node list, the job records and the dataset registry",
        Path,
    )
    http_host: str = _option("0.0.0.0", "address of the HTTP endpoints /sd, /metrics and /healthz")
    http_port: int = _option(9471, "port of the HTTP endpoints; 0 picks a free port", _port)
    lease_seconds: float = _option(
        10.0, "seconds without a heartbeat after which a node is marked down", _positive_float
    )
    heartbeat_seconds: float = _option(
        2.0, "how often daemons are told to renew their lease; below --lease-seconds", _positive_float
    )
    ready_file: Path | None = _option(
        None, "write a JSON file with the bound addresses once serving", Path
    )
    log_level: str = _option("info", "debug, info, warning or error", choices=("debug", "info", "warning", "error"))
    log_format: str = _option("text", "text or json", choices=("text", "json"))

    def __post_init__(self) -> None:
        if self.heartbeat_seconds >= self.lease_seconds:
            raise ConfigError(
                f"--heartbeat-seconds ({self.heartbeat_seconds:g}) must be below --lease-seconds "
                f"({self.lease_seconds:g}), or every node is marked down between two heartbeats"
            )

