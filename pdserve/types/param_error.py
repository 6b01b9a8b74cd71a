"""The one exception for a client's mistake in request parameters (the servers answer it with a 400 naming the
field)."""

from __future__ import annotations


class ParamError(ValueError):
    """A client mistake in the request parameters; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
