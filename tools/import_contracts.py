"""Two import-linter contract types the built-in ones lack (docs/architecture.md), loaded by
`make lint` through `contract_types` in pyproject.toml:

- `acyclic_modules`: no circle among the modules of the given packages, counting imports inside
  functions and a package's `__init__` (import-linter's `acyclic_siblings` compares siblings
  only, so a child importing its own package's `__init__`, which imports the child, passes it);
- `no_module_strings`: a package names no module of the given ones in a string constant (a
  "module:attr" string imports upward when it is resolved, out of sight of the import graph).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from typing import Any, cast

from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class AcyclicModulesContract(Contract):
    type_name = "acyclic_modules"

    containers = fields.ListField(subfield=fields.StringField())

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        roots = tuple(_strings(self, "containers"))
        modules = sorted(m for m in graph.modules if m.split(".")[0] in roots)
        cycles = [c for c in _strongly_connected(modules, graph) if len(c) > 1]
        return ContractCheck(kept=not cycles, metadata={"cycles": cycles, "graph": graph})

    def render_broken_contract(self, check: ContractCheck) -> None:
        graph = check.metadata["graph"]
        for cycle in check.metadata["cycles"]:
            output.print_error(f"A circle of {len(cycle)} modules:", bold=True)
            members = set(cycle)
            for m in cycle:
                for n in sorted(graph.find_modules_directly_imported_by(m)):
                    if n in members:
                        lines = [d["line_number"] for d in
                                 graph.get_import_details(importer=m, imported=n)]
                        output.print_error(f"  {m} -> {n} (line {', '.join(map(str, lines))})",
                                           bold=False)
            output.new_line()


def _strings(contract: Contract, option: str) -> list[str]:
    """A list option's values (import-linter sets them on the contract as parsed)."""
    return cast("list[str]", getattr(contract, option))


def _strongly_connected(modules: list[str], graph: Any) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph has ~400 modules)."""
    members = set(modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in modules:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start) & members)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    imported = graph.find_modules_directly_imported_by(child) & members
                    work.append((child, iter(sorted(imported))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                found.append(sorted(component))
    return found


class NoModuleStringsContract(Contract):
    type_name = "no_module_strings"

    source_packages = fields.ListField(subfield=fields.StringField())
    forbidden_packages = fields.ListField(subfield=fields.StringField())

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        names = "|".join(map(re.escape, _strings(self, "forbidden_packages")))
        pattern = re.compile(rf"(?:{names})(?:\.\w+)*(?::\w+)?")
        hits = []
        for package in _strings(self, "source_packages"):
            spec = importlib.util.find_spec(package)
            assert spec is not None and spec.submodule_search_locations is not None
            for root in spec.submodule_search_locations:
                for path in sorted(Path(root).rglob("*.py")):
                    tree = ast.parse(path.read_text(), str(path))
                    hits += [(str(path), node.lineno, node.value) for node in ast.walk(tree)
                             if isinstance(node, ast.Constant) and isinstance(node.value, str)
                             and pattern.fullmatch(node.value)]
        return ContractCheck(kept=not hits, metadata={"hits": hits})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for path, line, value in check.metadata["hits"]:
            output.print_error(f"{path}:{line} names {value!r}: plug it in through an entry "
                               f"point or a registry instead", bold=False)
