"""The package's shape: no import circle among the product's modules (imports
inside functions count; those under `if TYPE_CHECKING:` do not), no product file over 600
lines, no private name of one module used by another, and the bench harness outside the
package. Read from the source files, as the package is laid out by pyproject.toml."""

import ast
import pathlib

_REPO = pathlib.Path(__file__).resolve().parents[1]
# where each package's files are (pyproject.toml's package-dir mapping)
ROOTS = {"sfi_sglang": _REPO / "sfi_sglang", "sfi_sglang.kernels": _REPO / "kernels",
         "sfi_sglang.router": _REPO / "router"}


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg, root in ROOTS.items():
        for f in root.rglob("*.py"):
            rel = f.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if pkg == "sfi_sglang" and parts[:1] in (["kernels"], ["router"]):
                continue
            out[name] = f
    return out


def _is_type_checking(node) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The product modules `name` imports, anywhere in its file but TYPE_CHECKING blocks."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    out = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                out.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            for a in node.names:
                out.add(f"{mod}.{a.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in out if m in known and m != name}


def test_no_import_circle():
    mods = modules()
    graph = {n: imports(n, p, set(mods)) for n, p in mods.items()}
    # a package's __init__ is imported with each of its modules: not an edge of its own
    graph = {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}
    cycles, state, stack = [], {}, []

    def dfs(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                dfs(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            dfs(n)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_check_sees_a_circle(tmp_path):
    """The circle check reads imports inside functions and skips TYPE_CHECKING blocks."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f():\n    from sfi_sglang.b import g\n")
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sfi_sglang.a import f\n"
                 "import sfi_sglang.a\n")
    known = {"sfi_sglang.a", "sfi_sglang.b"}
    assert imports("sfi_sglang.a", a, known) == {"sfi_sglang.b"}
    assert imports("sfi_sglang.b", b, known) == {"sfi_sglang.a"}
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sfi_sglang.a import f\n")
    assert imports("sfi_sglang.b", b, known) == set()


def test_no_product_file_over_600_lines():
    long = {str(p.relative_to(_REPO)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_no_private_name_crosses_modules():
    """`from X import _name` and `X._name` on an imported product module X are private uses."""
    mods = modules()
    bad = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sfi_sglang"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        bad.append(f"{name}: from {node.module} import {a.name}")
                    if f"{node.module}.{a.name}" in mods:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                bad.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
    assert not bad, bad


def test_bench_harness_is_outside_the_package():
    names = set(modules())
    assert "sfi_sglang.bench" not in names and (_REPO / "bench" / "harness.py").is_file()
    assert not any("harness" in n for n in names)


def test_the_method_does_not_import_sglang():
    """sfi_sglang.method is the method alone: the SGLang side is sfi_sglang.integration."""
    for name, path in modules().items():
        if not name.startswith("sfi_sglang.method"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(m == "sglang" or m.startswith("sglang.") for m in mods), (name, mods)
            assert not any(m.startswith("sfi_sglang.integration") for m in mods), (name, mods)


def _paths_named(text: str) -> set[str]:
    """Repository paths a document names (`bench/results/x.{json,md}` expanded)."""
    import re

    out = set()
    for m in re.finditer(r"((?:bench|docs|examples|tests|kernels|router|sfi_sglang)/[\w./{},*-]+)", text):
        p = m.group(1).rstrip(".,)")
        if "*" in p:
            continue
        brace = re.search(r"\{([^}]*)\}", p)
        alts = brace.group(1).split(",") if brace else [""]
        for a in alts:
            out.add(p[:brace.start()] + a + p[brace.end():] if brace else p)
    return out


def test_readme_is_for_users():
    """README: at most 300 lines; no path outside the repository and no project history;
    every repository path it names exists; every SFIConfig field is in its flag table."""
    import re

    from sfi_sglang.method.config import SFIConfig, cli_name

    text = (_REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert "../" not in text
    assert not re.search(r"\b(issue|session)s? ?#?\d", text, re.I)
    missing = sorted(p for p in _paths_named(text) if not (_REPO / p).exists())
    assert not missing, missing
    for doc in ("docs/method.md", "docs/design.md"):
        assert doc in text and (_REPO / doc).is_file()
        assert not [p for p in _paths_named((_REPO / doc).read_text()) if not (_REPO / p).exists()], doc
    flags = set(re.findall(r"`(--sfi-[a-z0-9-]+)`", text))
    assert {cli_name(f) for f in SFIConfig.field_names()} <= flags, (
        {cli_name(f) for f in SFIConfig.field_names()} - flags)


def test_the_path_check_sees_a_missing_file():
    assert _paths_named("see `bench/results/a.{json,md}` and docs/x.md.") == {
        "bench/results/a.json", "bench/results/a.md", "docs/x.md"}
