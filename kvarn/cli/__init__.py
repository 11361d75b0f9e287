"""The ``kvarn`` command line: thin argparse subcommands over library functions.

Each subcommand lives in its own module of this package exposing ``add_parser(subparsers)``, which
registers the subparser and sets ``func`` to a callable taking the parsed namespace and returning
an exit code. Library code never sees the namespace.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS = ("demo", "generate", "drift", "eval")


def torch_device(name: str):
    """``--device NAME`` as a torch device that exists here; SystemExit naming the problem otherwise."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise SystemExit(f"--device {name!r} is not a torch device: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name!r}: torch sees no CUDA device here")
    return device


def positive_int(text: str) -> int:
    """argparse type for counts that must be at least 1 (a negative ``--limit`` would slice from the end)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer (1 or more)")
    return value


def preset_name(text: str) -> str:
    """argparse type for a preset name, checked (by :meth:`KVarNConfig.from_name`) before any model loads."""
    from kvarn.config import KVarNConfig

    try:
        KVarNConfig.from_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvarn", description="KVarN KV-cache quantization tools")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, tracebacks of refused values")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}":
                continue  # subcommand not installed in this build
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # the library refuses bad values with one; -v keeps the traceback (and a bug's)
        if args.verbose:
            raise
        raise SystemExit(f"kvarn {args.command}: {exc} (-v shows where)") from None


if __name__ == "__main__":
    sys.exit(main())
