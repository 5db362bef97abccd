"""The Shard's structure, counted from its source at a commit (a check, not a test).

    .venv/bin/python scripts/shard_structure.py [REV ...]     (default: HEAD)

Reads broky/server/shard/*.py at each git revision (`git show`, nothing
imported, so any commit counts, the mixins of before issue 38 as well as the
core and parts after it) and prints:

- the Shard's methods: its own and its mixins' (before), or its own (after);
  its instance attributes: the names Shard.__init__ assigns (`self.x = ...`);
- the parts: the mixins Shard derives from (before); after, the part objects
  (classes whose __init__ takes `core`) and the modules of functions that take
  the core first (`def f(core: ShardCore, ...)`);
- `TYPE_CHECKING` declarations: annotated names and defs inside an
  `if TYPE_CHECKING:` block of a class body (what a mixin declared it uses of
  the others), and apart the names imported under a module's TYPE_CHECKING;
- calls between the classes: in each method of class A, a reference to a
  method that class B != A defines, reached as `self.m` (a mixin), `self.core.m`
  (a part calling the core), `self.<part>.m` (the core calling a part) or
  `self.core.<part>.m` (a part reaching another through the core). An edge is
  a distinct (A, B) pair; part-to-part edges leave the Shard class out. A
  part module that imports another part's module (or the core) counts too;
- what the core mediates: part A calls a core method that calls part B != A.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARD = "broky/server/shard"


def sources(rev: str) -> dict[str, str]:
    """module name -> source of broky/server/shard/*.py at `rev`."""
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{rev}:{SHARD}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    out = {}
    for name in names:
        if name.endswith(".py"):
            out[name[:-3]] = subprocess.run(
                ["git", "show", f"{rev}:{SHARD}/{name}"], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout
    return out


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def methods(cls: ast.ClassDef) -> list[str]:
    return [s.name for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]


def init_args(cls: ast.ClassDef) -> list[str]:
    for s in cls.body:
        if isinstance(s, ast.FunctionDef) and s.name == "__init__":
            return [a.arg for a in s.args.args]
    return []


def chain(node: ast.Attribute) -> tuple[str, list[str]]:
    """self.a.b.c -> ("self", ["a", "b", "c"])."""
    names = []
    cur: ast.expr = node
    while isinstance(cur, ast.Attribute):
        names.append(cur.attr)
        cur = cur.value
    return (cur.id if isinstance(cur, ast.Name) else ""), names[::-1]


def count(rev: str) -> None:
    trees = {name: ast.parse(text) for name, text in sources(rev).items()}
    classes: dict[str, ast.ClassDef] = {}
    module_of: dict[str, str] = {}
    class_tc = 0
    declared: Counter[str] = Counter()
    module_tc = 0
    for name, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.If) and is_type_checking(node.test):
                module_tc += sum(
                    len(s.names) for s in node.body if isinstance(s, (ast.Import, ast.ImportFrom))
                )
            if isinstance(node, ast.ClassDef):
                classes[node.name] = node
                module_of[node.name] = name
                for stmt in node.body:
                    if isinstance(stmt, ast.If) and is_type_checking(stmt.test):
                        for d in stmt.body:
                            if isinstance(d, ast.AnnAssign) and isinstance(d.target, ast.Name):
                                declared[d.target.id] += 1
                            elif isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)):
                                declared[d.name] += 1
                        class_tc += sum(
                            isinstance(d, (ast.AnnAssign, ast.FunctionDef, ast.AsyncFunctionDef))
                            for d in stmt.body
                        )
    shard = classes["Shard"]
    mixins = [b.id for b in shard.bases if isinstance(b, ast.Name)]
    objects = [n for n, c in classes.items() if n != "Shard" and "core" in init_args(c)]
    members = mixins or objects
    functions: dict[str, list[str]] = {}
    if not mixins:
        for name, tree in trees.items():
            fs = [
                n.name
                for n in tree.body
                if isinstance(n, ast.FunctionDef) and n.args.args and n.args.args[0].arg == "core"
            ]
            if fs:
                functions[name] = fs
    # The core's part attributes (self.<attr> = <Part>(self, ...)) and its instance attributes.
    part_attrs: dict[str, str] = {}
    attributes: list[str] = []
    for item in shard.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            for sub in ast.walk(item):
                if not isinstance(sub, (ast.Assign, ast.AnnAssign)):
                    continue
                assigned = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                for t in assigned:
                    if (
                        isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                    ):
                        if t.attr not in attributes:
                            attributes.append(t.attr)
                        v = sub.value
                        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in objects:
                            part_attrs[t.attr] = v.func.id
    defined: dict[str, str] = {m: "Shard" for m in methods(shard)}
    for name in members:
        for m in methods(classes[name]):
            defined.setdefault(m, name)
    core_methods = set(methods(shard))

    def refs(cls_name: str) -> dict[str, set[tuple[str, str]]]:
        own = set(methods(classes[cls_name]))
        out: dict[str, set[tuple[str, str]]] = defaultdict(set)
        for stmt in classes[cls_name].body:
            if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(stmt):
                if not isinstance(node, ast.Attribute):
                    continue
                base, names = chain(node)
                if base != "self" or not names:
                    continue
                target = None
                if mixins:
                    if names[0] in defined and names[0] not in own:
                        target = (defined[names[0]], names[0])
                elif cls_name == "Shard":
                    if len(names) >= 2 and names[0] in part_attrs:
                        target = (part_attrs[names[0]], names[1])
                elif names[0] == "core" and len(names) >= 2:
                    if names[1] in part_attrs and len(names) >= 3:
                        target = (part_attrs[names[1]], names[2])
                    elif names[1] in core_methods:
                        target = ("Shard", names[1])
                if target is not None and target[0] != cls_name:
                    out[stmt.name].add(target)
        return out

    graph = {name: refs(name) for name in [*members, "Shard"]}
    edges = {(a, b) for a, by in graph.items() for targets in by.values() for b, _ in targets}
    p2p = {(a, b) for a, b in edges if "Shard" not in (a, b)}
    both = {frozenset(e) for e in edges if (e[1], e[0]) in edges}
    p2p_both = {frozenset(e) for e in p2p if (e[1], e[0]) in p2p}
    imports: set[tuple[str, str]] = set()
    part_modules = {module_of[n] for n in members} | set(functions)
    for name in part_modules:
        for found in ast.walk(trees[name]):
            if (
                isinstance(found, ast.ImportFrom)
                and found.module
                and found.module.startswith("broky.server.shard.")
            ):
                other = found.module.rsplit(".", 1)[1]
                if other != name and (other in part_modules or other == "core"):
                    imports.add((name, other))
    mediated: set[tuple[str, str, str]] = set()
    for a in members:
        for called in graph[a].values():
            for b, m in called:
                if b == "Shard":
                    for c, _ in graph["Shard"].get(m, ()):
                        if c not in (a, "Shard"):
                            mediated.add((a, m, c))
    own = len(methods(shard))
    print(f"== {rev} ({'mixins' if mixins else 'a core and parts'})")
    print(f"Shard methods: {own + sum(len(methods(classes[n])) for n in mixins)} ({own} its own)")
    print(f"Shard instance attributes (assigned in __init__): {len(attributes)}")
    if mixins:
        print(f"parts (mixins): {len(mixins)}: {', '.join(mixins)}")
    else:
        print(
            f"parts: {len(objects)} objects ({', '.join(f'{a}={c}' for a, c in part_attrs.items())}), ",
            end="",
        )
        print(f"{len(functions)} modules of functions ({', '.join(sorted(functions))})")
        print(
            f"their methods: {sum(len(methods(classes[n])) for n in objects)}; functions taking the core: ",
            end="",
        )
        print(sum(len(v) for v in functions.values()))
    print(f"TYPE_CHECKING declarations in class bodies: {class_tc}; most declared: {declared.most_common(3)}")
    print(f"names imported under a module's TYPE_CHECKING: {module_tc}")
    print(f"class edges, the Shard class included: {len(edges)} ({len(both)} pairs both ways)")
    print(f"part-to-part edges: {len(p2p)} ({len(p2p_both)} pairs both ways)")
    print(f"part modules importing another part's module or the core: {len(imports)}")
    print(f"a part calls a core method that calls another part: {len(mediated)}")
    for a, m, c in sorted(mediated):
        print(f"    {a} -> Shard.{m} -> {c}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("revs", nargs="*", default=["HEAD"])
    for rev in parser.parse_args().revs:
        count(rev)


if __name__ == "__main__":
    main()
