"""What the commands share: the parser that raises its errors, the options every command takes,
the argument types, the checks of files named on the command line, and one-line messages.

Standard library only at import: ``--help`` must not load onnx, onnxruntime or numpy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import InvalidArgumentError


def one_line(exc) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def listed(names, most: int = 12) -> str:
    names = list(names)
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


# ------------------------------------------------------------------ checks of the command line


def check_input_file(option: str, path: str) -> None:
    from .. import files

    files.check_input_file(path, InvalidArgumentError, option)


def check_output_file(option: str, path: str | None) -> None:
    """``path`` can be written: its directory exists and accepts files, and it is not itself a
    directory (gradbuilder.files says why not in one line)."""
    from .. import files

    if path is not None:
        files.check_output_path(path, InvalidArgumentError, option)


def check_output_directory(option: str, path: str) -> None:
    """``path`` is a directory that accepts files, or can be made one."""
    from .. import files

    files.check_output_directory(path, InvalidArgumentError, option)


def check_distinct(**paths: str | None) -> None:
    given = {option: Path(p).resolve() for option, p in paths.items() if p is not None}
    options = list(given)
    for i, a in enumerate(options):
        for b in options[i + 1:]:
            if given[a] == given[b]:
                raise InvalidArgumentError(f"{a} and {b} name the same file {paths[a]}; give two paths")


def check_weights(args, floats) -> None:
    for option, names in (("--weights", args.weights), ("--frozen", args.frozen)):
        unknown = [n for n in names or () if n not in floats]
        if unknown:
            raise InvalidArgumentError(f"{option}: the model has no float initializer named {listed(unknown)} "
                                       "(nor a float Constant output of that name); its float initializers and "
                                       f"Constant outputs are {listed(floats)}")


def progress(args) -> bool | None:
    """--progress / --no-progress; -q turns the bar off unless --progress is given; by
    default the bar shows on a terminal only."""
    if args.progress is not None:
        return args.progress
    return False if args.quiet else None


# ------------------------------------------------------------------ the parser


def optimizer_help() -> str:
    from ..training.stages.optimizer import OPTIMIZERS

    *names, last = OPTIMIZERS
    return f"{', '.join(names)} or {last} (default adamw)"


WEIGHTS_HELP = ("weights to train: float initializers or Constant outputs (default: every float initializer; a model "
                "without any, as paddle2onnx and spox write them: its float Constant tensors)")


def integer(least: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: '{text}'") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: '{text}'") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def output_and_target(text: str) -> tuple[str, str]:
    scores, colon, target = text.partition(":")
    if not colon or not scores or not target:
        raise argparse.ArgumentTypeError(f"'{text}' is not OUTPUT:TARGET (e.g. logits:labels)")
    return scores, target


class UsageError(Exception):
    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse's parser, with its errors raised (``main`` prints them on one line and returns 2)."""

    def error(self, message: str):
        raise UsageError(self.prog, message)


def allow_inference_export_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-inference-export", action="store_true",
                   help="train a PyTorch export optimized for inference as it is (BatchNorm folded into the "
                        "convolution, parameters folded into constants); refused by default: it trains another model")


def common_options(p: argparse.ArgumentParser, progress: bool = False, top: bool = False) -> None:
    # given after the command they reach the same place as before it; after it they override
    default = {} if top else {"default": argparse.SUPPRESS}
    p.add_argument("-v", "--verbose", action="count", help="more notices (debug)", **({"default": 0} if top else default))
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only, no progress bar",
                   **default)
    if progress:
        p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="show the progress bar (default: only when stderr is a terminal)")
