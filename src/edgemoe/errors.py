"""One exception type for every bad input, so the CLI can print it without a traceback."""


class EdgeMoEError(ValueError):
    """Bad input: the message names the field or file and what was expected."""
