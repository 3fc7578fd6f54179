"""What a Python source imports, read with `ast` (nothing is executed): the layering tests' checker.

    imported(source, package) -> {module name}   every import at any depth (functions, branches,
                                                 TYPE_CHECKING blocks), relative ones resolved
                                                 against `package`, and the string constants given
                                                 to importlib.import_module / __import__
    offending(names, banned) -> sorted names that are `banned` or inside it ("daemon" bans
                                "daemon.config", not "daemonize")
    package_imports(root, package) -> {path: {module name}} for every .py file under root
"""

from __future__ import annotations

import ast
import os

_DYNAMIC = {"import_module", "__import__"}  # importlib.import_module(name), __import__(name)


def _resolve(module: str | None, level: int, package: str) -> str:
    """`from <level dots><module> import ...` as an absolute name, seen from `package`."""
    if level == 0:
        return module or ""
    parts = package.split(".")
    base = parts[:len(parts) - (level - 1)] if level - 1 <= len(parts) else []
    return ".".join(base + ([module] if module else []))


def imported(source: str, package: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module, node.level, package)
            names.add(base)
            names.update(f"{base}.{a.name}" if base else a.name for a in node.names)  # `from daemon import engine`
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
            if name in _DYNAMIC and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)  # a relative import_module("..x", pkg) is not used in moed
    names.discard("")
    return names


def offending(names: set[str], banned: str) -> list[str]:
    return sorted(n for n in names if n == banned or n.startswith(banned + "."))


def package_imports(root: str, package: str) -> dict[str, set[str]]:
    """`root`: the package's directory; `package`: its dotted name. Files of subpackages included."""
    out: dict[str, set[str]] = {}
    for dirpath, _dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        pkg = package if rel == "." else ".".join([package, *rel.split(os.sep)])
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    src = fh.read()
                # a module's own package is `pkg` for relative imports (also for __init__.py)
                out[path] = imported(src, pkg)
    return out
