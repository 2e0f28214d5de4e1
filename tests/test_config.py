"""Configuration: the TOML file, its precedence under the environment and the
flags, its error messages, durations and sizes, `dataquay config show`, and a
daemon started from a file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import grpc
import pytest

from dataquay.client.wire.channels import channel_options, grpc_target
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server import config as config_module
from dataquay.server.cli import main
from dataquay.server.config import ConfigFile, DaemonConfig, DirectoryConfig
from dataquay.server.errors import ConfigError
from dataquay.server.sizes import parse_duration, parse_size
from dataquay.server.tools.processes import DaemonProcess


@pytest.fixture(autouse=True)
def hermetic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No DATAQUAY_* variable of the calling shell and no /etc file leaks into a test."""
    for name in list(os.environ):
        if name.startswith("DATAQUAY_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_FILE", tmp_path / "etc" / "dataquay.toml")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def names(service: type[DaemonConfig] | type[DirectoryConfig]) -> set[str]:
    return {f.name for f in fields(service)}


def load(path: Path) -> ConfigFile:
    return ConfigFile.load(path, "--config")


# --- precedence: flag > env > file > default -----------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "env", "in_file", "expected", "source"),
    [
        ("3G", "2G", True, 3 << 30, "flag --cache-size"),
        (None, "2G", True, 2 << 30, "env DATAQUAY_CACHE_SIZE"),
        (None, None, True, 1 << 30, "file {path}"),
        (None, None, False, 0, "default"),
    ],
)
def test_daemon_setting_comes_from_the_highest_layer_that_sets_it(
    tmp_path: Path, flag: str | None, env: str | None, in_file: bool, expected: int, source: str
) -> None:
    path = write(tmp_path / "dq.toml", '[daemon]\ncache_size = "1G"\n' if in_file else "[daemon]\n")
    environment = {"DATAQUAY_CACHE_SIZE": env} if env is not None else {}
    config, sources = DaemonConfig.resolve({"cache_size": flag}, environment, load(path))
    assert config.cache_size == expected
    assert sources["cache_size"] == source.format(path=path)
    assert sources["listen"] == "default" and config.listen == "127.0.0.1:0"


@pytest.mark.parametrize(
    ("flag", "env", "in_file", "expected", "source"),
    [
        ("40", "30s", True, 40.0, "flag --lease-seconds"),
        (None, "30s", True, 30.0, "env DATAQUAY_DIRECTORY_LEASE_SECONDS"),
        (None, None, True, 20.0, "file {path}"),
        (None, None, False, 10.0, "default"),
    ],
)
def test_directory_setting_comes_from_the_highest_layer_that_sets_it(
    tmp_path: Path, flag: str | None, env: str | None, in_file: bool, expected: float, source: str
) -> None:
    path = write(tmp_path / "dq.toml", '[directory]\nlease_seconds = "20s"\n' if in_file else "")
    environment = {"DATAQUAY_DIRECTORY_LEASE_SECONDS": env} if env is not None else {}
    config, sources = DirectoryConfig.resolve({"lease_seconds": flag}, environment, load(path))
    assert config.lease_seconds == expected
    assert sources["lease_seconds"] == source.format(path=path)


def test_each_service_reads_only_its_own_table(tmp_path: Path) -> None:
    path = write(tmp_path / "dq.toml", '[daemon]\nlisten = "10.0.0.1:7070"\n[directory]\nlisten = "10.0.0.2:7071"\n')
    file = load(path)
    assert DaemonConfig.from_sources({}, {}, file).listen == "10.0.0.1:7070"
    assert DirectoryConfig.from_sources({}, {}, file).listen == "10.0.0.2:7071"


def test_file_values_take_toml_numbers_and_strings(tmp_path: Path) -> None:
    path = write(
        tmp_path / "dq.toml",
        "[daemon]\ncache_size = 1048576\npfs_threads = 16\npeer_timeout = 2.5\nspare_copies_fill = 0\n"
        'pfs_bandwidth = "500M"\ncache_dir = "/local/ssd/dq"\n',
    )
    config = DaemonConfig.from_sources({}, {}, load(path))
    assert (config.cache_size, config.pfs_threads, config.peer_timeout) == (1 << 20, 16, 2.5)
    assert config.spare_copies_fill == 0.0 and config.pfs_bandwidth == 500 << 20
    assert config.cache_dir == Path("/local/ssd/dq")


# --- finding the file ----------------------------------------------------------------------------


def test_default_file_is_read_only_when_it_exists(tmp_path: Path) -> None:
    assert ConfigFile.find(None, {}) is None
    write(config_module.DEFAULT_CONFIG_FILE, '[daemon]\nnode_name = "from-etc"\n')
    file = ConfigFile.find(None, {})
    assert file is not None and file.origin == "default"
    assert DaemonConfig.from_sources({}, {}, file).node_name == "from-etc"


