"""Models the default task composes; a task of yours may use them or bring its own."""

from .tiny import TinyConfig, TinyLM

__all__ = ["TinyConfig", "TinyLM"]
