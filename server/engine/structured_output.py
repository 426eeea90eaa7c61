"""Structured outputs: a grammar per request, enforced token by token with xgrammar.

`GrammarBackend` turns a request's `StructuredOutputsParams` into a compiled grammar (xgrammar's
compiler caches results by schema text and options, so a repeated schema compiles once) and
each sequence gets a `GrammarProcessor` holding its own matcher. Compiling happens where the
request is made (the HTTP server does it on a worker thread before admission), never in the
engine step. In the step, constrained rows get a token bitmask (one fill per row, one masking
pass for all of them: `kernels/fused_cpu` on the CPU, xgrammar's kernels elsewhere);
unconstrained rows are not touched. A constraint the vocabulary cannot write is refused before
it is queued where that is cheap to see (a choice), else it fails its request alone when the
sequence gets stuck: both are the client's error, never a 500.

xgrammar (and the transformers it imports) load on the first structured request, so a server
that never sees one pays nothing at start.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from typing import TYPE_CHECKING, Any, Sequence as Seq, cast

import numpy as np
import torch

from kubeinfer.kernels import ops_cpu

from .logits_processor import LogitsProcessor, ProcessorFactory
from .sampling_params import InvalidRequestError, StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

    from ..model.tokenizer.tokenizer import Tokenizer

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is for the client.
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")
_CONTROL = re.compile("[\x00-\x1f]")


class GrammarViolation(RuntimeError):
    """A sampled token the grammar does not allow (a bug or a fault, never the client's doing)."""


class UnsatisfiableConstraint(InvalidRequestError):
    """The grammar allows no token of this vocabulary in the state the sequence reached (e.g. a
    regex whose next character no token holds): the request's own constraint cannot go on, so
    it fails alone as the client's error (a 400, or an error event once streaming)."""


def _client_message(error: Exception) -> str:
    lines = [_CPP_PREFIX.sub("", line) for line in str(error).strip().splitlines()]
    return " ".join(line.strip() for line in lines if line.strip()) or type(error).__name__


def _vocab_type(tokenizer_json: dict[str, Any]) -> tuple[str, bool]:
    """(xgrammar vocab type name, add_prefix_space) from a tokenizer.json's decoder and
    pre-tokenizer: byte-level BPE (GPT-2, Llama 3, Qwen), SentencePiece with byte fallback
    (Llama 2, Mistral) or plain strings."""
    def kinds(part: Any) -> list[str]:
        if not isinstance(part, dict):
            return []
        nested = part.get("decoders") or part.get("pretokenizers") or part.get("normalizers") or []
        return [str(part.get("type"))] + [kind for item in nested for kind in kinds(item)]

    decoder = kinds(tokenizer_json.get("decoder"))
    if "ByteLevel" in decoder:
        return "BYTE_LEVEL", False
    prefix = ("Metaspace" in kinds(tokenizer_json.get("pre_tokenizer"))
              or "Prepend" in kinds(tokenizer_json.get("normalizer")))
    return ("BYTE_FALLBACK" if "ByteFallback" in decoder else "RAW"), prefix


class GrammarBackend:
    """xgrammar bound to one tokenizer and vocabulary width. Thread-safe: requests compile on
    the server's worker threads while the engine thread makes matchers."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: Seq[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        vocab = [""] * vocab_size
        for text, index in tokenizer.backend.get_vocab(with_added_tokens=True).items():
            if index < vocab_size:
                vocab[index] = text
        # An empty entry is a special token to xgrammar: never allowed inside the grammar's text
        # (otherwise "<|im_end|>" could appear inside a JSON string). Stop tokens stay.
        for index in tokenizer.all_special_ids:
            if index < vocab_size and index not in self.stop_token_ids:
                vocab[index] = ""
        vocab_type, add_prefix_space = _vocab_type(json.loads(tokenizer.backend.to_str()))
        info = xgr.TokenizerInfo(vocab, xgr.VocabType[vocab_type], vocab_size=vocab_size,
                                 stop_token_ids=self.stop_token_ids, add_prefix_space=add_prefix_space)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        # What the matcher can write: each token's text as xgrammar matches it (special tokens,
        # blanked above, and the stop tokens write nothing).
        special = set(info.special_token_ids) | set(self.stop_token_ids)
        self._token_bytes = frozenset(text for index, text in enumerate(info.decoded_vocab)
                                      if text and index not in special)
        self._longest_token = max(map(len, self._token_bytes), default=0)
        self.json_bitmask = self._without_control_characters(tokenizer, vocab_size)

    def _without_control_characters(self, tokenizer: "Tokenizer", vocab_size: int) -> torch.Tensor:
        """A bitmask row allowing every token but those holding a control character (U+0000 to
        U+001F). JSON text never needs one raw (our JSON grammars allow no free whitespace and a
        string escapes them), yet xgrammar's JSON strings take any character but `"`, `\\`, CR
        and LF, so a model could write a raw \\x06 into a string that strict parsers refuse."""
        texts = tokenizer.backend.decode_batch([[index] for index in range(vocab_size)], skip_special_tokens=False)
        banned = np.array([index for index, text in enumerate(texts) if _CONTROL.search(text)], dtype=np.int64)
        row = np.full((vocab_size + 31) // 32, 0xFFFFFFFF, dtype=np.uint32)
        np.bitwise_and.at(row, banned // 32, ~(np.uint32(1) << (banned % 32).astype(np.uint32)))
        return torch.from_numpy(row.view(np.int32))

    def compile(self, spec: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        """The compiled grammar of `spec` (cached); InvalidRequestError names what is wrong."""
        spec.validate()
        compiler = self.compiler
        if spec.json is not None:
            what = "JSON schema"
            schema = spec.json if isinstance(spec.json, str) else _dumps(spec.json, what)
            try:
                unsupported = unsupported_feature(json.loads(schema))
            except ValueError as error:
                raise InvalidRequestError(f"invalid {what} for structured outputs: not JSON ({error})") from error
            if unsupported:
                raise InvalidRequestError(f"unsupported JSON schema feature for structured outputs: {unsupported}")
            schema = json.dumps(bounded_strings_as_patterns(json.loads(schema)))
            return self._checked(what, lambda: compiler.compile_json_schema(schema, any_whitespace=False))
        if spec.json_object:
            return self._guard("JSON object", lambda: compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False))
        if spec.regex is not None:
            regex = spec.regex
            return self._checked("regex", lambda: compiler.compile_regex(regex))
        if spec.choice is not None:
            grammar = "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
            compiled = self._checked("choice", lambda: compiler.compile_grammar(grammar))
            for choice in spec.choice:
                self.check_writable(choice)
            return compiled
        assert spec.grammar is not None
        text = spec.grammar
        return self._checked("grammar", lambda: compiler.compile_grammar(text))

    def _checked(self, what: str, compile_it: Any) -> "xgrammar.CompiledGrammar":
        compiled = self._guard(what, compile_it)
        self.check_first_token(compiled, what)
        return compiled

    @staticmethod
    def _guard(what: str, compile_it: Any) -> "xgrammar.CompiledGrammar":
        try:
            return compile_it()
        except (RuntimeError, ValueError, TypeError) as error:
            raise InvalidRequestError(f"invalid {what} for structured outputs: {_client_message(error)}") from error

    def check_first_token(self, compiled: "xgrammar.CompiledGrammar", what: str) -> None:
        """Refuse a constraint that no token of this vocabulary can start (e.g. a choice of a
        control character the tokenizer has no token for): generating it could only end in a
        grammar violation, so it is the request's error, answered before it is queued."""
        if not self.allows_some_token(self._xgr.GrammarMatcher(compiled)):
            raise InvalidRequestError(f"invalid {what} for structured outputs: no token of this model's "
                                      "vocabulary can begin it")

    def allows_some_token(self, matcher: "xgrammar.GrammarMatcher", is_json: bool = False) -> bool:
        """Whether the grammar, where `matcher` stands, lets any token of this vocabulary come next."""
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if is_json:
            bitmask &= self.json_bitmask
        return bool(bitmask.any())

    def check_writable(self, choice: str) -> None:
        """Refuse a choice that no sequence of this vocabulary's tokens spells (a character no
        token holds, e.g. U+0016 in SmolLM2's): the model could start it and then be stuck."""
        data = choice.encode()
        if all(data[i:i + 1] in self._token_bytes for i in range(len(data))):
            return   # every byte is a token of its own: the usual case, found in one pass
        reached = [True] + [False] * len(data)   # reached[i]: tokens spell exactly data[:i]
        for start in range(len(data)):
            if reached[start]:
                for end in range(start + 1, min(len(data), start + self._longest_token) + 1):
                    reached[end] = reached[end] or data[start:end] in self._token_bytes
        if not reached[-1]:
            stuck = max(i for i, ok in enumerate(reached) if ok)
            character = data[stuck:].decode(errors="replace")[:1]
            raise InvalidRequestError(f"invalid choice for structured outputs: {choice!r} cannot be written "
                                      f"with this model's vocabulary (no token spells {character!r} there)")

    def processor_factory(self, compiled: "xgrammar.CompiledGrammar", is_json: bool) -> ProcessorFactory:
        """Makes one matcher per sequence (n>1 siblings each follow their own tokens)."""
        return lambda: GrammarProcessor(self, self._xgr.GrammarMatcher(compiled), is_json)


# Keywords xgrammar would silently ignore, so the output could break them: refused instead.
_UNSUPPORTED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "contains",
                "uniqueItems", "unevaluatedItems")


