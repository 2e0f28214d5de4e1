"""Configuration of the daemon and the directory: frozen objects whose field
names are the flags.

Every field ``cache_dir`` is the flag ``--cache-dir``, the environment variable
``DATAQUAY_CACHE_DIR`` and the key ``cache_dir`` in the ``[daemon]`` table of
the config file. A flag beats the environment, which beats the file, which
beats the default. The directory's variables carry their own prefix
(``DATAQUAY_DIRECTORY_LISTEN``) and its keys their own table
(``[directory]``), so that a daemon and a directory started from the same job
script or the same file do not read each other's settings.

The file is TOML, one for both services: ``--config PATH``, else
``DATAQUAY_CONFIG``, else :data:`DEFAULT_CONFIG_FILE` when it exists.
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import json
import os
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from socket import gethostname
from typing import Any, ClassVar, Self

from dataquay.client.wire.channels import default_socket_path
from dataquay.server.errors import ConfigError
from dataquay.server.quotas import checked_quotas
from dataquay.server.sizes import QuantityError, parse_duration, parse_size

ENV_PREFIX = "DATAQUAY_"
#: The config file both services read when neither --config nor DATAQUAY_CONFIG names one.
DEFAULT_CONFIG_FILE = Path("/etc/dataquay/dataquay.toml")
CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG"


def _home_dir(kind: str, fallback: str) -> Path:
    return Path(os.environ.get(kind) or Path.home() / fallback) / "dataquay"


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) <= 0:
        raise ValueError("expected a whole number above 0")
    return int(text)


def _positive_duration(text: str) -> float:
    seconds = parse_duration(text)
    if not seconds > 0:
        raise ValueError("expected a duration above 0, like 2s or 500ms")
    return seconds


def _fraction(text: str) -> float:
    expected = "expected a fraction from 0 to 1"
    try:
        value = float(text)
    except ValueError:
        raise ValueError(expected) from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(expected)
    return value


#: The largest value LMDB stores (MDB_MAXDATASIZE), less a cache value's checksum.
_LARGEST_CACHEABLE = 0xFFFFFFFF - 8


def _sample_size(text: str) -> int:
    size = parse_size(text)
    if not 0 < size <= _LARGEST_CACHEABLE:
        raise ValueError(f"expected a size above 0 and at most {_LARGEST_CACHEABLE} bytes (the largest LMDB value)")
    return size


def _port(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 65535:
        raise ValueError("expected a port number 0-65535")
    return int(text)


#: Addresses of a daemon's multicast pool: ``--exchange-multicast``'s GROUP and those after it.
MULTICAST_POOL = 256


def _multicast(text: str) -> str:
    """``GROUP:PORT`` of an IPv4 multicast group, or empty."""
    if not text:
        return text
    group, _, port = text.rpartition(":")
    try:
        first = ipaddress.IPv4Address(group)
        multicast = first.is_multicast and (first + MULTICAST_POOL - 1).is_multicast
    except ValueError:
        multicast = False
    if not multicast or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(
            f"expected GROUP:PORT with an IPv4 multicast group (224.0.0.0/4) that has "
            f"{MULTICAST_POOL - 1} more after it, like 239.255.16.1:47016"
        )
    return text


def _paths(text: str) -> tuple[Path, ...]:
    return tuple(Path(part) for part in text.split(os.pathsep) if part)


def _option(default: Any, help: str, parse: Callable[[str], Any] = str, **extra: Any) -> Any:
    meta = {"help": help, "parse": parse, **extra}
    if callable(default) and not isinstance(default, type):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


def _default_text(f: Field[Any]) -> str:
    """A field's default as ``--help`` shows it, escaped for argparse."""
    value = f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default
    if isinstance(value, tuple):
        value = os.pathsep.join(map(str, value))
    text = "none" if value is None else '""' if value == "" else str(value)
    return text.replace("%", "%%")


def closest_name(word: str, known: Iterable[str]) -> str | None:
    """The known name a mistyped one most likely meant (``cache-size`` is
    ``cache_size``), or None when none is close."""
    known = list(known)
    underscored = word.replace("-", "_")
    if underscored in known:
        return underscored
    close = difflib.get_close_matches(word, known, n=1)
    return close[0] if close else None


def _toml_literal(value: object) -> str:
    """``value`` as it would be written in the file, for messages that quote it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value, ensure_ascii=False, default=str)


def _parse(f: Field[Any], raw: str) -> Any:
    """The field's value from its text; raises ValueError saying what was expected."""
    choices = f.metadata.get("choices")
    if choices and raw not in choices:
        raise ValueError(f"expected one of {', '.join(choices)}")
    return f.metadata["parse"](raw)


