"""The `gradbuilder` command: build, artifacts, ops, demo, train, lora.

Exit status: 0 done; 1 a failure while working (onnxruntime failed, a file could not be
written, the model's graph could not be differentiated or trained); 2 a usage error, as
argparse gives (an option that is bad or contradicts another, a file named on the command
line that is missing or unreadable, a name the model or the data does not have); 130 or 143
when `train` is stopped by SIGINT (Ctrl-C) or SIGTERM. Every error is one line on stderr,
``gradbuilder: error: ...``; whatever can be checked before the work starts is checked first,
and nothing is written by a command that fails.

At start this package imports the standard library only: ``--help`` and ``--version`` answer
without loading onnx, onnxruntime or numpy; each command imports what it needs.

One module per command group, each holding its commands' arguments beside the commands:
``build`` (build, ops), ``artifacts`` (artifacts, export-web), ``demos`` (demo, web-demo),
``train`` (train; its checks of the command line, the data and the model in ``train_checks``),
``lora`` (lora: an adapter trained on an onnxruntime-genai model);
``common`` holds what they share (the parser, the common options, argument types, file checks).
This module assembles the parser and runs a command (``main``, the console script's entry point;
``python -m gradbuilder.cli`` runs it too).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import warnings

from ..errors import GradBuilderError, InvalidArgumentError, ModelLoadError
from . import artifacts, build, demos, lora, train
from .common import Parser, UsageError, common_options, one_line

# The errors that are the caller's: a name or option that does not fit, an input file that
# cannot be read. Every other GradBuilderError is a failure while working.
USAGE_ERRORS = (InvalidArgumentError, ModelLoadError)


def exit_status(exc: BaseException) -> int:
    """2 for a usage error, 1 for any other failure."""
    return 2 if isinstance(exc, USAGE_ERRORS) else 1


class _Version(argparse._VersionAction):
    """argparse's --version, the version read when asked for (``gradbuilder.__version__`` reads
    the package metadata, which --help has no need of)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from .. import __version__

        self.version = f"%(prog)s {__version__}"
        super().__call__(parser, namespace, values, option_string)


def parser() -> argparse.ArgumentParser:
    top = Parser(prog="gradbuilder", description="Gradient graphs for ONNX models, trained on stock onnxruntime.",
                 epilog="Exit status: 0 done, 1 a failure while working, 2 a usage error, 130/143 training "
                        "stopped by SIGINT/SIGTERM.")
    top.add_argument("--version", action=_Version)
    common_options(top, top=True)
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    build.add_build(sub)
    artifacts.add_artifacts(sub)
    artifacts.add_export_web(sub)
    demos.add_web_demo(sub)
    build.add_ops(sub)
    demos.add_demo(sub)
    train.add_train(sub)
    lora.add_lora(sub)
    return top


# ------------------------------------------------------------------ main


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            return f"gradbuilder: {record.levelname.lower()}: {message}"
        if record.levelno < logging.INFO:
            return f"gradbuilder: debug: {record.name}: {message}"
        return message


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings`` as one line through the ``gradbuilder`` logger (what the user should change)."""
    kind = "" if category is UserWarning else f"{category.__name__}: "
    logging.getLogger("gradbuilder").warning("%s%s", kind, one_line(message))


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"{exc.prog}: error: {exc}", file=sys.stderr)
        return 2
    root = logging.getLogger("gradbuilder")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    level = root.level
    root.setLevel(logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO)
    root.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = _show_warning
            return args.fn(args)
    except GradBuilderError as exc:
        print(f"gradbuilder: error: {one_line(exc)}", file=sys.stderr)
        return exit_status(exc)
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except OSError as exc:  # a file that could not be written: disk full, permissions
        print(f"gradbuilder: error: {one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside training steps (while loading or building)
        print("gradbuilder: interrupted; nothing was saved", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        root.removeHandler(handler)
        root.setLevel(level)

