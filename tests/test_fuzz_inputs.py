"""Random and malformed input outside the RPCs: command lines, manifests and
config files. A user's mistake must end in one clear dataquay error (a
non-zero exit and one line on stderr for the CLI), never a Python traceback,
a hang or gigabytes of memory."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataquay.client.errors import ManifestError
from dataquay.client.manifest import Manifest
from dataquay.client.wire.channels import channel_options, grpc_target
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server import config as config_module
from dataquay.server.cli import main
from dataquay.server.config import SERVICES, ConfigFile, DaemonConfig, DirectoryConfig
from dataquay.server.errors import ConfigError
from dataquay.server.manifest_build import build_manifest
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess
from dataquay.server.tools.synthetic import make_files_dataset

FUZZ = settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
#: Growth of this process's peak memory over a fuzzing test that counts as a runaway allocation.
MAX_RSS_GROWTH_BYTES = 64 << 20


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.fixture(autouse=True)
def hermetic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No DATAQUAY_* variable of the calling shell and no /etc file leaks in;
    whatever a command writes lands under tmp_path."""
    for name in list(os.environ):
        if name.startswith("DATAQUAY_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_FILE", tmp_path / "etc" / "dataquay.toml")
    monkeypatch.chdir(tmp_path)


# ------------------------------------------------------------------------ CLI


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, DirectoryProcess]]:
    """A daemon serving dataset "ds" and a directory, for commands that talk to one."""
    base = tmp_path_factory.mktemp("cli")
    root = make_files_dataset(base / "pfs", 12, sizes=(100,), classes=2)
    directory = DirectoryProcess(base / "directory").start()
    daemon = DaemonProcess(base / "daemon")
    try:
        daemon.start()
        with grpc.insecure_channel(grpc_target(daemon.address), options=channel_options()) as channel:
            cache_pb2_grpc.CacheStub(channel).AddDataset(pb.AddDatasetRequest(name="ds", root=str(root)))
        yield daemon, directory
    finally:
        daemon.kill()
        directory.kill()


#: Values a user might mistype. Random text is never an absolute path (`token
#: new` would write there) nor dots only (`dataset add` would index the working directory).
odd_values = st.one_of(
    st.sampled_from(
        [
            "",
            "-1",
            "0",
            "1",
            "nan",
            "inf",
            "-inf",
            "1e400",
            "18446744073709551616",
            "0x10",
            "1.5",
            "²",
            "٣",
            "10Q",
            "5 parsecs",
            "-",
            "--",
            "a,b,,c",
            "ds",
            "global",
            "partial",
            "sample",
            "\0",
            "Δ€😀",
            "x" * 5000,
        ]
    ),
    st.text(max_size=20).filter(lambda t: not t.startswith("/") and t.strip(".") != ""),
)

#: Subcommands with their options; `--watch` (loops until interrupted) and the
#: commands that start servers or long runs are tried with fixed arguments below.
COMMANDS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("dataset", "add"): ("--format", "--replace", "--tar-member-samples"),
    ("dataset", "ls"): (),
    ("dataset", "show"): (),
    ("dataset", "drop"): (),
    ("stage",): (
        "--seed",
        "--quiet",
        "--job",
        "--mode",
        "--q",
        "--q-leaving",
        "--nodes",
        "--ranks-per-node",
        "--partition",
        "--batch-size",
    ),
    ("status",): ("--json",),
    ("job", "ls"): (),
    ("job", "show"): (),
    ("job", "drop"): (),
    ("job", "prune"): ("--idle", "--dry-run"),
    ("config", "show"): ("--config", "--json"),
    ("token", "new"): ("--force", "--node"),
    ("serve",): (*("--" + f.name.replace("_", "-") for f in fields(DaemonConfig)), "--config"),
    ("directory",): (*("--" + f.name.replace("_", "-") for f in fields(DirectoryConfig)), "--config"),
}
#: Options that take no value.
FLAGS = frozenset({"--replace", "--tar-member-samples", "--quiet", "--json", "--force", "--dry-run", "--node"})
#: How many positional arguments each subcommand takes.
POSITIONAL = {
    ("dataset", "add"): 2,
    ("dataset", "show"): 1,
    ("dataset", "drop"): 1,
    ("stage",): 1,
    ("job", "show"): 1,
    ("job", "drop"): 1,
    ("token", "new"): 1,
}
#: A last argument that makes each server command fail before it serves, whatever came before.
STOPPER = {("serve",): ("--max-batch", "0"), ("directory",): ("--lease-seconds", "0")}


