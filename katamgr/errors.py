"""Errors the katamgr commands turn into exit codes.

Every message is one sentence that names the bad value (device, file, key) and,
where there is one, the fix.
"""


class KatamgrError(Exception):
    """A failure while doing the work: exit code 1."""

    exit_code = 1


class ConfigError(KatamgrError):
    """Bad usage or configuration: exit code 2. Nothing was changed."""

    exit_code = 2