def _from_text(f: Field[Any], raw: str, where: str) -> Any:
    """Parses a flag or an environment variable, naming it in the error."""
    try:
        return _parse(f, raw)
    except QuantityError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{where}: bad value {raw!r}: {exc}") from None


def _from_file(f: Field[Any], value: object, where: str) -> Any:
    """Parses a value of the config file, quoting it as written there.

    TOML values are typed: text fields (paths, addresses, names) take strings;
    fields whose default is a number (sizes, counts, seconds, fractions) take
    numbers as well, so ``pfs_threads = 16`` and ``cache_size = "200G"`` both work;
    list fields take a list of strings (``dataset_roots = ["/lustre", "/gpfs"]``).
    """
    numeric = isinstance(f.default, int | float)
    many = f.metadata.get("many", False)
    try:
        if many and isinstance(value, list) and all(isinstance(item, str) for item in value):
            return _parse(f, os.pathsep.join(value))
        if isinstance(value, str):
            return _parse(f, value)
        if numeric and isinstance(value, int | float) and not isinstance(value, bool):
            return _parse(f, repr(value))
        if many:
            raise ValueError("expected a list of strings")
        raise ValueError("expected a number or a string" if numeric else "expected a string")
    except QuantityError as exc:
        reason = exc.expected
    except ValueError as exc:
        reason = str(exc)
    raise ConfigError(f"{where} = {_toml_literal(value)}: {reason}")


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--config PATH``, the file that fills what no flag or variable sets."""
    parser.add_argument(
        "--config",
        metavar="PATH",
        help=f"TOML config file (default {DEFAULT_CONFIG_FILE}, if it exists) [env {CONFIG_FILE_ENV}]",
    )


@dataclass(frozen=True)
class ConfigFile:
    """A parsed config file: one table of settings per service.

    Table and key names are checked against every service when the file is
    loaded, so a typo anywhere in it stops whichever service reads it first;
    values are checked by the service that uses them (``dataquay config show``
    checks both).
    """

    path: Path
    #: What named the file: "--config", "DATAQUAY_CONFIG" or "default".
    origin: str
    tables: Mapping[str, Mapping[str, Any]]

    @classmethod
    def find(cls, flag: str | None, env: Mapping[str, str] = os.environ) -> ConfigFile | None:
        """The file named by ``--config``, else by DATAQUAY_CONFIG (either must
        exist), else the default file if it exists, else None."""
        for origin, named in (("--config", flag), (CONFIG_FILE_ENV, env.get(CONFIG_FILE_ENV))):
            if named:
                path = Path(named)
                if not path.exists():
                    raise ConfigError(f"config file {path} (from {origin}) does not exist")
                return cls.load(path, origin)
        if DEFAULT_CONFIG_FILE.exists():
            return cls.load(DEFAULT_CONFIG_FILE, "default")
        return None

    @classmethod
    def load(cls, path: Path, origin: str) -> ConfigFile:
        """Reads and checks ``path``; every error names the file."""
        try:
            document = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: the config file is not UTF-8 text") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        sections = {service.section: service for service in SERVICES}
        tables = " or ".join(f"[{name}]" for name in sections)
        for name, table in document.items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"{path}: {name} = {_toml_literal(table)} is outside a table; settings go under {tables}"
                )
            if name not in sections:
                meant = closest_name(name, sections)
                hint = f"; did you mean [{meant}]?" if meant else f"; expected {tables}"
                raise ConfigError(f"{path}: unknown table [{name}]{hint}")
            known = [f.name for f in fields(sections[name])]
            for key in table:
                if key not in known:
                    meant = closest_name(key, known)
                    hint = f"; did you mean {meant}?" if meant else ""
                    raise ConfigError(f"{path}: unknown key {key} in [{name}]{hint}")
        return cls(path, origin, document)


#: The headings of a service's ``--help``, each over the settings it names.
OPTION_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("where it listens", ("socket", "socket_group", "listen", "bulk_listen", "http_host", "http_port", "ready_file")),
    ("the cache", ("cache_dir", "cache_size", "evict_min_age", "cache_quotas", "state_dir", "prefetch_memory")),
    ("the PFS", ("dataset_roots", "max_sample_size", "pfs_threads", "pfs_bandwidth", "pfs_read_timeout")),
    ("users of the node", ("users", "shared_datasets", "prep_groups_per_user", "max_batch")),
    (
        "the cluster",
        ("node_name", "directory", "peer_timeout", "max_calls_per_peer", "store", "lease_seconds", "heartbeat_seconds"),
    ),
    ("jobs and the exchange", ("job_ttl", "exchange_bandwidth", "exchange_multicast", "exchange_multicast_interface")),
    ("healing and spare copies", ("heal_after", "heal_bandwidth", "spare_copies_fill")),
    ("security", ("token_file", "node_token_file", "tls_cert", "tls_key", "tls_ca")),
    ("metrics and logs", ("metrics_host", "metrics_port", "log_level", "log_format")),
)


@dataclass(frozen=True)
class FlagConfig:
    """Flags, environment variables and a config file table for the fields of
    a config dataclass."""

    env_prefix: ClassVar[str] = ENV_PREFIX
    #: The service's table in the config file.
    section: ClassVar[str]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Adds one flag per field, under its heading in ``--help``, and
        --config; unset flags stay None so the environment and the file can
        fill them."""
        headings = {name: heading for heading, names in OPTION_GROUPS for name in names}
        groups: dict[str, argparse._ArgumentGroup] = {}
        for heading, _ in OPTION_GROUPS:
            if any(headings.get(f.name) == heading for f in fields(cls)):
                groups[heading] = parser.add_argument_group(heading)
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            env = cls.env_prefix + f.name.upper()
            groups.get(headings.get(f.name, ""), parser).add_argument(
                flag,
                dest=f.name,
                default=None,
                choices=f.metadata.get("choices"),
                help=f"{f.metadata['help']} (default: {_default_text(f)}) [env {env}]",
            )
        add_config_argument(parser)

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, str | None], env: Mapping[str, str] = os.environ, file: ConfigFile | None = None
    ) -> Self:
        """Builds the config from flag values, the environment and the config
        file, naming any bad value and where it came from."""
        return cls.resolve(flags, env, file)[0]

    @classmethod
    def resolve(
        cls, flags: Mapping[str, str | None], env: Mapping[str, str] = os.environ, file: ConfigFile | None = None
    ) -> tuple[Self, dict[str, str]]:
        """The config and, per field, where its value came from: "flag --x",
        "env DATAQUAY_X", "file PATH" or "default"."""
        table = file.tables.get(cls.section, {}) if file is not None else {}
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            variable = cls.env_prefix + f.name.upper()
            raw = flags.get(f.name)
            if raw is not None:
                values[f.name] = _from_text(f, raw, flag)
                sources[f.name] = f"flag {flag}"
            elif (raw := env.get(variable)) is not None:
                values[f.name] = _from_text(f, raw, variable)
                sources[f.name] = f"env {variable}"
            elif file is not None and f.name in table:
                values[f.name] = _from_file(f, table[f.name], f"{file.path}: [{cls.section}] {f.name}")
                sources[f.name] = f"file {file.path}"
            else:
                sources[f.name] = "default"
        return cls(**values), sources


