"""``python -m infeng_cli``: the ``infeng`` command."""
from .main import main

main()
