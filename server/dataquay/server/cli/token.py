"""``dataquay token``: the cluster token every daemon, directory and client presents."""

from __future__ import annotations

import argparse

from dataquay.server.auth import new_token_file


def cmd_new(args: argparse.Namespace) -> None:
    path = new_token_file(args.path, force=args.force)
    print(
        f"wrote a new cluster token to {path} (mode 600)\n"
        f"give it to the daemons and the directory with --token-file {path} "
        f"and to trainers and tools with DATAQUAY_TOKEN_FILE={path}"
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    token = sub.add_parser("token", help="make the cluster token")
    tsub = token.add_subparsers(dest="action", required=True, metavar="ACTION")
    new = tsub.add_parser("new", help="write a fresh random token to PATH, readable by its owner only")
    new.add_argument("path", help="the token file to write (its directory must exist)")
    new.add_argument("--force", action="store_true", help="replace the token in an existing file")
    new.set_defaults(func=cmd_new)
