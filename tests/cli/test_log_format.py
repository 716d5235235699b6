"""--log-format: both commands log as text by default (unchanged) and, with json, one
JSON object per line on stderr (time, level, logger, message; exceptions as a field)."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

from gpunode.services.process import LOG_FORMAT, JsonFormatter

BIN = Path(sys.executable).parent
KATAMGR = str(BIN / "katamgr")
PLUGIN = str(BIN / "sandbox-device-plugin")
KEYS = {"time", "level", "logger", "message"}
TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


def json_lines(stderr: str) -> list[dict]:
    lines = stderr.splitlines()
    assert lines, "nothing logged"
    records = [json.loads(line) for line in lines]  # every line, or this fails
    for record in records:
        assert KEYS <= record.keys(), record
        assert TIME.match(record["time"]), record["time"]
    return records


def katamgr(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KATAMGR, *args], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_katamgr_plan_logs_json_lines():
    result = katamgr("plan", "--host", "a10-server", "--log-format", "json", "-v")
    assert result.returncode == 0, result.stderr
    records = json_lines(result.stderr)
    assert any(r["level"] == "INFO" and r["logger"] == "katamgr"
               and r["message"].startswith("simulating host profile a10-server") for r in records)
    assert "BDF" in result.stdout  # the plan itself is output, not log: still text on stdout


def test_katamgr_error_is_a_json_line_too():
    result = katamgr("plan", "--host", "no-such-profile", "--log-format", "json")
    assert result.returncode == 2
    [record] = json_lines(result.stderr)
    assert record["level"] == "ERROR"
    assert "no-such-profile" in record["message"]


def test_katamgr_text_format_is_the_default_and_unchanged():
    default = katamgr("plan", "--host", "a10-server", "-v")
    explicit = katamgr("plan", "--host", "a10-server", "-v", "--log-format", "text")
    for result in (default, explicit):
        assert result.returncode == 0, result.stderr
        lines = result.stderr.splitlines()
        assert lines and all(TEXT_LINE.match(line) for line in lines), lines
        assert any("INFO katamgr: simulating host profile a10-server" in line for line in lines)
    error = katamgr("plan", "--host", "no-such-profile")
    assert error.stderr.startswith("katamgr: host profile 'no-such-profile'")


def test_katamgr_refuses_an_unknown_log_format():
    result = katamgr("plan", "--host", "a10-server", "--log-format", "logfmt")
    assert result.returncode == 2
    assert "--log-format" in result.stderr and "json" in result.stderr


def _run_plugin(tmp_path: Path, log_format: str | None) -> subprocess.CompletedProcess:
    root = tmp_path / "host"
    subprocess.run([KATAMGR, "simulate", "a10-server", "--into", str(root)], check=True,
                   capture_output=True, timeout=120)
    args = [PLUGIN, "--host-root", str(root), "--workload", "vm-passthrough", "-v"]
    if log_format:
        args += ["--log-format", log_format]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()  # it has started (and installed its signal handlers)
        proc.send_signal(signal.SIGTERM)
        out, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(args, proc.returncode, out, first + rest)


def test_sandbox_device_plugin_logs_json_lines(tmp_path):
    result = _run_plugin(tmp_path, "json")
    assert result.returncode == 0, result.stderr
    records = json_lines(result.stderr)
    messages = [(r["logger"], r["message"]) for r in records]
    assert ("sandbox_plugin", "mode vm-passthrough: chosen with --workload") in messages
    assert ("sandbox_plugin", "stopped") in messages


def test_sandbox_device_plugin_text_format_is_the_default(tmp_path):
    result = _run_plugin(tmp_path, None)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines and all(TEXT_LINE.match(line) for line in lines), lines
    assert any(line.endswith("INFO sandbox_plugin: stopped") for line in lines)


def test_sandbox_device_plugin_usage_error_is_a_json_line(tmp_path):
    result = subprocess.run([PLUGIN, "--host-root", str(tmp_path / "missing"), "--log-format", "json"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    [record] = json_lines(result.stderr)
    assert record["level"] == "ERROR" and "--host-root" in record["message"]


def test_an_exception_is_a_field_of_its_json_record():
    try:
        raise ValueError("bad thing")
    except ValueError:
        record = logging.LogRecord("katamgr.agent", logging.ERROR, __file__, 1, "reconcile %s failed",
                                   ("x",), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["message"] == "reconcile x failed"
    assert parsed["level"] == "ERROR" and parsed["logger"] == "katamgr.agent"
    assert parsed["exception"].startswith("Traceback (most recent call last):")
    assert parsed["exception"].rstrip().endswith("ValueError: bad thing")


@pytest.mark.parametrize("message", ['quote " and\nnewline', "ünïcode ✓"])
def test_json_records_stay_on_one_line(message):
    record = logging.LogRecord("sandbox_plugin", logging.INFO, __file__, 1, message, None, None)
    line = JsonFormatter().format(record)
    assert "\n" not in line and json.loads(line)["message"] == message


def test_the_text_format_is_the_one_both_commands_always_had():
    assert LOG_FORMAT == "%(asctime)s %(levelname)s %(name)s: %(message)s"
