"""The run's configuration: configs/train.yaml (loading.py) checked against typed sections
(schema.py) and the bounds declared beside their fields (checks.py)."""

from .checks import ConfigError, require
from .context import TaskContext
from .loading import DEFAULT_CONFIG, load_config, task_section, task_section_of_kind, to_plain_dict
from .schema import (
    OBJECT_STORE_SCHEMES,
    TASK_SECTIONS,
    AsyncMode,
    CheckpointConfig,
    Config,
    DistributedConfig,
    EvalConfig,
    LoaderConfig,
    LogConfig,
    NoticeSource,
    OnSaveError,
    Parallelism,
    PlanConfig,
    Precision,
    PreemptionConfig,
    RecoveryConfig,
    TrainConfig,
    VerifyMode,
)

__all__ = [
    "DEFAULT_CONFIG", "OBJECT_STORE_SCHEMES", "TASK_SECTIONS", "AsyncMode", "CheckpointConfig",
    "Config", "ConfigError", "DistributedConfig", "EvalConfig", "LoaderConfig", "LogConfig",
    "NoticeSource", "OnSaveError", "Parallelism", "PlanConfig", "Precision", "PreemptionConfig",
    "RecoveryConfig", "TaskContext", "TrainConfig", "VerifyMode", "load_config", "require",
    "task_section", "task_section_of_kind", "to_plain_dict",
]
