"""The kata manager's configuration: the GPU Operator's ``kataManager.config`` shape.

Four small modules, each with one job: ``model`` (the pydantic models and their defaults),
``fields`` (each field type's check and the JSON schema the chart gets for it), ``loading``
(a file, YAML text or parsed data in, a config or every problem at once out) and
``messages`` (pydantic's errors in an operator's words). The same models give the JSON
schema the Helm chart checks values against (``katamgr.config_schema``).
"""

from katamgr.config.loading import (
    InvalidConfig,
    config_from_dict,
    load_config,
    parse_config,
)
from katamgr.config.model import (
    DEFAULT_ARTIFACTS_DIR,
    DEFAULT_GPU_ARTIFACTS,
    DEFAULT_SNP_ARTIFACTS,
    Artifacts,
    KataManagerConfig,
    RuntimeClassConfig,
    RuntimeClassOverhead,
    default_config,
)

__all__ = [
    "DEFAULT_ARTIFACTS_DIR", "DEFAULT_GPU_ARTIFACTS", "DEFAULT_SNP_ARTIFACTS", "Artifacts",
    "InvalidConfig", "KataManagerConfig", "RuntimeClassConfig", "RuntimeClassOverhead",
    "config_from_dict", "default_config", "load_config", "parse_config",
]
