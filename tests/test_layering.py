"""The package's layers import one way (docs/DESIGN.md, "Layout"):

    planner (stdlib only) <- kernels (torch, triton) <- ops <- mcore (ops' public names)

and tools/ reaches the package through its public surface only (the names the ops,
planner and mcore packages export, and the top-level modules),

read from the source with `ast` (nothing is imported), function-level imports included:
a lazy import is still a dependency. The CUDA driver binding (`megatron_overlap/
cuda_driver.py`) is a stdlib-only leaf that kernels and ops both use.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "megatron_overlap"

#: mcore modules allowed to import below the public ops API, with exactly the modules
#: they import (none now). The test fails when an entry is no longer accurate.
PENDING: dict[str, set[str]] = {}


def _module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (`kernels/` is installed as
    megatron_overlap.kernels, pyproject.toml's package-dir)."""
    files = {}
    for base, dotted in ((ROOT / PKG, PKG), (ROOT / "kernels", f"{PKG}.kernels")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([dotted, *parts])] = path
    return files


MODULES = _module_files()


def imports_of(source: str, module: str, is_package: bool, known=MODULES) -> set[str]:
    """Absolute names of the modules `source` (module `module`) imports anywhere, with
    `from package import name` resolved to package.name where that is a known module."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known)
    found.discard("__future__")
    return found


def _imports(module: str) -> set[str]:
    path = MODULES[module]
    return imports_of(path.read_text(), module, path.name == "__init__.py")


def _under(package: str) -> list[str]:
    return [m for m in MODULES if m == package or m.startswith(package + ".")]


def _rel(module: str) -> str:
    return MODULES[module].relative_to(ROOT).as_posix()


def _is(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _below_public_ops(name: str) -> bool:
    return _is(name, f"{PKG}.kernels") or name.startswith(f"{PKG}.ops.")


def test_the_import_scan_resolves_relative_submodule_and_lazy_imports():
    known = {"p.c.a", "p.c.a.sub", "p.c.b", "p.d"}
    source = ("from . import b, name\nfrom .a import thing\nfrom .. import d\nimport os\n"
              "def f():\n    from .a import sub\n")
    want = {"p.c", "p.c.b", "p.c.a", "p.c.a.sub", "p", "p.d", "os"}
    assert imports_of(source, "p.c.m", False, known) == want
    assert imports_of(source, "p.c", True, known) == want  # (an __init__: its own package)


def test_mcore_imports_only_the_public_ops_api():
    """No mcore module reaches a kernel or an ops submodule; `megatron_overlap.ops` (its
    __init__'s names) is the one way in. PENDING lists what is not moved yet, exactly."""
    found = {}
    for module in _under(f"{PKG}.mcore"):
        bad = {n for n in _imports(module) if _below_public_ops(n)}
        if bad or _rel(module) in PENDING:
            found[_rel(module)] = bad
    stale = {f: sorted(PENDING[f] - found.get(f, set())) for f in PENDING
             if PENDING[f] - found.get(f, set())}
    assert not stale, f"no longer imported (remove them from PENDING): {stale}"
    new = {f: sorted(bad - PENDING.get(f, set())) for f, bad in found.items()
           if bad - PENDING.get(f, set())}
    assert not new, (f"mcore imports kernels or private ops modules (export what it needs "
                     f"from megatron_overlap/ops/__init__.py instead): {new}")


def test_kernels_never_import_ops_mcore_or_megatron():
    bad = {_rel(m): sorted(n for n in _imports(m)
                           if _is(n, f"{PKG}.ops") or _is(n, f"{PKG}.mcore")
                           or _is(n, "megatron"))
           for m in _under(f"{PKG}.kernels")}
    assert not {f: b for f, b in bad.items() if b}


def _stdlib_only(package: str) -> dict[str, list[str]]:
    bad = {_rel(m): sorted(n for n in _imports(m) if not _is(n, package)
                           and n.partition(".")[0] not in sys.stdlib_module_names)
           for m in _under(package)}
    return {f: b for f, b in bad.items() if b}


def test_planner_imports_only_the_stdlib():
    assert not _stdlib_only(f"{PKG}.planner")


def test_cuda_driver_binding_imports_only_the_stdlib():
    assert not _stdlib_only(f"{PKG}.cuda_driver")


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> the modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_a_two_module_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_kernels_have_no_import_cycle():
    kernels = set(_under(f"{PKG}.kernels"))
    graph = {m: (_imports(m) & kernels) - {m} for m in kernels}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


#: `os` names that reach the process environment
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
#: where the package may touch the environment: module -> the functions that may (None:
#: anywhere in it). Library code takes an OverlapConfig; only these read variables. The
#: test fails when an entry no longer touches it.
ENV_READERS = {
    f"{PKG}.env": None,  # OverlapConfig.from_env's implementation
    f"{PKG}.ops.config": {"interpreting"},  # TRITON_INTERPRET, Triton's own variable
    f"{PKG}.mcore.prefill": None,  # a torchrun entry point: RANK
    f"{PKG}.mcore.parallel": {"init_parallel"},  # a run's process: LOCAL_RANK, multicast off
    f"{PKG}.demo": None,  # a launcher: starts its ranks' processes with their environment
}


def env_reads(source: str) -> list[tuple[int, str | None]]:
    """(line, innermost enclosing function or None) of every use of os.environ, os.getenv
    and the like in `source`, `import os as ...` and `from os import environ` included."""
    tree = ast.parse(source)
    os_names = {"os"} | {a.asname for n in ast.walk(tree) if isinstance(n, ast.Import)
                         for a in n.names if a.name == "os" and a.asname}
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = (child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                     else function)
            if (isinstance(child, ast.Attribute) and child.attr in ENV_NAMES
                    and isinstance(child.value, ast.Name) and child.value.id in os_names):
                found.append((child.lineno, function))
            elif (isinstance(child, ast.ImportFrom) and child.module == "os"
                  and any(a.name in ENV_NAMES for a in child.names)):
                found.append((child.lineno, function))
            visit(child, inner)

    visit(tree, None)
    return found


def test_the_environment_scan_finds_every_kind_of_read():
    source = ("import os\nimport os as o\nfrom os import getenv\nX = os.environ['A']\n"
              "def f():\n    def g():\n        return o.getenv('B')\n    return os.environ\n")
    assert env_reads(source) == [(3, None), (4, None), (7, "g"), (8, "f")]
    assert env_reads("import os\nos.path.join('a', 'b')\nenviron = {}\n") == []


def test_library_code_reads_no_environment_variable():
    """No module of the package (kernels/ included) reads the environment outside
    ENV_READERS: a setting is an OverlapConfig field or argument, and the variables reach
    it through `OverlapConfig.from_env()` (megatron_overlap/env.py)."""
    bad, touching = [], set()
    for module, path in MODULES.items():
        allowed = ENV_READERS.get(module, set())
        for line, function in env_reads(path.read_text()):
            if allowed is None or function in allowed:
                touching.add(module)
            else:
                bad.append(f"{_rel(module)}:{line} (in {function or 'the module body'})")
    assert not bad, ("library code reads the environment; make it an OverlapConfig field "
                     f"that OverlapConfig.from_env reads instead: {bad}")
    stale = sorted(set(ENV_READERS) - touching)
    assert not stale, f"no longer touch the environment (remove them from ENV_READERS): {stale}"
    # (the helpers of env.py read variables too: only from_env's module may call them)
    users = sorted(_rel(m) for m in MODULES if f"{PKG}.env" in _imports(m))
    assert users == [_rel(f"{PKG}.ops.config")], users


# ---------------------------------------------------------------- tools/ (public API only)
#: the packages a tool reaches the library through, each by the names its __init__ exports
PUBLIC_PACKAGES = (PKG, f"{PKG}.ops", f"{PKG}.planner", f"{PKG}.mcore")
#: the package's top-level modules (megatron_overlap/<name>.py): public but their _names
TOP_MODULES = frozenset(m for m, path in MODULES.items()
                        if path.parent == ROOT / PKG and path.name != "__init__.py")
#: tools that check the kernels themselves (their jit functions are the subject): they may
#: import the kernels layer, nothing else below the public surface
KERNEL_CHECKS = {"tools/compile_check.py"}


def _literal_names(node, assigned: dict) -> set[str]:
    """The strings of an `__all__` value: a list / tuple literal, a dict literal's keys, or
    sorted(...) / list(...) of one, directly or through a module-level name."""
    if isinstance(node, ast.Name) and node.id in assigned:
        return _literal_names(assigned[node.id], assigned)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)}
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant)}
    if isinstance(node, ast.Call) and len(node.args) == 1:
        return _literal_names(node.args[0], assigned)
    raise AssertionError(f"cannot read __all__ from {ast.dump(node)[:200]}")