@st.composite
def command_lines(draw: st.DrawFn, daemon: str, directory: str) -> list[str]:
    """A real subcommand, some of its options (or other words) with odd values,
    addressed at live servers or at nothing."""
    command = draw(st.sampled_from(sorted(COMMANDS)))
    positional = POSITIONAL.get(command, 0)
    argv = [*command, *(draw(odd_values) for _ in range(draw(st.sampled_from([positional, positional, 0, 3]))))]
    options = COMMANDS[command]
    for _ in range(draw(st.integers(0, 4 if options else 0))):
        option = draw(st.sampled_from(options))
        argv.append(option)
        if option not in FLAGS:
            argv.append(draw(odd_values))
    if draw(st.integers(0, 9)) == 0:
        argv.append(draw(st.sampled_from(["--bogus", "x"])))
    if command[0] in ("dataset", "stage", "status"):
        argv += ["--addr", draw(st.sampled_from([daemon, "/nonexistent.sock", "127.0.0.1:1"]))]
    if command[0] in ("job", "stage", "status") and draw(st.booleans()):
        argv += ["--directory", draw(st.sampled_from([directory, "127.0.0.1:1", "::::"]))]
    return argv + list(STOPPER.get(command, ()))


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The exit code and stderr of ``dataquay ARGV`` run in this process."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


def assert_clear_failure(code: int, err: str) -> None:
    """A failure prints one ``dataquay...: error: ...`` message (after the usage
    for bad usage) and no traceback. The message may quote input that holds line breaks."""
    assert "Traceback" not in err
    if code == 1:
        assert err.startswith("dataquay: error: ") and err.count("dataquay: error: ") == 1, err[-500:]
    elif code != 0:
        assert err.startswith("usage: dataquay") or err.startswith("dataquay"), err[-500:]
        assert err.count(": error: ") == 1 and "\ndataquay" in err, err[-500:]


def test_random_command_lines_fail_with_one_clear_line(
    live: tuple[DaemonProcess, DirectoryProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    daemon, directory = live

    @FUZZ
    @given(command_lines(daemon.address, directory.address))
    def fuzz(argv: list[str]) -> None:
        code, err = run_main(argv, capsys)
        assert_clear_failure(code, err)
        if argv[0] in STOPPER:
            assert code != 0

    fuzz()
    assert daemon.process is not None and daemon.process.poll() is None


@pytest.mark.parametrize(
    "argv",
    [
        ["stage", "ds", "--seed", "-5"],
        ["stage", "ds", "--seed", "18446744073709551616"],
        ["status", "--watch", "-1", "--addr", "DAEMON"],
        ["status", "--watch", "nan", "--addr", "DAEMON"],
        ["token", "new", "a\0b"],
        ["dataset", "add", "x", "", "--addr", "/nonexistent.sock"],
        [
            "simulate",
            "--nodes",
            "0",
            "--samples",
            "10",
            "--sample-bytes",
            "1",
            "--per-rank-batch",
            "1",
            "--ranks-per-node",
            "1",
            "--mode",
            "global",
        ],
        [
            "simulate",
            "--nodes",
            "2",
            "--samples",
            "-10",
            "--sample-bytes",
            "1",
            "--per-rank-batch",
            "1",
            "--ranks-per-node",
            "1",
            "--mode",
            "nope",
        ],
        ["analyze", "ds", "--steps", "-1", "--addr", "/nonexistent.sock"],
        ["cluster", "down", "--base-dir", "missing"],
        ["demo", "--samples", "x"],
    ],
)
def test_bad_arguments_to_each_command_fail_with_one_clear_line(
    argv: list[str], live: tuple[DaemonProcess, DirectoryProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_main([live[0].address if arg == "DAEMON" else arg for arg in argv], capsys)
    assert code != 0
    assert_clear_failure(code, err)


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--max-batch", "-1"],
        ["serve", "--config", "missing.toml"],
        ["directory", "--heartbeat-seconds", "5", "--lease-seconds", "1"],
        ["stage", "ds", "--seed", "-1"],
        ["frobnicate"],
    ],
)
def test_a_bad_command_line_in_a_fresh_process_prints_no_traceback(argv: list[str], tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("DATAQUAY_")},
    )
    assert done.returncode in (1, 2)
    assert_clear_failure(done.returncode, done.stderr)


# ------------------------------------------------------------------- manifests


@pytest.fixture(scope="module")
def manifest_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    root = make_files_dataset(tmp_path_factory.mktemp("manifest") / "pfs", 20, sizes=(10, 300), classes=3)
    return build_manifest(root).to_bytes()


def use(manifest: Manifest) -> None:
    """Everything a reader does with a manifest, over every sample.

    The manifest is the files dataset's, however damaged: no damage of a few
    bytes that still parses turns it into another format or a grouped tar.
    """
    for sample_id in range(manifest.num_samples):
        manifest.location(sample_id)
        manifest.label(sample_id)
    manifest.size_stats()
    manifest.shard_groups()
    assert manifest.format == "files" and manifest.tar_grouped is False


@st.composite
def damaged(draw: st.DrawFn, good: bytes) -> bytes:
    """``good`` truncated, with bits flipped or bytes overwritten, or plain random bytes."""
    how = draw(st.sampled_from(["truncated", "flipped", "overwritten", "random", "magic+random"]))
    if how == "truncated":
        return good[: draw(st.integers(0, len(good) - 1))]
    if how == "random":
        return draw(st.binary(max_size=2000))
    if how == "magic+random":
        return good[:12] + draw(st.binary(max_size=2000))
    data = bytearray(good)
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.integers(0, len(data) - 1))
        if how == "flipped":
            data[at] ^= 1 << draw(st.integers(0, 7))
        else:
            data[at] = draw(st.integers(0, 255))
    return bytes(data)


