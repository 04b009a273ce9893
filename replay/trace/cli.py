"""`replay trace ...` subcommands (placeholder until this area is built)."""

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    pass
