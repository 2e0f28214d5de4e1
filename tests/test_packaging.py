"""What a release ships: an sdist that holds everything the tests need, a wheel
with both licences, and an install that works where no C compiler is found."""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD = "import sys; from setuptools import build_meta as b; print(getattr(b, sys.argv[1])(sys.argv[2]))"


def build(hook: str, source: Path, out: Path, **env: str) -> Path:
    """Runs a PEP 517 hook of setuptools in ``source``: what pip runs, less the isolation."""
    done = subprocess.run(
        [sys.executable, "-c", BUILD, hook, str(out)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr
    return out / done.stdout.splitlines()[-1]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("build_sdist", REPO, tmp_path_factory.mktemp("sdist"))


@pytest.fixture(scope="module")
def wheel_without_compiler(sdist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from the sdist where the C compiler fails, as on a node without one."""
    unpacked = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(sdist) as archive:
        archive.extractall(unpacked, filter="data")
    (source,) = unpacked.iterdir()
    return build("build_wheel", source, tmp_path_factory.mktemp("wheel"), CC="/bin/false")


def test_the_sdist_holds_the_licence_and_every_file_the_tests_read(sdist: Path) -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: which files are the project's is git's to say")
    listed = subprocess.run(
        ["git", "ls-files", "tests", "deploy", "bench", "docs"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    with tarfile.open(sdist) as archive:
        shipped = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    needed = {
        "LICENSE",
        "Makefile",
        "README.md",
        "mkdocs.yml",
        "client/third_party/xxhash/LICENSE",
        "tests/conftest.py",
        *(name for name in listed if not name.startswith("bench/results/")),
    }
    assert sorted(needed - shipped) == []
    # The benchmarks' recorded runs are the repository's record, not a source release's.
    assert [name for name in shipped if name.startswith("bench/results/")] == []
    assert (REPO / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]


def test_the_wheel_carries_both_licences_and_no_tests(wheel_without_compiler: Path) -> None:
    with zipfile.ZipFile(wheel_without_compiler) as archive:
        names = archive.namelist()
        metadata = archive.read("dataquay-0.1.0.dist-info/METADATA").decode()
    licences = sorted(n.split("/licenses/", 1)[1] for n in names if "/licenses/" in n)
    assert licences == ["LICENSE", "client/third_party/xxhash/LICENSE"]
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert not [n for n in names if n.startswith("tests/") or "/tests/" in n]


def test_without_a_c_compiler_the_install_runs_the_python_loops_and_says_so_once(
    wheel_without_compiler: Path, tmp_path: Path
) -> None:
    with zipfile.ZipFile(wheel_without_compiler) as archive:
        assert not [n for n in archive.namelist() if n.endswith(".so")]
        archive.extractall(tmp_path / "installed")
    # -S: the dependencies from this environment, but not its editable dataquay.
    script = (
        "import sys; sys.path[:0] = sys.argv[1:]\n"
        "from dataquay.client.wire import record_loops, records\n"
        "import dataquay.client.local\n"
        "assert not record_loops.COMPILED and record_loops.__file__.startswith(sys.argv[1])\n"
        "value = records.encode_value(b'sample')\n"
        "assert bytes(records.decode_value(value)) == b'sample'\n"
        "assert records.stored_checksum(value) == records.checksum(b'sample')\n"
        "from dataquay.server.node.exchange import coding\n"
        "assert not coding.COMPILED and coding.__file__.startswith(sys.argv[1])\n"
        "print(dataquay.client.local.sample_keys([1, 2]))\n"
    )
    ran = subprocess.run(
        [sys.executable, "-S", "-c", script, str(tmp_path / "installed"), *site.getsitepackages()],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": ""},
        start_new_session=True,  # a process group of its own, which no earlier run has told
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == repr([(1).to_bytes(8, "big"), (2).to_bytes(8, "big")])
    assert ran.stderr.count("not built") == 1 and "compiled rate" in ran.stderr


def test_the_wheel_carries_the_deploy_files_and_a_short_description_with_classifiers(
    wheel_without_compiler: Path,
) -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: which files are the project's is git's to say")
    deploy = subprocess.run(
        ["git", "ls-files", "deploy"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    with zipfile.ZipFile(wheel_without_compiler) as archive:
        names = set(archive.namelist())
        shipped = {name: archive.read(name) for name in names if name.startswith("dataquay/server/deploy/")}
        metadata = archive.read("dataquay-0.1.0.dist-info/METADATA").decode()
    assert deploy and sorted("dataquay/server/" + path for path in deploy) == sorted(shipped)
    assert all(shipped["dataquay/server/" + path] == (REPO / path).read_bytes() for path in deploy)
    headers, _, description = metadata.partition("\n\n")
    assert "Classifier: Operating System :: POSIX :: Linux" in headers.splitlines()
    assert "Classifier: Programming Language :: Python :: 3.11" in headers.splitlines()
    # Short, and no link relative to the repository, which breaks on an index's page.
    assert 200 < len(description) < 2000 and re.findall(r"\]\((?!https?://)", description) == []


def test_python_m_dataquay_and_its_version_from_the_wheel_and_from_the_clone(
    wheel_without_compiler: Path, tmp_path: Path
) -> None:
    with zipfile.ZipFile(wheel_without_compiler) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "installed")
    assert sorted(n for n in names if re.fullmatch(r"dataquay/[^/]+", n)) == [
        "dataquay/__init__.py",
        "dataquay/__main__.py",
    ]
    # -S: the dependencies from this environment, but not its editable dataquay.
    from_wheel = subprocess.run(
        [sys.executable, "-S", "-m", "dataquay", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "installed"), *site.getsitepackages()])},
    )
    assert (from_wheel.returncode, from_wheel.stdout) == (0, "dataquay 0.1.0\n"), from_wheel.stderr
    # The editable install of the clone (make's .venv), run away from the repository:
    # the package is server/'s folder, and the protos' and client's folders are its too.
    script = (
        "import runpy, dataquay, dataquay.client, dataquay.protos\n"
        "print(dataquay.__path__[0], dataquay.__version__)\n"
        "runpy.run_module('dataquay', run_name='__main__')"
    )
    from_clone = subprocess.run(
        [sys.executable, "-c", script, "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert from_clone.returncode == 0, from_clone.stderr
    assert from_clone.stdout.splitlines() == [f"{REPO / 'server' / 'dataquay'} 0.1.0", "dataquay 0.1.0"]


def _floor(requirements: list[str], name: str) -> str:
    (floor,) = [r.split(">=", 1)[1].split(";")[0].strip() for r in requirements if re.match(rf"{name}>=", r)]
    return floor


def test_the_runtime_floors_are_what_the_generated_code_checks_at_import() -> None:
    """A floor below the generated files' own check installs and then fails at
    import; one above it refuses environments the code runs in."""
    requirements = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    generated = REPO / "protos" / "dataquay" / "protos"
    protobuf = {
        ".".join(m)
        for f in generated.glob("*_pb2.py")
        for m in re.findall(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", f.read_text())
    }
    grpc = {
        m
        for f in generated.glob("*_pb2_grpc.py")
        for m in re.findall(r"GRPC_GENERATED_VERSION = '([\d.]+)'", f.read_text())
    }
    assert len(protobuf) == 1 and len(grpc) == 1, (protobuf, grpc)
    assert _floor(requirements, "protobuf") == protobuf.pop()
    floor = grpc.pop()
    assert _floor(requirements, "grpcio") == floor and _floor(requirements, "grpcio-health-checking") == floor


def test_test_oldest_pins_every_runtime_dependency_at_its_floor() -> None:
    """`make test-oldest` installs what .ci/oldest-constraints prints: each
    dependency of pyproject at the lowest version it declares, markers kept."""
    requirements = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    printed = subprocess.run(
        [sys.executable, str(REPO / ".ci" / "oldest-constraints"), str(REPO / "pyproject.toml")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    assert len(printed) == len(requirements)
    for line, requirement in zip(printed, requirements):
        name = re.match(r"[\w.-]+", requirement)
        assert name is not None and line.split(" ;")[0] == f"{name[0]}=={_floor(requirements, name[0])}"
        assert (";" in line) == (";" in requirement)
    makefile = (REPO / "Makefile").read_text()
    assert "-c $(OLDEST)/constraints.txt" in makefile and ".ci/oldest-constraints pyproject.toml" in makefile