def test_config_flag_beats_the_variable_which_beats_the_default_file(tmp_path: Path) -> None:
    write(config_module.DEFAULT_CONFIG_FILE, "")
    named_by_env = write(tmp_path / "env.toml", "")
    named_by_flag = write(tmp_path / "flag.toml", "")
    env = {"DATAQUAY_CONFIG": str(named_by_env)}
    by_flag = ConfigFile.find(str(named_by_flag), env)
    by_env = ConfigFile.find(None, env)
    assert by_flag is not None and (by_flag.path, by_flag.origin) == (named_by_flag, "--config")
    assert by_env is not None and (by_env.path, by_env.origin) == (named_by_env, "DATAQUAY_CONFIG")


@pytest.mark.parametrize(
    ("flag", "env", "message"),
    [
        ("missing.toml", {}, "config file {tmp}/missing.toml (from --config) does not exist"),
        (
            None,
            {"DATAQUAY_CONFIG": "{tmp}/missing.toml"},
            "config file {tmp}/missing.toml (from DATAQUAY_CONFIG) does not exist",
        ),
    ],
)
def test_a_named_config_file_must_exist(tmp_path: Path, flag: str | None, env: dict[str, str], message: str) -> None:
    environment = {name: value.format(tmp=tmp_path) for name, value in env.items()}
    with pytest.raises(ConfigError) as caught:
        ConfigFile.find(str(tmp_path / flag) if flag else None, environment)
    assert str(caught.value) == message.format(tmp=tmp_path)


# --- errors: each names the file, the table and the key ------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[daemon]\ncache_size = "12Q"\n', '[daemon] cache_size = "12Q": expected a size like 200G or 512MiB'),
        ('[daemon]\ncache_sise = "12G"\n', "unknown key cache_sise in [daemon]; did you mean cache_size?"),
        ('[daemon]\ncache-size = "12G"\n', "unknown key cache-size in [daemon]; did you mean cache_size?"),
        ("[daemon]\nturbo = true\n", "unknown key turbo in [daemon]"),
        ('[directory]\nlease_second = "5s"\n', "unknown key lease_second in [directory]; did you mean lease_seconds?"),
        ("[demon]\n", "unknown table [demon]; did you mean [daemon]?"),
        ("[storage]\n", "unknown table [storage]; expected [daemon] or [directory]"),
        ('cache_size = "1G"\n', 'cache_size = "1G" is outside a table; settings go under [daemon] or [directory]'),
        (
            '[daemon]\nnode_name = "a"\ncache_size = "1G\n',
            "invalid TOML: Illegal character '\\n' (at line 3, column 17)",
        ),
        (
            '[daemon]\npeer_timeout = "soon"\n',
            '[daemon] peer_timeout = "soon": expected a duration like 2s, 500ms or 5m',
        ),
        ("[daemon]\npeer_timeout = 0\n", "[daemon] peer_timeout = 0: expected a duration above 0, like 2s or 500ms"),
        ("[daemon]\nnode_name = 17\n", "[daemon] node_name = 17: expected a string"),
        ("[daemon]\npfs_threads = true\n", "[daemon] pfs_threads = true: expected a number or a string"),
        ("[daemon]\npfs_threads = 0\n", "[daemon] pfs_threads = 0: expected a whole number above 0"),
        ('[daemon]\nlog_level = "loud"\n', '[daemon] log_level = "loud": expected one of debug, info, warning, error'),
        ("[directory]\nhttp_port = 70000\n", "[directory] http_port = 70000: expected a port number 0-65535"),
        (
            '[daemon]\nexchange_multicast = "10.0.0.1:47016"\n',
            '[daemon] exchange_multicast = "10.0.0.1:47016": '
            "expected GROUP:PORT with an IPv4 multicast group (224.0.0.0/4) that has 255 more after it, like "
            "239.255.16.1:47016",
        ),
        (
            '[daemon]\nexchange_multicast = "239.255.255.250:47016"\n',
            "[daemon] exchange_multicast = "
            '"239.255.255.250:47016": expected GROUP:PORT with an IPv4 multicast group (224.0.0.0/4) that has 255 '
            "more after it, like 239.255.16.1:47016",
        ),
    ],
)
def test_config_file_errors_name_the_file_and_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path / "dq.toml", text)
    with pytest.raises(ConfigError) as caught:
        file = load(path)
        DaemonConfig.from_sources({}, {}, file)
        DirectoryConfig.from_sources({}, {}, file)
    assert str(caught.value) == f"{path}: {message}"


