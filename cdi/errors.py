"""Errors raised by the cdi package.

They subclass ValueError so a caller that only cares about "bad input" can catch that,
and they carry the location (a field path or a file) so a caller can point at it.
"""

from __future__ import annotations


class CDIError(ValueError):
    """Base class of every error this package raises."""


class SpecError(CDIError):
    """A spec document or model is malformed or breaks a CDI rule.

    ``field`` is the JSON path of the offending field, e.g.
    ``devices[2].containerEdits.deviceNodes[0].path`` (empty for the document itself).
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.problem = message
        super().__init__(f"{field}: {message}" if field else message)


class InvalidSpecError(SpecError):
    """Validation found one or more problems; ``problems`` lists them all."""

    def __init__(self, problems: list[SpecError]) -> None:
        self.problems = list(problems)
        first = self.problems[0]
        super().__init__(first.field, first.problem)
        if len(self.problems) > 1:
            self.args = ("; ".join(str(p) for p in self.problems),)


class InvalidNameError(CDIError):
    """A vendor, class, device name, kind or qualified name is malformed.

    ``part`` says which part is bad: ``vendor``, ``class``, ``name``, ``kind`` or
    ``device`` (the qualified name as a whole).
    """

    def __init__(self, part: str, message: str) -> None:
        self.part = part
        super().__init__(message)


class SpecFileError(CDIError):
    """A spec file cannot be read, parsed or validated; ``path`` names the file."""

    def __init__(self, path: str, message: str, cause: Exception | None = None) -> None:
        self.path = path
        self.cause = cause
        super().__init__(f"CDI spec file {path}: {message}")
