"""A small exception family. The CLI turns each into one line on stderr and an exit code."""

from __future__ import annotations


class LmtraceError(Exception):
    """Base class: something lmtrace can explain in one line."""

    exit_code = 1


class InvalidParameter(LmtraceError, ValueError):
    """A parameter has a value lmtrace cannot use; the message names both."""

    exit_code = 2


class ModelLoadError(LmtraceError):
    """A model or tokenizer could not be loaded; the message names the file and the problem."""

    exit_code = 2


class GenerationError(LmtraceError):
    """A failure while running the model."""

    exit_code = 1
