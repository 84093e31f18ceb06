"""Grammar-aware boundaries: SGLang grammar backends `sfi-xgrammar` and `sfi-llguidance`
(registered with register_grammar_backend; choose one with `--grammar-backend`).

They are SGLang's xgrammar / llguidance backends whose JSON grammars (json_schema and
JSON mode) also watch the accepted tokens: when a token ends a JSON field or value
inside an object or array (a `,`, `}` or `]` outside strings), the grammar object sets
`sfi_boundary`. The `sfi` attention backend reads that flag from the batch's grammars
when it plans the next decode step and treats the token like a boundary token: the
first content token after it runs a slow step (min gap and cooldown still apply).
Regex and EBNF grammars are constrained as usual, without grammar boundaries.

The wrapping changes the class of each grammar object to a subclass of its own class
(so isinstance checks and the backends' static mask methods are unchanged) that adds
the tracking to accept_token, rollback and copy.
"""

from __future__ import annotations

BACKENDS = {"sfi-xgrammar": "xgrammar", "sfi-llguidance": "llguidance"}


class JsonTracker:
    """A minimal JSON lexer over token texts: in-string, escape and nesting depth.
    feed() says whether the token ended a field or value inside a container."""

    def __init__(self, texts: list[str]):
        self.texts = texts
        self.in_string = False
        self.escape = False
        self.depth = 0
        self.history: list[tuple[bool, bool, int]] = []  # state before each token, for rollback

    def feed(self, token: int) -> bool:
        self.history.append((self.in_string, self.escape, self.depth))
        text = self.texts[token] if 0 <= token < len(self.texts) else ""
        ended = False
        for ch in text:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth = max(0, self.depth - 1)
                ended = True
            elif ch == "," and self.depth > 0:
                ended = True
        return ended

    def rollback(self, k: int) -> None:
        if k <= 0 or not self.history:
            return
        k = min(k, len(self.history))
        self.in_string, self.escape, self.depth = self.history[-k]
        del self.history[-k:]


class BoundaryGrammarMixin:
    """Added in front of a grammar object's own class by wrap()."""

    sfi_tracker: JsonTracker
    sfi_boundary: bool = False
    sfi_events: list  # token indices (0-based, in accepted order) that ended a field/value

    def accept_token(self, token: int):
        super().accept_token(token)
        if self.sfi_tracker.feed(token):
            self.sfi_boundary = True
            self.sfi_events.append(len(self.sfi_tracker.history) - 1)

    def rollback(self, k: int):
        super().rollback(k)
        self.sfi_tracker.rollback(k)
        self.sfi_boundary = False

    def copy(self):
        return wrap(super().copy(), self.sfi_tracker.texts)


_SUBCLASSES: dict[type, type] = {}


def wrap(grammar, texts: list[str]):
    """Make `grammar` (a grammar object of any backend) report JSON field/value ends."""
    cls = type(grammar)
    if not issubclass(cls, BoundaryGrammarMixin):
        if cls not in _SUBCLASSES:
            _SUBCLASSES[cls] = type("SFI" + cls.__name__, (BoundaryGrammarMixin, cls), {})
        grammar.__class__ = _SUBCLASSES[cls]
    grammar.sfi_tracker = JsonTracker(texts)
    grammar.sfi_boundary = False
    grammar.sfi_events = []
    return grammar


def token_texts(tokenizer) -> list[str]:
    n = len(tokenizer)
    return tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False,
                                  clean_up_tokenization_spaces=False)


def _boundary_backend(base: type) -> type:
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    class BoundaryGrammarBackend(base):
        sfi_texts: list[str] = []

        def _init_value_dispatch(self, key, require_reasoning):
            grammar = super()._init_value_dispatch(key, require_reasoning)
            if key[0] == "json" and grammar is not None and not isinstance(grammar, InvalidGrammarObject):
                wrap(grammar, self.sfi_texts)
            return grammar

    BoundaryGrammarBackend.__name__ = "SFI" + base.__name__
    return BoundaryGrammarBackend


def create_xgrammar(server_args, tokenizer, vocab_size, eos_token_ids=None):
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from sglang.srt.runtime_context import get_serving

    serving = get_serving()
    backend = _boundary_backend(XGrammarGrammarBackend)(
        tokenizer, vocab_size=vocab_size,
        model_eos_token_ids=list(eos_token_ids) if eos_token_ids else None,
        any_whitespace=not serving.constrained_json_disable_any_whitespace,
        max_whitespace_cnt=serving.constrained_json_max_whitespace_cnt)
    backend.sfi_texts = token_texts(tokenizer)
    return backend


def create_llguidance(server_args, tokenizer, vocab_size, eos_token_ids=None):
    from sglang.srt.constrained.llguidance_backend import GuidanceBackend
    from sglang.srt.runtime_context import get_serving

    serving = get_serving()
    backend = _boundary_backend(GuidanceBackend)(
        tokenizer=tokenizer, any_whitespace=not serving.constrained_json_disable_any_whitespace,
        whitespace_pattern=serving.constrained_json_whitespace_pattern, n_vocab=vocab_size,
        eos_token_ids=eos_token_ids)
    backend.sfi_texts = token_texts(tokenizer)
    return backend


def register() -> None:
    """Register both backends and their `--grammar-backend` choices (plugin load)."""
    from sglang.srt.arg_groups.choices import GRAMMAR_BACKEND_CHOICES, add_grammar_backend_choices
    from sglang.srt.constrained.base_grammar_backend import register_grammar_backend

    add_grammar_backend_choices([n for n in BACKENDS if n not in GRAMMAR_BACKEND_CHOICES])
    register_grammar_backend("sfi-xgrammar", create_xgrammar)
    register_grammar_backend("sfi-llguidance", create_llguidance)
