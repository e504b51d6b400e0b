"""Which grammar library constrains decoding: xgrammar, llguidance and outlines-core compared on the embedded
SmolLM2 vocabulary (49,152 tokens), CPU only.

    python3 -m benchmarks.grammar_libraries [--repeats 3]

Per library: wheel size and install time (pip, --no-deps, into a scratch folder; the wheels pip downloads are
timed separately and left out), the one-off tokenizer set-up, compile time of json_object and of three JSON
schemas, and the per-token cost of walking a valid document of each schema token by token: compute the
allowed-token mask, then accept the document's next token (what the sampler pays per step and row).
Then, for the chosen one (llguidance) through engine.grammar: filling a step's masks for B rows and sample()
with B masked rows against none. Prints tables and writes benchmarks/results/grammar_libraries_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from benchmarks._results import write_result
from diffkv_serve.engine.loader import load_checkpoint
from diffkv_serve.engine.tokenizer import bytes_to_unicode

PACKAGES = {"xgrammar": "xgrammar", "llguidance": "llguidance", "outlines-core": "outlines_core"}

SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
        "required": ["name", "age", "email", "tags"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines"]}),
    "order": ({"type": "object", "properties": {
        "id": {"type": "integer"}, "status": {"enum": ["open", "paid", "shipped"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "note": {"type": ["string", "null"]}},
        "required": ["id", "status", "items", "note"], "additionalProperties": False},
        {"id": 1042, "status": "paid", "items": [{"sku": "A-1", "qty": 2, "price": 9.5},
                                                 {"sku": "B-22", "qty": 1, "price": 120.0}], "note": None}),
    "tool_call": ({"type": "object", "properties": {
        "name": {"const": "get_weather"}, "arguments": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}),
}


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def package_facts(name: str) -> dict:
    """Wheel size (the wheel alone) and pip's install time of that wheel into an empty folder."""
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", d, name], check=True,
                       capture_output=True)
        wheel = next(Path(d).glob("*.whl"))
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", f"{d}/t",
                        str(wheel)], check=True, capture_output=True)
        install_s = time.perf_counter() - t
        wheel_mb = wheel.stat().st_size / 2**20
        meta = subprocess.run([sys.executable, "-m", "pip", "show", name], capture_output=True, text=True).stdout
    requires = next((ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Requires:")), "")
    return {"wheel": wheel.name, "wheel_mb": round(wheel_mb, 2),
            "install_s": round(install_s, 2), "requires": requires}


class _Library:
    """One library behind the same four calls: setup (tokenizer), compile, matcher, step (mask + accept)."""

    name = ""

    def compile(self, schema: Optional[dict]):  # None: any JSON object
        raise NotImplementedError


class XGrammar(_Library):
    name = "xgrammar"

    def __init__(self, tok, vocab: int):
        import xgrammar as xgr

        self.xgr = xgr
        ids = tok.backend.get_vocab(with_added_tokens=True)
        encoded = [""] * vocab
        for s, i in ids.items():
            encoded[i] = s
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab,
                                 stop_token_ids=tok.eos_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        if schema is None:
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                                 strict_mode=True)

    def walk(self, compiled, tokens: list[int]) -> int:
        m = self.xgr.GrammarMatcher(compiled)
        for t in tokens:
            m.fill_next_token_bitmask(self.mask, 0)
            if not m.accept_token(t):
                return -1
        m.fill_next_token_bitmask(self.mask, 0)  # the step that may end it
        return int(m.is_terminated() or m.accept_token(self.eos))


class LLGuidance(_Library):
    name = "llguidance"

    def __init__(self, tok, vocab: int):
        import llguidance
        import llguidance.torch

        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=tok.eos_token_ids)
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        M = self.ll.LLMatcher
        grammar = M.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                             defaults={"whitespace_flexible": False})
        err = M.validate_grammar(grammar, self.tok)
        if err:
            raise ValueError(err)
        return M(self.tok, grammar)  # compiles lazily: the compile time includes the first mask

    def walk(self, compiled, tokens: list[int]) -> int:
        m = compiled.deep_copy()
        for t in tokens:
            self.ll.torch.fill_next_token_bitmask(m, self.mask, 0)
            if not m.consume_token(t):
                return -1
        self.ll.torch.fill_next_token_bitmask(m, self.mask, 0)
        return int(m.is_accepting())


class OutlinesCore(_Library):
    name = "outlines-core"

    def __init__(self, tok, vocab: int):
        from outlines_core import Vocabulary

        back = {c: b for b, c in bytes_to_unicode().items()}
        special = {t.content for t in tok.backend.get_added_tokens_decoder().values()}
        by_bytes: dict[bytes, list[int]] = {}
        for s, i in tok.backend.get_vocab(with_added_tokens=True).items():
            if s in special or i in tok.eos_token_ids:
                continue
            by_bytes.setdefault(bytes(back[c] for c in s), []).append(i)
        self.vocab, self.V = Vocabulary(tok.eos_token_ids[0], by_bytes), vocab

    def compile(self, schema):
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema

        if schema is None:
            raise NotImplementedError("no json_object grammar (regular expressions only)")
        return Index(build_regex_from_schema(json.dumps(schema)), self.vocab), Guide

    def walk(self, compiled, tokens: list[int]) -> int:
        index, Guide = compiled
        g = Guide(index)
        for t in tokens + [None]:
            mask = torch.zeros(self.V, dtype=torch.bool)
            mask[g.get_tokens()] = True
            if t is None:
                break
            if not mask[t]:
                return -1
            g.advance(t)
        return int(g.is_finished())


