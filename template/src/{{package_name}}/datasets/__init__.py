"""Datasets the default task composes; a task of yours may use them or bring its own."""

from .text import TextConfig, TextWindows, generate_corpus
from .tokens import TokenConfig, TokenWindows, read_index

__all__ = ["TextConfig", "TextWindows", "TokenConfig", "TokenWindows", "generate_corpus",
           "read_index"]