# Maps from names to schemas: a property called "if" or "not" is no keyword.
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions")


def unsupported_feature(schema: Any, path: str = "") -> str | None:
    """Where `schema` uses a keyword the grammar cannot enforce, e.g. "'not' at /properties/a"."""
    if isinstance(schema, list):
        return next((found for i, item in enumerate(schema) if (found := unsupported_feature(item, f"{path}/{i}"))),
                    None)
    if not isinstance(schema, dict):
        return None
    where = path or "/"
    for keyword in _UNSUPPORTED:
        if keyword in schema and schema[keyword] is not False:
            return f"{keyword!r} at {where}"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return f"'multipleOf' on a non-integer at {where}"
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return f"'pattern' together with 'minLength'/'maxLength' at {where} (bound the pattern instead)"
    for key, value in schema.items():
        if key in _NAMED_SCHEMAS and isinstance(value, dict):   # keys are names, not keywords
            found = next((found for name, sub in value.items()
                          if (found := unsupported_feature(sub, f"{path}/{key}/{name}"))), None)
        elif key not in ("enum", "const", "default", "examples") and isinstance(value, (dict, list)):
            found = unsupported_feature(value, f"{path}/{key}")
        else:
            found = None
        if found:
            return found
    return None


# A JSON string character xgrammar's maxLength grammar allows (no escapes, no quote), minus the
# control characters that JSON rows may not hold anyway (GrammarBackend.json_bitmask).
_STRING_CHARACTER = '[^"\\\\\\x00-\\x1f]'
# Up to this bound the pattern compiles in about the time maxLength does (1.2 s at 64, measured);
# above it, maxLength is fast at run time again and the pattern's compile grows (and failed at 200).
MAX_PATTERN_LENGTH = 64