@dataclass(frozen=True)
class ServerConfig(FlagConfig):
    """What the daemon and the directory both take: their credentials, the
    ready file and logging."""

    token_file: Path | None = _option(
        None,
        "file holding the cluster token (owner-readable only): every call must carry it; needs --node-token-file",
        Path,
    )
    node_token_file: Path | None = _option(
        None,
        "file holding the node token (owner-readable only), which only daemons and the directory hold: "
        "it alone may exchange into caches, register nodes, renew leases and use the bulk port",
        Path,
    )
    tls_cert: Path | None = _option(None, "PEM certificate: TLS on the TCP port (needs --tls-key)", Path)
    tls_key: Path | None = _option(None, "PEM private key of --tls-cert", Path)
    tls_ca: Path | None = _option(
        None,
        "PEM CA that signed the cluster's certificates: verifies the servers this one calls and, with "
        "--tls-cert, requires callers to present a certificate too (mutual TLS)",
        Path,
    )
    dataset_roots: tuple[Path, ...] = _option(
        (),
        "directories a dataset ROOT must resolve to or lie under to be registered, separated by ':' (the "
        "PFS mount points or a job's dataset root); empty refuses every registration, since the server "
        "would otherwise serve anything its own user can read to every token holder",
        _paths,
        many=True,
    )
    max_sample_size: int = _option(
        1 << 30,
        "largest sample a dataset may hold (e.g. 1G, 256M): a larger one is refused, naming it, when its dataset "
        "is registered and when it is read; a daemon holds a sample whole while it serves it",
        _sample_size,
    )
    ready_file: Path | None = _option(None, "write a JSON file with the bound addresses once serving", Path)
    log_level: str = _option("info", "debug, info, warning or error", choices=("debug", "info", "warning", "error"))
    log_format: str = _option("text", "text or json", choices=("text", "json"))


