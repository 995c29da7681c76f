"""The command line: a thin layer over the Python API (parse, call, print).

    autofit estimate tiny-llama --batch-size 4 --seq-len 512
    autofit tune tiny-gpt2 --dataset tiny-samples --device cpu:1GiB -o tuned.yaml
    autofit measure tiny-llama --batch-size 4 --seq-len 256 --device cpu:2GiB
    autofit check tuned.yaml
    autofit report tuned.yaml
    autofit run --device cpu:1GiB -- python train.py tuned.yaml

One module per subcommand (``estimate``, ``tune``, ``measure``, ``check``,
``report``), the options they share (``options``) and dataset references
(``datasets``). Exit codes: 0 ok (fits), 2 bad input (one line that says what to
do), 3 does not fit, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

from autofit.cli.options import EXIT_BAD_INPUT, EXIT_OK
from autofit.errors import AutofitError, on_command_line

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(EXIT_BAD_INPUT, f"autofit: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``autofit`` argument parser with every subcommand."""
    from autofit.cli.check import add_check_parser
    from autofit.cli.compare_peft import add_compare_peft_parser
    from autofit.cli.estimate import add_estimate_parser
    from autofit.cli.measure import add_measure_parser
    from autofit.cli.report import add_report_parser
    from autofit.cli.run import add_run_parser
    from autofit.cli.tune import add_tune_parser

    parser = _Parser(prog="autofit", description="Find the fastest training configuration "
                     "that fits in device memory, before the run starts.")
    parser.add_argument("--version", action="version", version=f"autofit {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_estimate_parser(sub)
    add_measure_parser(sub)
    add_check_parser(sub)
    add_report_parser(sub)
    add_tune_parser(sub)
    add_compare_peft_parser(sub)
    add_run_parser(sub)
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("autofit")
    except Exception:  # noqa: BLE001 - not installed: running from a checkout
        return "0.1.0"


def _quiet_libraries() -> None:
    """Keep library chatter (deprecations, optional-kernel notices) off the terminal."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    _warnings_on_stderr()


def _warnings_on_stderr() -> None:
    """autofit's own warnings (logger ``autofit``: a cache fault, a pre-flight fix) as one
    line each on stderr, ``autofit: warning: ...``, unless the user routed the logger."""
    import logging

    log = logging.getLogger("autofit")
    if not log.handlers:
        log.addHandler(_StderrLines(logging.WARNING))


class _StderrLines(logging.Handler):
    """``autofit: warning: <message>`` on the stderr of the moment (tests swap it)."""

    to_stderr = True  # what reaches stderr is not echoed again (autofit.trial.guard)

    def emit(self, record: logging.LogRecord) -> None:
        print(f"autofit: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is: it unwinds like Ctrl-C (every ``finally`` runs)."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM handled like Ctrl-C while the command runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autofit`` console script.

    SIGTERM is handled like Ctrl-C: trial processes stopped, work dirs removed,
    "autofit: interrupted". The exit status is 128 + the signal's number, what a
    shell reports for a process that signal ended: 130 for SIGINT, 143 for SIGTERM,
    so whoever sent it can tell which did.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _quiet_libraries()
    try:
        with _sigterm_as_interrupt(), on_command_line():
            return int(args.func(args))
    except AutofitError as e:
        print(f"autofit: error: {e}", file=sys.stderr)
        return e.exit_code
    except ModuleNotFoundError as e:  # an optional package a path did not check first
        from autofit.errors import OPTIONAL_PACKAGES, missing_dependency

        top = (e.name or "").split(".")[0]
        if top not in OPTIONAL_PACKAGES or os.environ.get("AUTOFIT_DEBUG"):
            return _internal_error(e)
        err = missing_dependency(top, f"autofit {getattr(args, 'command', '') or ''}".strip())
        print(f"autofit: error: {err}", file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:  # output piped into `head`
        return EXIT_OK
    except KeyboardInterrupt as e:
        print("autofit: interrupted", file=sys.stderr)
        return 128 + int(signal.SIGTERM if isinstance(e, _Terminated) else signal.SIGINT)
    except Exception as e:  # noqa: BLE001 - never a traceback unless asked
        return _internal_error(e)


def _internal_error(e: Exception) -> int:
    """Exit 1 with one line (the traceback with ``AUTOFIT_DEBUG=1``)."""
    if os.environ.get("AUTOFIT_DEBUG"):
        raise e
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    print(
        f"autofit: internal error: {type(e).__name__}: {msg} "
        "(set AUTOFIT_DEBUG=1 for the traceback and please report it)",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
