"""The SDK's modules ask each other by name: no `other._private` reaches.

When one part of the SDK needs another's internals, that need has a name (a method or
attribute documented as for the SDK's own modules, listed by the Protocol of the module
that needs it: LinkOwner, RouterOwner, SubscriptionOwner, ReadOwner). This walks the
SDK's source and fails on any `x._name` where x is not `self` or `cls`, but for the
NamedTuple API (`_replace`, `_asdict`, ...) and a class body naming its base class's
member (`deliver = Inbox._put`)."""

from __future__ import annotations

import ast

from tests.support.paths import ROOT

ROOT = ROOT / "broky"
SDK = [*sorted((ROOT / "client").rglob("*.py")), *sorted((ROOT / "spark").rglob("*.py")), ROOT / "cli.py"]
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def reaches(source: str, name: str) -> list[str]:
    tree = ast.parse(source)
    bases: set[str] = set()  # names of the base classes of the classes in this module
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                if isinstance(base, ast.Subscript):  # a generic base: Inbox[M]
                    base = base.value
                if isinstance(base, ast.Name):
                    bases.add(base.id)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or owner.id in bases):
            continue
        if node.attr in NAMEDTUPLE_API:
            continue
        found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_sdk_modules_do_not_reach_into_each_others_private_members() -> None:
    assert len(SDK) > 10  # the walk found the SDK
    found = [line for path in SDK for line in reaches(path.read_text(), str(path.relative_to(ROOT.parent)))]
    assert found == []


def test_the_check_finds_a_reach_and_lets_the_allowed_ones_pass() -> None:
    source = (
        "class Sub(Inbox[M]):\n"
        "    deliver = Inbox._put\n"
        "    def f(self, client, info):\n"
        "        self._x = info._replace(map=None)\n"
        "        return client._router.route\n"
    )
    assert reaches(source, "m.py") == ["m.py:5: client._router"]
