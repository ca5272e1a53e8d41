"""infeng_cli: the ``infeng`` command, above the compiler and the runtime (neither imports it).
``app.py`` the typer app and what every command shares, ``params.py`` typer parameters generated from
option declarations, one module per concern of commands (``compile_cmds``, ``run_cmds``,
``serve_cmds``, ``jobs``, ``demo``), ``main.py`` the app with all of them registered."""
