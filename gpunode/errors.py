"""Errors the katamgr commands turn into exit codes.

Every error katamgr raises on purpose carries its exit code: 2 (``ConfigError``)
for bad usage or configuration, found before anything was changed; 1 for a
failure while doing the work. ``katamgr.cli.main`` is the one place that turns
an error into its message and exit code (``sandbox-device-plugin`` does the same
with the errors it shares, such as a bad workload label).

Every message is one sentence that names the bad value (device, file, key) and,
where there is one, the fix.
"""


class GpuNodeError(Exception):
    """A failure while doing the work: exit code 1."""

    exit_code = 1


class ConfigError(GpuNodeError):
    """Bad usage or configuration: exit code 2. Nothing was changed."""

    exit_code = 2
