"""Spec files: encode, decode, read, write atomically, remove.

A spec file is named ``<vendor>-<class>.yaml`` or ``.json`` and lives in a spec
directory (``/etc/cdi`` for static specs, ``/var/run/cdi`` for generated ones). Every
directory is a parameter, so callers can pass paths mapped under a host root.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from cdi.errors import CDIError, SpecError, SpecFileError
from cdi.model import Spec
from cdi.names import parse_kind
from cdi.validate import validate_spec

log = logging.getLogger(__name__)

FORMATS = ("yaml", "json")
SPEC_FILE_MODE = 0o644
SPEC_DIR_MODE = 0o755
# Spec files are small; a cap keeps a hostile or broken file from exhausting memory.
MAX_SPEC_BYTES = 8 * 1024 * 1024


class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (the reference parses strictly too)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                break  # unhashable key: the base class reports it
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r}", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _no_duplicate_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise CDIError(f"spec format {fmt!r} is not supported; use 'yaml' or 'json'")
    return fmt


def dump_spec(spec: Spec, fmt: str = "yaml") -> str:
    """The text of ``spec`` as YAML or JSON (no validation)."""
    data = spec.to_dict()
    if _check_format(fmt) == "json":
        return json.dumps(data, indent=2) + "\n"
    return yaml.safe_dump(data, sort_keys=False, width=1 << 16)


def parse_spec(text: str | bytes, fmt: str = "yaml", *, validate: bool = True) -> Spec:
    """Decode a spec document; raises SpecError naming the field (or the syntax error)."""
    try:
        if _check_format(fmt) == "json":
            data = json.loads(text, object_pairs_hook=_no_duplicate_pairs)
        else:
            data = yaml.load(text, Loader=_StrictYamlLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError("", f"not valid YAML: {err.problem}{where}") from err
    except (ValueError, yaml.YAMLError) as err:
        raise SpecError("", f"not valid {fmt.upper()}: {err}") from err
    if data is None:
        raise SpecError("", "the document is empty")
    spec = Spec.from_dict(data)
    if validate:
        validate_spec(spec)
    return spec


def _format_of(path: Path) -> str:
    return "json" if path.suffix == ".json" else "yaml"


def read_spec(path: str | os.PathLike[str], *, validate: bool = True) -> Spec:
    """Read a spec file (JSON when named ``*.json``, else YAML), validated by default.

    Raises SpecFileError naming the file (and the field, when a field is at fault).
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as err:
        raise SpecFileError(str(path), f"cannot be read: {err.strerror or err}", err) from err
    if len(data) > MAX_SPEC_BYTES:
        raise SpecFileError(str(path), f"is larger than {MAX_SPEC_BYTES} bytes")
    try:
        return parse_spec(data, _format_of(path), validate=validate)
    except SpecError as err:
        raise SpecFileError(str(path), str(err), err) from err


def spec_file_name(kind: str, fmt: str = "yaml") -> str:
    """``nvidia.com/pgpu`` -> ``nvidia.com-pgpu.yaml``."""
    vendor, class_ = parse_kind(kind)
    return f"{vendor}-{class_}.{_check_format(fmt)}"


def _check_plain_name(name: str) -> None:
    # Hidden names are excluded too: that is where write_atomic keeps its temp files.
    if not name or "/" in name or "\0" in name or name.startswith("."):
        raise CDIError(f"spec file name {name!r} must be a plain file name in the spec directory")


def _target_name(spec: Spec, fmt: str, name: str | None) -> str:
    if name is None:
        return spec_file_name(spec.kind, fmt)
    _check_plain_name(name)
    stem, dot, ext = name.rpartition(".")
    if dot and ext in FORMATS:
        if ext != fmt:
            raise CDIError(f"spec file name {name!r} does not match format {fmt!r}; "
                           f"name it {stem}.{fmt} or pass fmt={ext!r}")
        return name
    return f"{name}.{fmt}"


def write_atomic(path: Path, data: bytes, mode: int = SPEC_FILE_MODE) -> bool:
    """Replace ``path`` with ``data`` via temp file, fsync and rename.

    Returns False, touching nothing, when the file already holds exactly ``data``.
    """
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    # The temp name ends in .tmp so spec scanners never pick up a half-written file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # explicit: independent of the umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return True


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_spec(spec: Spec, spec_dir: str | os.PathLike[str], fmt: str = "yaml",
               name: str | None = None) -> bool:
    """Validate ``spec`` and write it to ``spec_dir`` (created if missing), mode 0644.

    The file is ``name`` (``.yaml``/``.json`` appended unless present and matching
    ``fmt``), by default ``<vendor>-<class>.<fmt>``. Returns True when the file changed,
    False when it already held exactly this content (then it is not touched at all).
    Raises InvalidSpecError before writing anything when the spec is invalid.
    """
    _check_format(fmt)
    validate_spec(spec)
    directory = Path(spec_dir)
    path = directory / _target_name(spec, fmt, name)
    directory.mkdir(mode=SPEC_DIR_MODE, parents=True, exist_ok=True)
    changed = write_atomic(path, dump_spec(spec, fmt).encode())
    if changed:
        log.info("wrote CDI spec %s (kind %s, %d devices)", path, spec.kind, len(spec.devices))
    else:
        log.debug("CDI spec %s is already up to date", path)
    return changed


def remove_spec(spec_dir: str | os.PathLike[str], kind: str, name: str | None = None) -> bool:
    """Remove the spec files of ``kind`` (``<vendor>-<class>.yaml`` and ``.json``, or
    ``name``) from ``spec_dir``. Returns True when a file was removed."""
    directory = Path(spec_dir)
    if name is None:
        names = [spec_file_name(kind, fmt) for fmt in FORMATS]
    else:
        _check_plain_name(name)
        has_ext = name.rpartition(".")[2] in FORMATS and "." in name
        names = [name] if has_ext else [f"{name}.{fmt}" for fmt in FORMATS]
    removed = False
    for file_name in names:
        path = directory / file_name
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        log.info("removed CDI spec %s (kind %s)", path, kind)
        removed = True
    if removed:
        _fsync_dir(directory)
    return removed
