"""What the command line tells about itself: its version, a help text for every
argument, the defaults of the services' flags, and only files it wrote."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

from dataquay.server.cli import build_parser, main
from dataquay.server.tools import data_stall


def commands(parser: argparse.ArgumentParser, path: str = "dataquay") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, f"{path} {name}")


def test_version_is_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"dataquay {version('dataquay')}\n"


def test_every_argument_of_every_command_has_a_help_text() -> None:
    bare = [
        f"{path}: {action.option_strings or action.dest}"
        for path, parser in commands(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not action.help
    ]
    assert not bare


@pytest.mark.parametrize("command", ["serve", "directory"])
def test_every_flag_of_the_services_shows_its_default(command: str) -> None:
    parser = dict(commands(build_parser()))[f"dataquay {command}"]
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 10
    assert [a.option_strings[0] for a in flags if "default" not in str(a.help)] == []
    assert "(default: none) [env " in " ".join(parser.format_help().split())


def test_serve_help_shows_the_default_values() -> None:
    text = " ".join(dict(commands(build_parser()))["dataquay serve"].format_help().split())
    assert "(default: 8) [env DATAQUAY_PFS_THREADS]" in text
    assert "(default: 127.0.0.1:0) [env DATAQUAY_LISTEN]" in text


def test_bench_without_matplotlib_writes_no_plot_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the extra imports
    rows = [data_stall.EpochRow("direct", 1, 1.0, 0.5, 50.0, 0.0, 0.0, 1.0, 0.0)]
    assert not data_stall.plot(rows, tmp_path / "stall.png")
    assert list(tmp_path.iterdir()) == []
    line = data_stall.results_line(tmp_path, plotted=False)
    assert "stall.png" not in line and "no plot" in line
    assert "stall.png" in data_stall.results_line(tmp_path, plotted=True)