def exported_names(package: str) -> set[str]:
    """What `package`'s __init__ lists in __all__ (read from the source)."""
    assigned = {n.targets[0].id: n.value for n in ast.parse(MODULES[package].read_text()).body
                if isinstance(n, ast.Assign) and len(n.targets) == 1
                and isinstance(n.targets[0], ast.Name)}
    return _literal_names(assigned["__all__"], assigned)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(source: str, exported=None) -> set[str]:
    """What `source` reaches below the public surface: a module of the package other than
    the public packages and the top-level modules, a name a public package does not
    export (`exported`: package -> its names), a _name of a top-level module, and a
    _name read off a public module it imported (`prefill._setup`)."""
    exported = exported or {p: exported_names(p) for p in PUBLIC_PACKAGES}
    public = set(PUBLIC_PACKAGES) | TOP_MODULES
    bad, modules = set(), {}  # modules: local name -> public module it is bound to
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _is(alias.name, PKG):
                    continue
                if alias.name not in public:
                    bad.add(alias.name)
                elif alias.asname:
                    modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and _is(node.module or "", PKG):
            base = node.module
            if base not in public:
                bad.add(base)
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in public:
                    modules[alias.asname or alias.name] = full
                elif (alias.name not in exported[base] if base in exported
                      else _private(alias.name)):
                    bad.add(full)
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and _private(node.attr)):
            bad.add(f"{modules[node.value.id]}.{node.attr}")
    return bad


