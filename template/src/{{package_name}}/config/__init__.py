"""The run's configuration: configs/train.yaml checked against typed sections (schema.py)."""

from .context import TaskContext
from .schema import (
    DEFAULT_CONFIG,
    OBJECT_STORE_SCHEMES,
    TASK_SECTIONS,
    AsyncMode,
    CheckpointConfig,
    Config,
    ConfigError,
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
    load_config,
    require,
    task_section,
    task_section_of_kind,
    to_plain_dict,
)

__all__ = [
    "DEFAULT_CONFIG", "OBJECT_STORE_SCHEMES", "TASK_SECTIONS", "AsyncMode", "CheckpointConfig",
    "Config", "ConfigError", "DistributedConfig", "EvalConfig", "LoaderConfig", "LogConfig", "NoticeSource",
    "OnSaveError", "Parallelism", "PlanConfig", "Precision", "PreemptionConfig",
    "RecoveryConfig", "TaskContext", "TrainConfig", "VerifyMode", "load_config", "require",
    "task_section", "task_section_of_kind", "to_plain_dict",
]
