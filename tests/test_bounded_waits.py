"""No unbounded wait anywhere in the package: every `ray.get`, `ray.wait`, queue get, lock
acquire, event wait, future result and thread join carries a timeout (or is itself the
awaitable that `asyncio.wait_for` bounds), except the ones listed here with a reason. A
wait without a bound is how a dead peer turns into a hang nobody is told about."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "distflow_lab"
WAITS = {"get", "wait", "acquire", "result", "join"}
# (file, function, call): why it may wait without a timeout
ALLOWED: dict[tuple[str, str, str], str] = {}


def _receiver(call: ast.Call) -> str:
    f = call.func
    v = f.value if isinstance(f, ast.Attribute) else None
    return v.id if isinstance(v, ast.Name) else (v.attr if isinstance(v, ast.Attribute) else "")


def _is_wait(call: ast.Call) -> bool:
    """A call that blocks until something else happens, unless given a timeout."""
    f = call.func
    if not isinstance(f, ast.Attribute) or f.attr not in WAITS:
        return False
    base, kws = _receiver(call), {k.arg for k in call.keywords}
    if "timeout" in kws:
        return False
    if base == "ray":
        return f.attr in ("get", "wait")
    if f.attr == "get":  # dict.get, .get(key): only a queue's get() blocks
        return "queue" in base.lower() and not call.args
    if f.attr == "acquire":
        return not call.args  # acquire(False) / acquire(True, t) say how long
    if f.attr == "join":
        return not call.args  # str.join(x) has an argument; Thread.join() / Queue.join() do not
    return not call.args  # Event.wait(), Future.result(), Condition.wait()


class _Walk(ast.NodeVisitor):
    """Each unbounded wait with the function it is in (the innermost)."""

    def __init__(self, tree: ast.AST) -> None:
        self.found: list[tuple[str, str, int]] = []
        self.where = ["<module>"]
        # the awaitable inside asyncio.wait_for(x, timeout) is bounded by it
        self.bounded = {id(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
                        and isinstance(n.func, ast.Attribute) and n.func.attr == "wait_for"}

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.where.append(node.name)
        self.generic_visit(node)
        self.where.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        if id(node) not in self.bounded and _is_wait(node):
            self.found.append((self.where[-1], f"{_receiver(node)}.{node.func.attr}", node.lineno))
        self.generic_visit(node)


def unbounded_waits(source: str) -> list[tuple[str, str, int]]:
    """(function, call, line) of every unbounded wait in `source`."""
    tree = ast.parse(source)
    walk = _Walk(tree)
    walk.visit(tree)
    return walk.found


def test_every_wait_in_the_package_is_bounded():
    unlisted = [f"{path.relative_to(PACKAGE)}:{line} in {fn}(): {call}(...) without a timeout"
                for path in sorted(PACKAGE.rglob("*.py")) for fn, call, line in unbounded_waits(path.read_text())
                if (str(path.relative_to(PACKAGE)), fn, call) not in ALLOWED]
    assert not unlisted, "unbounded waits (give each a timeout, or list it in ALLOWED with the reason):\n" + \
        "\n".join(unlisted)


def test_the_walk_finds_an_unbounded_wait():
    """The checker itself: it flags what it must and passes what is bounded."""
    src = ("import ray, asyncio\n"
           "def f(q, lock, ev, t):\n"
           "    ray.get(x)\n    ray.wait([x], timeout=1)\n    q_queue.get()\n    lock.acquire()\n"
           "    ev.wait()\n    t.join()\n    ','.join(['a'])\n    {}.get('k')\n    ray.get(x, timeout=5)\n"
           "async def g(e):\n    await asyncio.wait_for(e.wait(), 5)\n")
    assert sorted(call for _, call, _ in unbounded_waits(src)) == ["ev.wait", "lock.acquire", "q_queue.get",
                                                                   "ray.get", "t.join"]
    assert {fn for fn, _, _ in unbounded_waits(src)} == {"f"}