def test_the_tools_scan_finds_private_modules_names_and_attributes():
    exported = {p: {"Public"} for p in PUBLIC_PACKAGES}
    source = (f"import {PKG}.ops.plans\nimport {PKG}.stats as st\n"
              f"from {PKG}.ops import Public, hidden\nfrom {PKG}.ops.config import x\n"
              f"from {PKG}.mcore import Public as P\nfrom {PKG} import shapes, kernels\n"
              f"from {PKG}.routing import route, _helper\n"
              "def f():\n    from megatron.core import parallel_state\n"
              "    return st._private(), shapes.MODELS, st.__name__\n")
    assert private_uses(source, exported) == {
        f"{PKG}.ops.plans", f"{PKG}.ops.hidden", f"{PKG}.ops.config", f"{PKG}.kernels",
        f"{PKG}.routing._helper", f"{PKG}.stats._private"}
    assert "load_tiles" in exported_names(f"{PKG}.ops")
    assert "plan" in exported_names(PKG)  # (the root's __all__ = sorted(_EXPORTS))


def test_tools_use_only_the_public_api():
    """tools/ are the package's products' users: every tool imports `megatron_overlap`,
    its ops / planner / mcore packages (the names their __init__ exports) and its
    top-level modules only. KERNEL_CHECKS may import the kernels too."""
    exported = {p: exported_names(p) for p in PUBLIC_PACKAGES}
    found = {}
    for path in sorted((ROOT / "tools").glob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        bad = private_uses(path.read_text(), exported)
        if rel in KERNEL_CHECKS:
            bad = {n for n in bad if not _is(n, f"{PKG}.kernels")}
        if bad:
            found[rel] = sorted(bad)
    assert not found, (f"tools reach below the public API (use or deliberately export a "
                       f"public name of megatron_overlap.ops / .planner / .mcore): {found}")
