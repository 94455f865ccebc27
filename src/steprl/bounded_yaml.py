"""`load_yaml_bounded`: the one way steprl reads YAML it is given (configs, `--set` values, synthesis
specs, a run directory's saved config), with bounds on what the text may grow into.

`yaml.safe_load` executes nothing, but it is not bounded: nine lines of aliases (`&a [x, x, ...]`,
`&b [*a, *a, ...]`, ...) compose a small graph that reads as 10^9 values to whoever walks it (a
spec's tool description grew to a MemoryError after 82 s at 2.9 GB), `&a [*a]` reads as an endless
one, and ten thousand `[` overflow the composer's recursion. So the text is composed first, and
refused with one line (a `YamlTooLarge`, a `UserError`) naming where it came from and the limit
when it is longer than `MAX_BYTES`, nests deeper than `MAX_DEPTH`, or expands (every alias counted
as the whole value it names) to more than `MAX_VALUES` values or to an endless one; only then is it
constructed. A syntax error stays a `yaml.YAMLError`: each caller already reports it its own way.

It sits at the bottom of the import layers (it needs only `errors`), so that `envs` (synthesis
specs) and `diagnostics` (ATIF export) use the same loader as the config.
"""

from __future__ import annotations

from typing import Any

import yaml

from steprl.errors import UserError

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_VALUES", "BoundedLoader", "YamlTooLarge", "load_yaml_bounded"]

#: The largest YAML text read (a config is a few KB; a synthesis spec with big pools, some MB).
MAX_BYTES = 8 * 1024 * 1024
#: The deepest nesting of mappings and lists (a config nests 4 deep; the composer recurses on it).
MAX_DEPTH = 64
#: The most values the text may stand for once every alias is expanded (a config has hundreds).
MAX_VALUES = 1_000_000


class YamlTooLarge(UserError, ValueError):
    """YAML text over one of the bounds (the message names the text, the bound and what to do)."""


class BoundedLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses nesting deeper than `MAX_DEPTH` while it composes, before
    Python's recursion limit would (a subclass may add resolvers: `steprl.config.values`)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self.where = "YAML"

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YamlTooLarge(
                    f"{self.where}: nested deeper than {MAX_DEPTH} levels (line {self._line()}); flatten it."
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def _line(self) -> int:
        event = self.peek_event()
        return int(event.start_mark.line) + 1


def load_yaml_bounded(text: str, where: str, loader: type[BoundedLoader] = BoundedLoader) -> Any:
    """The one document in `text`, as `yaml.safe_load` reads it (`loader`: a subclass with more
    resolvers); `where` (a path, `override 'a.b=...'`) names the text in a `YamlTooLarge`."""
    if len(text) > MAX_BYTES:
        raise YamlTooLarge(
            f"{where}: {len(text):,} characters, over the {MAX_BYTES:,} a YAML input may have; "
            "split it or move bulk data to a task file."
        )
    reader = loader(text)
    reader.where = where
    try:
        node = reader.get_single_node()
        if node is None:
            return None
        _check_expanded(node, where)
        return reader.construct_document(node)
    finally:
        reader.dispose()


def _check_expanded(root: yaml.Node, where: str) -> None:
    """Refuse a graph that stands for more than `MAX_VALUES` values, or for an endless one.
    An alias is the same node object as its anchor, so each node's expanded size is computed
    once (memoized by identity): linear in the text, however large the expansion."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()  # nodes whose size is being computed: met again, they are a cycle

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise YamlTooLarge(
                f"{where}: an alias refers to a value that contains it (line {node.start_mark.line + 1}), "
                "an endless value; write the value out."
            )
        open_.add(key)
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        total = 1
        for child in children:  # depth is bounded by MAX_DEPTH, so the recursion is too
            total += size(child)
            if total > MAX_VALUES:
                raise YamlTooLarge(
                    f"{where}: expands to more than {MAX_VALUES:,} values (aliases counted as "
                    f"the values they repeat, line {node.start_mark.line + 1}); write less, or "
                    "fewer aliases of aliases."
                )
        open_.discard(key)
        sizes[key] = total
        return total

    size(root)
