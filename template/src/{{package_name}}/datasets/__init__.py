"""Datasets the default task composes; a task of yours may use them or bring its own."""

from .text import TextConfig, TextWindows, generate_corpus

__all__ = ["TextConfig", "TextWindows", "generate_corpus"]