def bounded_strings_as_patterns(schema: Any) -> Any:
    """`{"type": "string", "maxLength": n}` (with or without minLength) as the same strings
    written as a pattern, `^[^"\\\\\x00-\x1f]{min,n}$`. xgrammar expands a small maxLength into a
    repetition whose token masks it cannot precompute, hundreds of times slower per row and step
    inside such a string than the pattern's automaton (BENCHMARKS.md, "Structured outputs:
    constrained against free decoding"). Both accept the same strings."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in ("enum", "const", "default", "examples") else bounded_strings_as_patterns(value)
           for key, value in schema.items()}
    high, low = out.get("maxLength"), out.get("minLength", 0)
    if out.get("type") == "string" and isinstance(high, int) and isinstance(low, int) \
            and 0 <= low <= high <= MAX_PATTERN_LENGTH and not {"pattern", "format", "enum", "const"} & out.keys():
        del out["maxLength"]
        out.pop("minLength", None)
        out["pattern"] = f"^{_STRING_CHARACTER}{{{low},{high}}}$"
    return out


def _dumps(schema: Any, what: str) -> str:
    try:
        return json.dumps(schema)
    except (TypeError, ValueError) as error:
        raise InvalidRequestError(f"invalid {what} for structured outputs: {error}") from error


class GrammarProcessor(LogitsProcessor):
    """Masks every token the grammar cannot take next; advances with each sampled token.

    Speculative decoding (vLLM's way with xgrammar): the matcher takes the drafts a row needs
    before filling its mask, and rolls back; it is positioned lazily (`_position`), so scoring
    k draft positions costs k accepted tokens, and a draft the engine keeps is one the matcher
    already took (`accept` only drops it from `_ahead`)."""

    speculative = True

    def __init__(self, backend: GrammarBackend, matcher: "xgrammar.GrammarMatcher", is_json: bool) -> None:
        self.backend = backend
        self.matcher: "xgrammar.GrammarMatcher | None" = matcher
        self.is_json = is_json  # also masks raw control characters (GrammarBackend.json_bitmask)
        self._base = self                     # the sequence's own processor (a draft row's view: its sequence's)
        self._drafts: tuple[int, ...] = ()    # the drafts in front of this view's row
        self._ahead: list[int] = []           # draft tokens the matcher took past the sequence's tokens
        self._fault: Exception | None = None  # a matcher that raised while moving: its request fails

    def at_drafts(self, token_ids: list[int]) -> "GrammarProcessor":
        view = copy.copy(self)
        view._drafts = tuple(token_ids)
        return view

    def validate_drafts(self, token_ids: list[int]) -> int:
        return self._base._position(tuple(token_ids))

    def _position(self, drafts: tuple[int, ...]) -> int:
        """Put the matcher after the sequence's tokens and `drafts`, as far as the grammar
        allows them; returns how many it allows. A stop token is counted but not kept taken
        (no mask follows it), nor are drafts after a refused one: rows behind those are never
        kept (the refused draft's own row masks it), so their mask need only be some valid one."""
        matcher = self.live_matcher_unpositioned()
        ahead = self._ahead
        try:
            keep = 0
            for taken, wanted in zip(ahead, drafts):
                if taken != wanted:
                    break
                keep += 1
            if keep < len(ahead):
                matcher.rollback(len(ahead) - keep)
                del ahead[keep:]
            for token in drafts[keep:]:
                if not matcher.accept_token(token):
                    break
                if matcher.is_terminated():
                    matcher.rollback(1)
                    return len(ahead) + 1
                ahead.append(token)
            return len(ahead)
        except Exception as error:
            self._fault = error
            raise

    @classmethod
    def apply_rows(cls, logits: torch.Tensor, rows: list[int], processors: Seq[LogitsProcessor]) -> None:
        grammars = cast("Seq[GrammarProcessor]", processors)  # the sampler groups processors by class
        backend = grammars[0].backend
        xgr = backend._xgr
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
        for row, processor in zip(rows, grammars):
            processor.live_matcher().fill_next_token_bitmask(bitmask, row)
        json_rows = [row for row, processor in zip(rows, grammars) if processor.is_json]
        if json_rows:   # one op for all JSON rows
            bitmask[json_rows] &= backend.json_bitmask
        if ops_cpu.token_bitmask_available(logits):
            # One vectorised pass that also says which rows kept a finite logit; xgrammar's
            # CPU kernel tests bit by bit (BENCHMARKS.md, "Quiet rerun: the mask, not the forward pass").
            dead = ~ops_cpu.apply_token_bitmask(logits, bitmask, rows)
        else:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
            # A row's max is cheaper to find than a finite entry (isfinite + any wrote a bool per logit).
            index = torch.tensor(rows, device=logits.device)
            dead = ~(logits.amax(dim=1).index_select(0, index) > float("-inf"))
        # min_tokens may have masked the grammar's only way out (its stop tokens): the grammar wins.
        # (A row whose grammar allows no token at all is stuck: its stop token fails in `accept`.)
        if bool(dead.any()):
            for row, stuck in zip(rows, dead.tolist()):
                if stuck:
                    logits[row, backend.stop_token_ids] = 0.0

    def live_matcher(self) -> "xgrammar.GrammarMatcher":
        """The matcher, positioned at this row (after the sequence's tokens and the drafts in front)."""
        self._base._position(self._drafts)
        return self._base.live_matcher_unpositioned()

    def live_matcher_unpositioned(self) -> "xgrammar.GrammarMatcher":
        base = self._base
        if base._fault is not None:
            raise GrammarViolation("the grammar matcher failed while checking drafts") from base._fault
        if base.matcher is None:
            raise GrammarViolation("the grammar matcher was already released")
        return base.matcher

    def accept(self, token_id: int) -> None:
        matcher = self.live_matcher_unpositioned()
        if self._ahead and self._ahead[0] == token_id:   # a kept draft: the matcher already took it
            del self._ahead[0]
            return
        self._position(())
        if not matcher.accept_token(token_id):
            if not self.backend.allows_some_token(matcher, self.is_json):   # stuck: the request's constraint
                raise UnsatisfiableConstraint(
                    "the structured output constraint cannot be completed: no token of this model's "
                    "vocabulary can continue it from what was generated")
            raise GrammarViolation(f"token {token_id} does not match the grammar")

    def release(self) -> None:
        self.matcher = None
        self._ahead = []


class GrammarBackendHolder:
    """Builds the backend on first use (importing xgrammar), once, from any thread."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: Seq[int]) -> None:
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def get(self) -> GrammarBackend:
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    self._backend = GrammarBackend(*self._args)
        return self._backend