def test_damaged_manifests_raise_a_manifest_error(manifest_bytes: bytes) -> None:
    use(Manifest(manifest_bytes))
    before = peak_rss_bytes()

    @settings(FUZZ, max_examples=400)
    @given(damaged(manifest_bytes))
    def fuzz(data: bytes) -> None:
        try:
            use(Manifest(data))
        except ManifestError:
            pass

    fuzz()
    assert peak_rss_bytes() - before < MAX_RSS_GROWTH_BYTES


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"[" * 100_000, "malformed manifest header"),
        (b'{"arrays": {"sample_path": [0, -1000000000000000000000000000000]}}', "malformed manifest header"),
        (b'{"arrays": null}', "malformed manifest header"),
        (b"\xff\xfe", "malformed manifest header"),
    ],
)
def test_hostile_manifest_headers_raise_a_manifest_error(header: bytes, message: str) -> None:
    data = b"DQMANIF1" + len(header).to_bytes(4, "little") + header
    with pytest.raises(ManifestError, match=message):
        Manifest(data)


def test_a_manifest_without_root_or_format_raises_a_manifest_error(manifest_bytes: bytes) -> None:
    for key, other in ((b'"root"', b'"rooX"'), (b'"format"', b'"formaX"')):
        renamed = manifest_bytes.replace(key, other, 1)
        with pytest.raises(ManifestError, match="manifest header has no"):
            Manifest(renamed)


def test_a_path_that_is_not_utf8_raises_a_manifest_error(manifest_bytes: bytes) -> None:
    manifest = Manifest(manifest_bytes)
    first = manifest.path(0).encode()
    broken = Manifest(manifest_bytes.replace(first, b"\xff" + first[1:], 1))
    with pytest.raises(ManifestError, match="manifest path 0 is not UTF-8 text"):
        broken.location(0)


def test_a_manifest_file_that_cannot_be_read_raises_a_manifest_error(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="cannot read manifest"):
        Manifest.load(tmp_path / "missing.dq")


# ---------------------------------------------------------------- config files

KEYS = sorted({f.name for service in SERVICES for f in fields(service)})
toml_scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=20),
    st.sampled_from(["200G", "-1", "0", "2s", "debug", "127.0.0.1:0", "x" * 3000]),
)
toml_values = st.recursive(toml_scalars, lambda inner: st.lists(inner, max_size=3), max_leaves=5)


def toml_literal(value: object) -> str:
    """``value`` written as TOML (strings as basic strings with escapes)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    escaped = "".join(c if c.isprintable() and c not in '"\\' else f"\\u{ord(c):04x}" for c in str(value))
    return f'"{escaped}"'


@st.composite
def config_texts(draw: st.DrawFn) -> str:
    """Config documents: well-formed TOML with real and unknown tables and keys
    and values of any type, or TOML broken in random places."""
    lines = []
    for table in draw(st.lists(st.sampled_from(["daemon", "directory", "deamon", "x"]), max_size=3, unique=True)):
        lines.append(f"[{table}]")
        for key in draw(
            st.lists(
                st.one_of(st.sampled_from(KEYS), st.sampled_from(["cache-size", "bogus"])), max_size=4, unique=True
            )
        ):
            lines.append(f"{key} = {toml_literal(draw(toml_values))}")
    if draw(st.booleans()):
        lines.insert(0, f"stray = {toml_literal(draw(toml_scalars))}")
    text = "\n".join(lines)
    if draw(st.booleans()) and text:
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.text(max_size=6)) + text[at:]
    return text


def test_random_config_files_load_or_fail_with_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "dataquay.toml"

    @FUZZ
    @given(st.one_of(config_texts().map(str.encode), st.binary(max_size=200)))
    def fuzz(data: bytes) -> None:
        path.write_bytes(data)
        try:
            file = ConfigFile.load(path, "--config")
            for service in SERVICES:
                service.resolve({}, {}, file)
        except ConfigError as exc:
            assert str(path) in str(exc) or "--" in str(exc)

    fuzz()


def test_serve_and_config_show_with_a_bad_file_fail_with_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "dataquay.toml"

    @settings(FUZZ, max_examples=60)
    @given(config_texts())
    def fuzz(text: str) -> None:
        path.write_text(text)
        for argv in (["config", "show", "--config", str(path)], ["serve", "--config", str(path), "--max-batch", "0"]):
            code, err = run_main(argv, capsys)
            assert_clear_failure(code, err)
            if argv[0] == "serve":
                assert code == 1

    fuzz()