def test_a_config_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path)
    assert str(caught.value) == f"{tmp_path}: cannot read the config file: Is a directory"


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"cache_size": "12Q"}, {}, "--cache-size: bad size '12Q': expected a size like 200G or 512MiB"),
        (
            {},
            {"DATAQUAY_PEER_TIMEOUT": "soon"},
            "DATAQUAY_PEER_TIMEOUT: bad duration 'soon': expected a duration like 2s, 500ms or 5m",
        ),
        (
            {},
            {"DATAQUAY_LOG_LEVEL": "loud"},
            "DATAQUAY_LOG_LEVEL: bad value 'loud': expected one of debug, info, warning, error",
        ),
        ({"spare_copies_fill": "most"}, {}, "--spare-copies-fill: bad value 'most': expected a fraction from 0 to 1"),
    ],
)
def test_flag_and_variable_errors_name_the_flag_or_the_variable(
    flags: dict[str, str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        DaemonConfig.from_sources(flags, env)
    assert str(caught.value) == message


# --- durations and sizes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("2s", 2.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("7d", 604800.0),
        ("500ms", 0.5),
        ("3", 3.0),
        ("0.25", 0.25),
        (" 2 s ", 2.0),
    ],
)
def test_durations_accept_units_and_plain_seconds(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "", "-1s", "2w", "5 minutes", "1e3"])
def test_bad_durations_say_what_was_expected(text: str) -> None:
    with pytest.raises(ConfigError, match="expected a duration like 2s, 500ms or 5m"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("200G", 200 << 30),
        ("512MiB", 512 << 20),
        ("512Mi", 512 << 20),
        ("1.5TB", 1_500_000_000_000),
        ("64KB", 64_000),
        ("4096", 4096),
        ("4096B", 4096),
    ],
)
def test_sizes_accept_binary_and_decimal_units(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["12Q", "5i", "5iB", "GiB", "1..5G"])
def test_bad_sizes_say_what_was_expected(text: str) -> None:
    with pytest.raises(ConfigError, match="expected a size like 200G or 512MiB"):
        parse_size(text)


def test_duration_options_keep_their_flag_names_and_take_units() -> None:
    daemon = DaemonConfig.from_sources({"peer_timeout": "500ms"}, {})
    directory = DirectoryConfig.from_sources({"lease_seconds": "1m"}, {"DATAQUAY_DIRECTORY_HEARTBEAT_SECONDS": "5"})
    assert daemon.peer_timeout == 0.5
    assert (directory.lease_seconds, directory.heartbeat_seconds) == (60.0, 5.0)


# --- dataquay config show ------------------------------------------------------------------------


def test_config_show_prints_every_value_and_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path / "dq.toml",
        '[daemon]\ncache_size = "200G"\nnode_name = "gpu017"\n[directory]\nlease_seconds = "30s"\n',
    )
    monkeypatch.setenv("DATAQUAY_NODE_NAME", "from-env")
    assert main(["config", "show", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    assert out.splitlines()[0] == f"config file: {path} (from --config)"
    assert ["cache_size", str(200 << 30), "file", str(path)] in lines
    assert ["node_name", "from-env", "env", "DATAQUAY_NODE_NAME"] in lines
    assert ["lease_seconds", "30", "file", str(path)] in lines
    assert ["peer_timeout", "5", "default"] in lines and ["ready_file", "-", "default"] in lines
    daemon_keys = out.split("[directory]")[0]
    assert all(f"\n{name} " in daemon_keys for name in names(DaemonConfig))


def test_config_show_json_has_every_option_of_both_services(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "dq.toml", '[daemon]\npeer_timeout = "2s"\n')
    assert main(["config", "show", "--config", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["config_file"] == str(path)
    assert set(shown["daemon"]) == set(names(DaemonConfig))
    assert set(shown["directory"]) == set(names(DirectoryConfig))
    assert shown["daemon"]["peer_timeout"] == {"value": 2.0, "source": f"file {path}"}
    assert shown["daemon"]["ready_file"] == {"value": None, "source": "default"}
    assert shown["directory"]["heartbeat_seconds"] == {"value": 2.0, "source": "default"}


def test_config_show_without_a_file_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"config file: none ({config_module.DEFAULT_CONFIG_FILE} does not exist)"


def test_config_show_error_exits_1_with_one_line_on_stderr(tmp_path: Path) -> None:
    path = write(tmp_path / "dq.toml", '[daemon]\ncache_size = "12Q"\n')
    env = {name: value for name, value in os.environ.items() if not name.startswith("DATAQUAY_")}
    result = subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", "config", "show", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (
        f'dataquay: error: {path}: [daemon] cache_size = "12Q": expected a size like 200G or 512MiB\n'
    )


# --- a daemon started from a file ----------------------------------------------------------------


def test_daemon_starts_from_a_config_file_and_its_flags_still_win(tmp_path: Path) -> None:
    path = write(
        tmp_path / "dq.toml",
        # The launcher passes --listen 127.0.0.1:0; the file's unusable address must lose to it.
        '[daemon]\nnode_name = "toml-node"\ncache_size = "64MiB"\npeer_timeout = "2s"\nlisten = "192.0.2.1:1"\n',
    )
    daemon = DaemonProcess(tmp_path / "node", ("--config", str(path))).start()
    try:
        assert daemon.ready is not None and daemon.ready["node"] == "toml-node"
        with grpc.insecure_channel(grpc_target(daemon.address), options=channel_options()) as channel:
            info = cache_pb2_grpc.CacheStub(channel).Info(pb.InfoRequest(), timeout=10)
        assert info.node == "toml-node" and info.cache_capacity == 64 << 20
        assert info.tcp_address.startswith("127.0.0.1:")
    finally:
        daemon.kill()
