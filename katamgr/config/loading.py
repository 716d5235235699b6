"""Reading a kataManager config: a file, YAML text or parsed data, every problem at once.

The file an operator writes (or the Helm chart renders into a ConfigMap) is untrusted
input: it is size-capped, must be UTF-8, its YAML may not repeat a key (PyYAML would keep
the last one silently), and all of its problems are reported in one ``InvalidConfig``:
fixing a config one error per run wastes a rollout each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gpunode.errors import ConfigError
from katamgr.config.messages import problems, quote
from katamgr.config.model import KataManagerConfig, default_config

MAX_CONFIG_BYTES = 1 << 20


class InvalidConfig(ConfigError):
    """A config with one or more problems; ``problems`` lists each one."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = list(problems)
        count = f"{len(problems)} problem" + ("s" if len(problems) != 1 else "")
        listing = "".join(f"\n  - {p}" for p in problems)
        super().__init__(f"invalid kata manager config {source} ({count}; fix each):{listing}")


def load_config(path: str | Path | None) -> KataManagerConfig:
    """Load the config file at ``path``; None means the built-in default."""
    if path is None:
        return default_config()
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(
            f"cannot read kata manager config {path}: {e.strerror}; check the path"
        ) from e
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"kata manager config {path} is larger than {MAX_CONFIG_BYTES} bytes; "
            "is it the right file?"
        )
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise ConfigError(f"kata manager config {path} is not UTF-8 text") from e
    return parse_config(text, source=str(path))


def parse_config(text: str, source: str = "<string>") -> KataManagerConfig:
    """Parse and validate a config given as YAML text."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"kata manager config {source} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"kata manager config {source} is not valid YAML: {e}") from e
    return config_from_dict(data, source=source)


def config_from_dict(data: Any, source: str = "<dict>") -> KataManagerConfig:
    """Validate already-parsed data; raise InvalidConfig listing every problem."""
    if data is None:
        data = {}  # an empty file: every default
    try:
        return KataManagerConfig.model_validate(data)
    except ValidationError as e:
        raise InvalidConfig(source, problems(e, KataManagerConfig)) from None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML keeps the last one silently)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # unhashable key: construct_mapping reports it
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {quote(key)}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
