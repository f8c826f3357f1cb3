"""The command line's value types: each parses one flag's text or raises
``argparse.ArgumentTypeError``, which argparse reports as "argument --flag: <message>"."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from offloadd.settings import ENDPOINT_EXAMPLES, endpoint_problem, log_level_problem, parse_size

__all__ = [
    "bench_name",
    "endpoint",
    "endpoint_or_empty",
    "endpoint_or_none",
    "integer",
    "log_level",
    "output_file",
    "seconds",
    "settings_file",
    "size",
]


def endpoint(text: str) -> str:
    """A control or events endpoint (ipc://, tcp://)."""
    problem = endpoint_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def endpoint_or_none(text: str) -> str:
    """An endpoint, or 'none'."""
    if text == "none":
        return text
    if endpoint_problem(text):
        raise argparse.ArgumentTypeError(
            f"expected an endpoint such as {ENDPOINT_EXAMPLES}, or 'none', got {text!r}"
        )
    return text


def endpoint_or_empty(text: str) -> str:
    """An endpoint, or '' for none."""
    if text and endpoint_problem(text):
        raise argparse.ArgumentTypeError(
            f"expected an endpoint such as {ENDPOINT_EXAMPLES}, or '' for none, got {text!r}"
        )
    return text


def settings_file(text: str) -> str:
    """A settings file that can be read."""
    if not text:
        raise argparse.ArgumentTypeError("expected a settings file, got ''")
    try:
        with open(text, "rb"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc.strerror}") from None
    return text


def output_file(text: str) -> str:
    """A file to write, in a directory that exists and can be written."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file to write, got ''")
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {directory!r}")
    return text


def integer(low: int) -> Callable[[str], int]:
    """Integers from ``low`` on."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def size(low: int) -> Callable[[str], int]:
    """Sizes (``8GiB``, ``8GB``) of at least ``low`` bytes."""

    def parse(text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected at least {low} bytes, got {text!r}")
        return value

    return parse


def seconds(text: str) -> float:
    """A number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


def log_level(text: str) -> str:
    """A logging level name, upper-cased."""
    problem = log_level_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text.upper()


def bench_name(text: str) -> str:
    """A benchmark group or result pattern that names something."""
    from offloadd.bench import name_problem

    problem = name_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text