def measure(lib_cls, tok, vocab: int, repeats: int) -> dict:
    t = time.perf_counter()
    lib = lib_cls(tok, vocab)
    out: dict = {"setup_ms": round((time.perf_counter() - t) * 1e3, 1)}
    lib.eos = tok.eos_token_ids[0]
    docs = {"json_object": (None, {"a": [1, 2, {"b": "text"}], "ok": True})} | SCHEMAS
    for key, (schema, doc) in docs.items():
        try:
            compiled = lib.compile(schema)
        except NotImplementedError as e:
            out[key] = {"error": str(e)}
            continue
        compile_ms = _median_ms(lambda: lib.walk(lib.compile(schema), []), repeats)
        tokens = tok.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)
        ok = lib.walk(compiled, tokens)
        walk_ms = _median_ms(lambda: lib.walk(compiled, tokens), repeats)
        out[key] = {"compile_ms": round(compile_ms, 2), "tokens": len(tokens),
                    "per_token_us": round(walk_ms * 1e3 / (len(tokens) + 1), 1),
                    "document": {1: "accepted", 0: "not complete", -1: "token refused"}[ok]}
    return out


def step_cost(tok, vocab: int, batches: list[int], repeats: int) -> list[dict]:
    """What a step pays with the chosen library (llguidance, engine.grammar): filling B rows' masks on the
    host, and sample() (greedy) with all B rows masked against none."""
    from diffkv_serve.engine import SamplingParams
    from diffkv_serve.engine.grammar import TokenMasks, compiler_for
    from diffkv_serve.engine.sampler import sample
    from diffkv_serve.engine.structured_outputs import StructuredOutputsParams

    comp = compiler_for(tok, vocab)
    spec = StructuredOutputsParams(json=SCHEMAS["person"][0])
    rows = []
    for B in batches:
        seqs = [type("Row", (), {"grammar": comp.matcher(spec)})() for _ in range(B)]
        logits = torch.randn(B, vocab)
        params = [SamplingParams(temperature=0)] * B
        fill_ms = _median_ms(lambda: TokenMasks.start(seqs, vocab).result(), repeats)
        masks = TokenMasks.start(seqs, vocab)
        masks.result()
        plain_ms = _median_ms(lambda: sample(logits, params, [None] * B), repeats)
        masked_ms = _median_ms(lambda: sample(logits, params, [None] * B, masks=masks), repeats)
        rows.append({"batch": B, "fill_ms": round(fill_ms, 3), "sample_ms": round(plain_ms, 3),
                     "sample_masked_ms": round(masked_ms, 3)})
    return rows


def _cell(c: dict) -> str:
    if "error" in c:
        return "n/a: " + c["error"][:28]
    return f"{c['compile_ms']:.1f} / {c['per_token_us']:.0f} ({c['document']})"


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-install", action="store_true", help="skip the wheel download and install timing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tok = load_checkpoint(None).tokenizer
    vocab = tok.vocab_size
    result: dict = {"device": "cpu", "vocab": vocab, "threads": 1, "libraries": {}}
    for cls in (XGrammar, LLGuidance, OutlinesCore):
        row = {} if args.no_install else package_facts(cls.name)
        row.update(measure(cls, tok, vocab, args.repeats))
        result["libraries"][cls.name] = row
    keys = ["json_object"] + list(SCHEMAS)
    head = f"{'library':14} {'wheel MB':>8} {'inst s':>6} {'setup ms':>8} " + " ".join(
        f"{k + ' compile ms / us per token':>34}" for k in keys)
    print(head)
    for name, row in result["libraries"].items():
        cells = [f"{_cell(row[k]):>34}" for k in keys]
        print(f"{name:14} {row.get('wheel_mb', float('nan')):>8} {row.get('install_s', float('nan')):>6} "
              f"{row['setup_ms']:>8} " + " ".join(cells))
    result["step_cost_llguidance"] = step_cost(tok, vocab, [1, 16, 64], max(args.repeats, 5))
    print("\nllguidance in the sampler (first mask of the person schema, greedy sample):")
    print(f"{'batch':>5} {'fill masks ms':>13} {'sample ms':>9} {'sample masked ms':>16}")
    for r in result["step_cost_llguidance"]:
        print(f"{r['batch']:>5} {r['fill_ms']:>13} {r['sample_ms']:>9} {r['sample_masked_ms']:>16}")
    for name, row in result["libraries"].items():
        if "requires" in row:
            print(f"{name} requires: {row['requires'] or '(nothing)'}")
    write_result(result, "grammar_libraries", "cpu", args.out, smoke=False)
    return result


if __name__ == "__main__":
    main()
