"""Usage errors name the command they belong to and what was probably meant."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from dataquay.server.cli import main


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def test_a_mistyped_option_of_a_command_gets_that_commands_usage_and_the_option_meant(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = usage_error(capsys, "stage", "imgs", "--jbo", "run17")
    assert err.startswith("usage: dataquay stage ")
    assert err.rstrip().endswith("dataquay stage: error: unrecognized arguments: --jbo run17; did you mean --job?")


def test_a_mistyped_option_two_commands_deep(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, "cache", "evict", "--dry-rn")
    assert err.startswith("usage: dataquay cache evict ")
    assert "did you mean --dry-run?" in err


@pytest.mark.parametrize(
    ("argv", "meant"),
    [(("stgae", "imgs"), "stage"), (("cache", "evcit"), "evict"), (("stage", "imgs", "--mode", "globl"), "global")],
)
def test_a_mistyped_command_or_choice_keeps_the_choices_and_names_the_closest(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], meant: str
) -> None:
    err = usage_error(capsys, *argv)
    assert "invalid choice" in err and "(choose from" in err
    assert err.rstrip().endswith(f"did you mean {meant}?")


def test_nothing_close_suggests_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, "stage", "imgs", "--zzzzzz")
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err


def test_every_setting_of_serve_and_directory_is_under_a_heading_of_its_help() -> None:
    from dataclasses import fields

    from dataquay.server.config import OPTION_GROUPS, DaemonConfig, DirectoryConfig

    grouped = [name for _, names in OPTION_GROUPS for name in names]
    assert len(grouped) == len(set(grouped))
    for service in (DaemonConfig, DirectoryConfig):
        assert {f.name for f in fields(service)} <= set(grouped), service.__name__


def test_serve_help_shows_its_headings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = capsys.readouterr().out
    headings = [line for line in help_text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings[1:] == [
        "where it listens:",
        "the cache:",
        "the PFS:",
        "users of the node:",
        "the cluster:",
        "jobs and the exchange:",
        "healing and spare copies:",
        "security:",
        "metrics and logs:",
    ]


def test_a_reader_that_stops_early_ends_the_command_quietly() -> None:
    """`dataquay ... | head`: no traceback, the status a tool killed by SIGPIPE has."""
    command = [sys.executable, "-m", "dataquay", "simulate", "--nodes", "4", "--samples", "10000"]
    command += ["--sample-bytes", "1K", "--per-rank-batch", "4", "--ranks-per-node", "1", "--mode", "global"]
    command += ["--epochs", "1500"]  # a table far larger than a pipe's buffer
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None and process.stderr is not None
        process.stdout.readline()
        process.stdout.close()
        stderr = process.stderr.read().decode()
        assert process.wait(timeout=60) == 128 + signal.SIGPIPE
    # A slow machine may see the simulation's progress lines; nothing else.
    assert all(line.startswith("simulated ") for line in stderr.splitlines()), stderr
