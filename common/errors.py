"""Errors a user can act on. The CLI prints their message on one line and exits with code 2."""


class InfengError(Exception):
    """Base class: the message names the file (and tensor) at fault and what to do."""


class ModelFormatError(InfengError):
    """A checkpoint, config or tokenizer file is missing, corrupt or inconsistent."""


class UnsupportedError(InfengError):
    """The input is valid but uses something infeng does not implement."""


class IRError(InfengError):
    """IR text that does not parse, or a graph that does not verify."""