@dataclass(frozen=True)
class DaemonConfig(ServerConfig):
    """Everything ``dataquay serve`` needs to run one node's daemon."""

    section: ClassVar[str] = "daemon"

    socket: Path = _option(default_socket_path, "unix socket for local clients", Path)
    socket_group: str = _option(
        "",
        "group of the unix socket (mode 0660): the users of this group may read through this daemon; "
        "empty keeps the daemon's own group",
    )
    users: str = _option(
        "one",
        "'one': every caller is trusted as the daemon's own user (a daemon of one user); 'apart': the callers "
        "of the unix socket are told apart by the uid the kernel names, and each registers and reads only roots "
        "it can read itself, preps in groups of its own user and hands over no payloads (a daemon shared by "
        "many users, e.g. under systemd)",
        choices=("one", "apart"),
    )
    shared_datasets: tuple[str, ...] = _option(
        (),
        "with --users apart: datasets every user of the unix socket may read, separated by ':'",
        lambda text: tuple(part for part in text.split(":") if part),
        many=True,
    )
    prep_groups_per_user: int = _option(
        8, "with --users apart: most prep groups one user may keep on this daemon (of 64)", _positive_int
    )
    listen: str = _option(
        "127.0.0.1:0",
        "TCP HOST:PORT for peers and remote tools; port 0 picks a free port, so that two users' daemons on one "
        "host do not collide (`dataquay status` and the ready file name the port bound)",
    )
    bulk_listen: str = _option(
        "",
        "TCP HOST:PORT of the bulk data path that peers read payloads over (the node token, TLS as "
        "--listen); empty takes a free port on --listen's host, 'off' has peers read over gRPC",
    )
    cache_dir: Path = _option(
        lambda: _home_dir("XDG_CACHE_HOME", ".cache") / "cache",
        "directory of the LMDB cache; put it on the node-local SSD",
        Path,
    )
    cache_size: int = _option(
        0, "cache capacity (e.g. 200G); 0 = 80%% of the cache file system's free space", parse_size
    )
    evict_min_age: float = _option(
        3600.0,
        "time a cached dataset no live job pins must go unused before a staging or an exchange that needs room "
        "evicts it, least recently used first (e.g. 1h, 7d; 0 lets any unpinned one go)",
        parse_duration,
    )
    cache_quotas: str = _option(
        "",
        "bytes of cache each user or project may hold, as KIND:NAME=SIZE separated by ',' with KIND user or "
        "group (a Unix group), e.g. user:alice=200G,group:vision=1T; a staging that would pass one is refused",
        checked_quotas,
    )
    state_dir: Path = _option(
        lambda: _home_dir("XDG_STATE_HOME", ".local/state"), "directory for the dataset registry and manifests", Path
    )
    pfs_threads: int = _option(8, "threads reading the parallel file system", _positive_int)
    pfs_bandwidth: int = _option(
        0, "cap on PFS reads in bytes/s (e.g. 500M); 0 = uncapped", lambda s: parse_size(s, "rate")
    )
    pfs_read_timeout: float = _option(
        60.0,
        "time a PFS read may make no progress before its batch fails with an error, instead of waiting on a "
        "file system that does not answer (e.g. 60s, 2m; a bare number is seconds)",
        _positive_duration,
    )
    metrics_host: str = _option(
        "127.0.0.1",
        "address of the Prometheus /metrics endpoint, which takes no token: this host only unless opened "
        "(0.0.0.0, or the cluster network's address, for a Prometheus elsewhere)",
    )
    metrics_port: int = _option(
        0, "port of the Prometheus endpoint; 0 picks a free port (`dataquay status` names it)", _port
    )
    max_batch: int = _option(4096, "most sample ids one read request may carry", _positive_int)
    max_calls_per_peer: int = _option(
        256, "most calls one remote host may have in flight; more are refused (RESOURCE_EXHAUSTED)", _positive_int
    )
    node_name: str = _option(gethostname, "this node's name in the cluster")
    directory: str = _option(
        "",
        "HOST:PORT of the directory service, or of its replicas as HOST:PORT,HOST:PORT (one etcd store); "
        "empty runs this node standalone",
    )
    peer_timeout: float = _option(
        5.0,
        "time a peer may take to answer a batch before its samples come from the PFS (e.g. 5s, 500ms; "
        "a bare number is seconds)",
        _positive_duration,
    )
    exchange_bandwidth: int = _option(
        0,
        "cap on the per-epoch exchange this node sends, in bytes/s (e.g. 200M), so that training reads "
        "keep the network; 0 = uncapped",
        lambda s: parse_size(s, "rate"),
    )
    heal_after: float = _option(
        300.0,
        "time a node of a job must be listed down before the other nodes fetch its share of the job (in mode "
        "partial, from the epoch the directory then records it absent): from peers first, the PFS last "
        "(e.g. 5m, 30s; a bare number is seconds); 0 = never",
        parse_duration,
    )
    heal_bandwidth: int = _option(
        0,
        "cap on what healing fetches into this node, in bytes/s (e.g. 100M), so that training reads keep "
        "the network and the PFS; 0 = uncapped",
        lambda s: parse_size(s, "rate"),
    )
    exchange_multicast: str = _option(
        "",
        "GROUP:PORT of the first of 256 IPv4 multicast addresses (GROUP and the 255 after it, all on PORT) that "
        "carry the coded pass of exchanges of jobs created with --exchange-coding coded|uber; each group of "
        "receivers travels on one of them, joined by its members only (one pool per cluster, e.g. "
        "239.255.16.1:47016); empty: those jobs exchange uncoded",
        _multicast,
    )
    exchange_multicast_interface: str = _option(
        "127.0.0.1", "local address of the interface that sends and joins --exchange-multicast"
    )
    spare_copies_fill: float = _option(
        0.5,
        "cache fill (0-1) below which samples given away in an exchange are kept as spare copies, so a "
        "later epoch that hands them back moves nothing; 0 deletes them once delivered",
        _fraction,
    )
    prefetch_memory: int = _option(
        256 << 20,
        "memory for samples prefetched for this node's ranks: what no cache holds, from the PFS in the order "
        "the ranks will read it, and (modes global and locality) what they will read from other nodes; "
        "0 reads nothing ahead",
        parse_size,
    )


