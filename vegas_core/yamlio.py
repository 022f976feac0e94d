"""Reading YAML safely: profiles and config files are small plain data, so anything else
(aliases, huge texts, non-UTF-8 files, a key given twice) is refused with one line naming
the source."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from vegas_core.errors import VegasError

# Profiles and config files are a few KiB; anything this large is not one, and is refused
# before parsing.
MAX_YAML_BYTES = 4 * 2**20


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    if mark is None:
        return problem
    # PyYAML's marks count from zero; editors count from one.
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


class _RefusedYaml(Exception):
    """A YAML construct ``read_yaml`` does not accept."""


class _AliasFreeLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors and aliases. An alias repeats a node without
    copying it, so a few lines of nested aliases ("billion laughs") expand to more data
    than memory holds once anything walks them; profiles and config files never need them."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _RefusedYaml("YAML aliases (*name) are not allowed; write the values out")
        if getattr(event, "anchor", None) is not None:
            raise _RefusedYaml("YAML anchors (&name) are not allowed; write the values out")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        # PyYAML keeps the last of two equal keys without a word: a config file or profile
        # edited by hand would then run with a value its author did not see.
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1  # PyYAML counts lines from zero
                try:
                    earlier = first_line.get(key)
                except TypeError:
                    continue  # an unhashable key: SafeConstructor refuses it below
                if earlier is not None:
                    where = f"line {line}" if earlier == line else f"lines {earlier} and {line}"
                    raise _RefusedYaml(f"key '{key}' is given twice ({where}); keep one")
                first_line[key] = line
        return super().construct_mapping(node, deep)


def read_yaml(text: str, source: str) -> Any:
    """Parse one YAML document safely: the data, or ``VegasError`` with one line naming
    ``source`` (a file name, for messages).

    Refused: texts over ``MAX_YAML_BYTES``, anchors and aliases (and so merge keys), a
    mapping that gives one key twice (with the key and both lines), nesting deeper than
    Python can walk, and anything that is not YAML.
    """
    # Characters never outnumber UTF-8 bytes, so this cheap test errs only on the safe side.
    if len(text) > MAX_YAML_BYTES:
        raise VegasError(_too_large(source))
    try:
        # Safe: the loader is a SafeLoader, which builds only plain data.
        return yaml.load(text, Loader=_AliasFreeLoader)
    except _RefusedYaml as error:
        raise VegasError(f"{source}: {error}") from None
    except yaml.YAMLError as error:
        raise VegasError(f"{source}: not valid YAML: {_yaml_problem(error)}") from None
    except RecursionError:
        raise VegasError(f"{source}: not valid YAML: nested too deeply") from None
    except ValueError as error:
        # e.g. an integer with more digits than Python converts.
        raise VegasError(f"{source}: not valid YAML: {error}") from None


def _too_large(source: str) -> str:
    return (f"{source}: too large to be a profile or config file "
            f"(over {MAX_YAML_BYTES // 2**20} MiB)")


def read_yaml_file(path: str | os.PathLike, what: str) -> Any:
    """Read and parse one YAML file (``what`` names it in messages: "profile").

    Missing, unreadable, oversized or non-UTF-8 files raise ``VegasError`` with one line.
    """
    path = Path(path)
    try:
        # Read one byte past the bound, not the whole file: a huge file (or /dev/zero) is
        # refused without loading it into memory.
        with path.open("rb") as stream:
            raw = stream.read(MAX_YAML_BYTES + 1)
        if len(raw) > MAX_YAML_BYTES:
            raise VegasError(_too_large(str(path)))
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise VegasError(f"{path}: no such {what} file") from None
    except UnicodeDecodeError:
        raise VegasError(f"{path}: not a {what}: the file is not UTF-8 text") from None
    except OSError as error:
        raise VegasError(f"{path}: cannot read the {what}: {error.strerror or error}") from None
    return read_yaml(text, str(path))
