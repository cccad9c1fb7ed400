"""``python -m cli.serve_run serve_config.yaml [serve run options]``: Ray's ``serve run``, stopped by SIGTERM with one
line instead of a crash report.

Why: ``ray.init`` in the ``serve run`` process installs Ray's C++ failure signal handler (absl's), which also
catches SIGTERM: ``kill <pid>`` (what systemd and docker send) printed ``*** SIGTERM received at time=... PC: @ ...
clock_nanosleep ... and at least 4 more frames`` before the process ended, which reads as a crash. For a config file ``serve run`` imports none of this project's code, so the service cannot change that from
inside; ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER=1`` would remove it, but also the stack traces of real crashes, in the
driver and in every Ray worker started with its environment. This launcher runs the same ``serve run`` command
in-process and, right after its ``ray.init`` returned, puts a Python SIGTERM handler in place of Ray's (for SIGTERM
only: crashes keep their traces). On SIGTERM it prints ``constrained-serve: SIGTERM received, shutting down`` and
stops ``serve run`` the way Ctrl-C does (its ``KeyboardInterrupt`` path: ``serve.shutdown()``, then exit).

Plain ``.venv/bin/serve run serve_config.yaml`` (the README's command) gets the same handler: ``scripts/setup.sh``
writes ``constrained_serve_sigterm.pth`` into the virtualenv's site-packages, whose one line calls
:func:`from_site` at interpreter start; it acts only in a ``serve run`` process.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

MESSAGE = "constrained-serve: SIGTERM received, shutting down"


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    print(MESSAGE, file=sys.stderr, flush=True)
    raise KeyboardInterrupt  # serve run's own Ctrl-C path shuts Serve down and exits


def install_sigterm_handler() -> None:
    """Make the next ``ray.init`` of this process put :func:`_on_sigterm` in place of Ray's SIGTERM handler."""
    import ray

    real_init = ray.init
    if getattr(real_init, "_cs_sigterm", False):
        return

    def init(*args: Any, **kwargs: Any) -> Any:
        context = real_init(*args, **kwargs)
        signal.signal(signal.SIGTERM, _on_sigterm)  # after Ray's handler: replaces it, for SIGTERM only
        return context

    init._cs_sigterm = True  # type: ignore[attr-defined]
    ray.init = init  # serve run calls ray.init through the module attribute


def from_site() -> None:
    """Called at interpreter start by ``constrained_serve_sigterm.pth`` (written into the virtualenv by
    ``scripts/setup.sh``): in a plain ``serve run`` process (``.venv/bin/serve run ...``), the same handler as
    :func:`main`; any other process is left as it is. Never raises: a Python start-up must not fail here."""
    try:
        if sys.argv[1:2] == ["run"] and sys.argv[0].replace("\\", "/").rsplit("/", 1)[-1] == "serve":
            install_sigterm_handler()
    except Exception:  # pragma: no cover - Ray missing or changed: plain serve run, as without this file
        pass


def main(argv: list[str] | None = None) -> int:
    install_sigterm_handler()
    from ray.serve.scripts import cli

    try:
        cli.main(args=["run", *(sys.argv[1:] if argv is None else argv)], prog_name="serve run", standalone_mode=True)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
