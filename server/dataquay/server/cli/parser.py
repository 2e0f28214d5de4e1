"""The command line's argument parser: usage errors name the command they
belong to and suggest what was probably meant.

argparse hands a subcommand's unknown options up to the top-level parser,
which prints ``usage: dataquay [-h] [--version] COMMAND ...`` and nothing
about the command that was typed; a mistyped command name gets a list of
every choice. Here the parser that owns the arguments reports them, with
its own usage line and the closest option, command or choice.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NoReturn

from dataquay.server.config import closest_name


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose subparsers (argparse makes them of the same
    class) refuse unknown options themselves, with a suggestion."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        unknown = [arg for arg in extras if arg.startswith("-")]
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._closest(unknown[0])}")
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        if "invalid choice: " in message:
            typed = message.split("invalid choice: ", 1)[1].split(" (choose from", 1)[0].strip("'")
            message += self._closest(typed, choices=True)
        super().error(message)

    def _closest(self, typed: str, choices: bool = False) -> str:
        """``; did you mean X?`` for the option (or, with ``choices``, the
        command or choice) nearest ``typed``, or nothing."""
        known: list[str] = []
        for action in self._actions:
            if choices:
                known.extend(str(choice) for choice in action.choices or ())
            else:
                known.extend(action.option_strings)
        meant = closest_name(typed.split("=", 1)[0], known)
        return f"; did you mean {meant}?" if meant else ""
