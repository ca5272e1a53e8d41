"""The ``infeng`` command: the app with every command registered (each module of this package
registers its own, in the order the help lists them). Every InfengError becomes one line on
stderr and exit code 2."""
from . import compile_cmds, run_cmds, serve_cmds, jobs, demo  # noqa: F401, I001  (they register their commands)
from .app import app

__all__ = ["app", "main"]


def main() -> None:
    """``python -m infeng_cli``: the help and errors name the command ``infeng``, as installed."""
    app(prog_name="infeng")
