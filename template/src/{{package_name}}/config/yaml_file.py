"""Reading a config file: merge-conflict markers and YAML errors said in one sentence.

``copier update`` that meets a local edit of configs/train.yaml leaves git's conflict markers
in the file and still exits 0. Every command that reads a config checks for markers first,
then parses; either problem is one line naming the file, the line and what to do (exit 2),
not a yaml.scanner traceback. A marker is what ``git diff --check`` counts as one: seven
``<``, ``=``, ``>`` or ``|`` at the start of a line, then a space or the end of the line.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

CONFLICT_MARKER = re.compile(r"([<=>|])\1{6}(\s|$)")
# (The markers are spelled out nowhere in the project's files: a file holding them, even
# in a string, would be a conflict to `grep`.)
RESOLVE = (f"keep one side of each {'<' * 7} ... {'>' * 7} block, delete the markers, then "
           "run `git diff` and the fast tests (pytest -m \"not slow\")")


class UnreadableConfig(ValueError):
    """The config file cannot be read or parsed (load_config turns it into ConfigError)."""


def conflict_lines(text: str) -> list[int]:
    """The numbers (from 1) of the lines of ``text`` that are merge-conflict markers."""
    return [number for number, line in enumerate(text.split("\n"), 1)
            if CONFLICT_MARKER.match(line)]


def shown(path: Path) -> str:
    """``path`` as the user would write it: relative to the working directory when under it."""
    if path.is_absolute() and path.is_relative_to(Path.cwd()):
        return str(path.relative_to(Path.cwd()))
    return str(path)


def read_yaml(path: Path) -> DictConfig:
    """The parsed file; UnreadableConfig naming the file and the line otherwise."""
    where = shown(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableConfig(f"{where} is not UTF-8 text (byte {exc.start}): save it as "
                               "UTF-8") from None
    except OSError as exc:
        raise UnreadableConfig(f"{where} cannot be read: {exc.strerror or exc}") from None
    if markers := conflict_lines(text):
        count = (f" ({len(markers)} marker lines: {', '.join(map(str, markers[:12]))}"
                 f"{', ...' if len(markers) > 12 else ''})" if len(markers) > 1 else "")
        raise UnreadableConfig(f"{where} line {markers[0]}: a merge-conflict marker left by "
                               f"`copier update`{count}: {RESOLVE}")
    try:
        values = OmegaConf.load(io.StringIO(text))
    except yaml.MarkedYAMLError as exc:
        raise UnreadableConfig(f"{where}{_yaml_problem(exc)}: fix the file there, then run "
                               "`git diff` to see what changed") from None
    except yaml.YAMLError as exc:
        first = str(exc).strip().split("\n")[0]
        raise UnreadableConfig(f"{where}: not valid YAML ({first})") from None
    except OSError:  # OmegaConf's word for a number or a boolean as the whole file
        values = None
    if not isinstance(values, DictConfig):
        raise UnreadableConfig(f"{where}: its top level must be a mapping of sections "
                               "(train:, checkpoint:, ...)")
    return values


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    """`` line L, column C: not valid YAML (the parser's problem, its context)``."""
    mark, context = exc.problem_mark or exc.context_mark, exc.context_mark
    at = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    words = exc.problem or exc.context or "a syntax error"
    if exc.problem and exc.context:
        words += f" {exc.context}"
        if context is not None and mark is not None and context.line != mark.line:
            words += f" that starts at line {context.line + 1}, column {context.column + 1}"
    return f"{at}: not valid YAML ({words})"
