"""``dataquay token``: the cluster token every party presents, and the node
token only daemons and the directory hold."""

from __future__ import annotations

import argparse

from dataquay.server.auth import new_token_file


def cmd_new(args: argparse.Namespace) -> None:
    path = new_token_file(args.path, force=args.force)
    if args.node:
        print(
            f"wrote a new node token to {path} (mode 600)\n"
            f"give it to the daemons and the directory only, with --node-token-file {path}; "
            f"never to trainers: it writes into caches and registers nodes"
        )
        return
    print(
        f"wrote a new cluster token to {path} (mode 600)\n"
        f"give it to the daemons and the directory with --token-file {path} "
        f"and to trainers and tools with DATAQUAY_TOKEN_FILE={path}; "
        f"the servers need a node token too: `dataquay token new --node PATH`"
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    token = sub.add_parser("token", help="make the cluster token or the node token")
    tsub = token.add_subparsers(dest="action", required=True, metavar="ACTION")
    new = tsub.add_parser("new", help="write a fresh random token to PATH, readable by its owner only")
    new.add_argument("path", help="the token file to write (its directory must exist)")
    new.add_argument("--force", action="store_true", help="replace the token in an existing file")
    new.add_argument(
        "--node",
        action="store_true",
        help="a node token (--node-token-file), for daemons and the directory only: the same kind of file",
    )
    new.set_defaults(func=cmd_new)
