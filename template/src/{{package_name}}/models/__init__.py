"""Models the default task composes; a task of yours may use them or bring its own.

``hf`` imports the optional transformers dependency only when used."""

from .hf import HFConfig, build_hf_model, check_data_fits
from .tiny import TinyConfig, TinyLM

__all__ = ["HFConfig", "TinyConfig", "TinyLM", "build_hf_model", "check_data_fits"]