def _store_url(text: str) -> str:
    """``embedded`` or an etcd:// URL whose endpoints are HOST:PORT."""
    text = text.strip()
    if text == "embedded":
        return text
    host_ports = text.partition("://")[2].strip("/").split(",")
    if not text.startswith("etcd://") or not all(
        p.rpartition(":")[2].isdigit() and p.rpartition(":")[0] for p in host_ports
    ):
        raise ValueError("expected 'embedded' or etcd://HOST:PORT[,HOST:PORT...]")
    return text


@dataclass(frozen=True)
class DirectoryConfig(ServerConfig):
    """Everything ``dataquay directory`` needs to run the cluster's directory."""

    env_prefix: ClassVar[str] = ENV_PREFIX + "DIRECTORY_"
    section: ClassVar[str] = "directory"

    listen: str = _option(
        "127.0.0.1:0",
        "TCP HOST:PORT daemons and tools connect to; port 0 picks a free port (printed at start and written to "
        "--ready-file), so that two users' directories on one host do not collide",
    )
    state_dir: Path = _option(
        lambda: _home_dir("XDG_STATE_HOME", ".local/state") / "directory",
        "directory for the node list, the job records and the dataset registry",
        Path,
    )
    http_host: str = _option(
        "127.0.0.1",
        "address of the HTTP endpoints /sd, /metrics and /healthz, which take no token: this host only unless "
        "opened (0.0.0.0 for a Prometheus elsewhere)",
    )
    http_port: int = _option(0, "port of the HTTP endpoints; 0 picks a free port", _port)
    lease_seconds: float = _option(
        10.0,
        "time without a heartbeat after which a node is marked down (e.g. 10s, 1m; a bare number is seconds)",
        _positive_duration,
    )
    heartbeat_seconds: float = _option(
        2.0,
        "how often daemons are told to renew their lease (e.g. 2s, 500ms); below --lease-seconds",
        _positive_duration,
    )
    store: str = _option(
        "embedded",
        "where the directory's state lives: 'embedded' (a file under --state-dir, one directory process) or "
        "etcd://HOST:PORT[,HOST:PORT...] (etcd v3, shared by every directory process given the same URL)",
        _store_url,
    )
    job_ttl: float = _option(
        7 * 86400.0,
        "time a job may stay idle (no join, no epoch reported) before the directory drops it, as `dataquay job "
        "drop` does (e.g. 7d, 12h; a bare number is seconds); 0 keeps jobs until dropped",
        parse_duration,
    )

    def __post_init__(self) -> None:
        if self.heartbeat_seconds >= self.lease_seconds:
            raise ConfigError(
                f"--heartbeat-seconds ({self.heartbeat_seconds:g}) must be below --lease-seconds "
                f"({self.lease_seconds:g}), or every node is marked down between two heartbeats"
            )


#: The services that read the config file, each from its own table.
SERVICES: tuple[type[FlagConfig], ...] = (DaemonConfig, DirectoryConfig)
