"""Structured outputs in the engine (engine.grammar, engine.structured_outputs): the batched bitmask op against
a per-token reference, the masks' row bookkeeping, and JSON-schema / json_object / choice / regex requests on
the embedded model whose outputs must validate and stop where the grammar ends."""
import json

import jsonschema
import pytest
import torch

from diffkv_serve.engine import SamplingParams
from diffkv_serve.engine.errors import InvalidRequestError
from diffkv_serve.engine.grammar import TokenMasks, apply_token_masks, compiler_for
from diffkv_serve.engine.structured_outputs import StructuredOutputsParams

from engine_helpers import run_all

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def test_apply_token_masks_matches_a_per_token_reference():
    g = torch.Generator().manual_seed(0)
    B, V = 5, 100
    logits = torch.randn(B, V, generator=g)
    allowed = torch.rand(2, V, generator=g) < 0.3
    bitmask = torch.zeros(2, 4, dtype=torch.int32)
    for r in range(2):
        for t in range(V):
            if allowed[r, t]:
                bitmask[r, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    out = apply_token_masks(logits, torch.tensor([1, 3]), bitmask)
    want = logits.clone()
    for r, row in enumerate([1, 3]):
        want[row, ~allowed[r]] = float("-inf")
    assert torch.equal(out, want)
    assert torch.equal(out[[0, 2, 4]], logits[[0, 2, 4]])  # rows without a grammar untouched
    both = apply_token_masks(logits[[1, 3]], torch.tensor([0, 1]), bitmask)  # every row masked
    assert torch.equal(both, want[[1, 3]])


def test_token_masks_follow_the_rows_kept(smollm):
    comp = compiler_for(smollm.tokenizer, smollm.arch.vocab_size)

    class Row:
        def __init__(self, grammar):
            self.grammar = grammar

    rows = [Row(None), Row(comp.matcher(StructuredOutputsParams(choice=["yes"]))), Row(None),
            Row(comp.matcher(StructuredOutputsParams(json_object=True)))]
    masks = TokenMasks.start(rows, smollm.arch.vocab_size)
    assert masks.rows == [1, 3] and masks.result().shape == (2, (smollm.arch.vocab_size + 31) // 32)
    kept = masks.take([0, 3])
    assert kept.rows == [1] and torch.equal(kept.result()[0], masks.result()[1])
    assert masks.take([0, 2]) is None
    assert TokenMasks.start([Row(None)], 10) is None


@pytest.mark.parametrize("spec, field", [
    ({}, "structured_outputs"), ({"json": PERSON, "regex": "a"}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs"), ({"choice": []}, "structured_outputs"),
    ({"jsn": PERSON}, "structured_outputs")])
def test_bad_specs_name_the_field(spec, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(structured_outputs=spec)
    assert e.value.param == field


def test_a_schema_that_does_not_compile_is_refused_on_add(make_engine):
    engine = make_engine(cache={"kv_mode": "fp16"})
    for bad in ({"type": "object", "properties": {"a": {"type": "no-such-type"}}},
                {"$ref": "#/definitions/missing"}):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("bad", "hi", SamplingParams(structured_outputs={"json": bad}))
        assert e.value.param == "structured_outputs" and "does not compile" in str(e.value)
    assert not engine.has_unfinished_requests()


def _chat(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


@pytest.mark.parametrize("kv_mode", ["fp16", pytest.param("diffkv", marks=pytest.mark.slow)])
def test_json_schema_output_validates_and_stops_at_the_grammar_end(make_engine, kv_mode):
    engine = make_engine(cache={"kv_mode": kv_mode})
    prompt = _chat(engine, "Give one person as JSON with a name and an age.")
    sp = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": PERSON})
    free = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    out = run_all(engine, [prompt], sp)[0]
    assert not free.text.lstrip().startswith("{")  # unconstrained, the model writes something else first
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), PERSON)
    # It ended because the grammar was complete: no EOS was needed after the closing brace.
    assert out.text.endswith("}") and out.token_ids[-1] not in engine.tokenizer.eos_token_ids


@pytest.mark.slow
def test_json_object_choice_and_regex_mixed_in_one_batch_with_a_free_row(make_engine):
    engine = make_engine(cache={"kv_mode": "fp16"})
    prompt = _chat(engine, "Is the sky blue? Answer.")
    specs = [{"json_object": True}, {"choice": ["yes", "no"]}, {"regex": "[0-9]{3}"}, None]
    for i, spec in enumerate(specs):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.7, seed=i, max_tokens=24,
                                                           structured_outputs=spec))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert isinstance(json.loads(outs["r0"].text), dict) or outs["r0"].finish_reason == "length"
    assert outs["r1"].text in ("yes", "no") and outs["r1"].finish_reason == "stop"
    assert len(outs["r2"].text) == 3 and outs["r2"].text.isdigit() and outs["r2"].finish_reason == "stop"
    assert outs["r3"].finish_reason in ("stop", "length")
