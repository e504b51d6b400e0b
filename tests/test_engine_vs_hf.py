"""The engine computes the same function as Hugging Face transformers on the same weights."""
import pytest
import torch

from diffkv_serve.engine import SamplingParams
from diffkv_serve.engine.llm_engine import LLMEngine

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 50.",
    "Explain recursion to a child in two sentences.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish and German.",
    "If a train travels 60 km in 45 minutes, what is its speed in km/h?",
    "Tell me a fun fact about octopuses. 🐙",
    "Résumé: naïve café owners in Zürich",
]
NEW_TOKENS = 32
# float32 on CPU: the two implementations differ only in summation order.
LOGIT_ATOL = {torch.float32: 2e-3, torch.float16: 0.15, torch.bfloat16: 0.5}


def hf_model(ckpt):
    from diffkv_serve.engine.loader.hf_reference import hf_llama

    return hf_llama(ckpt)


@pytest.fixture(scope="module")
def prompt_ids(smollm):
    tok = smollm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
            for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(smollm, prompt_ids):
    model = hf_model(smollm)
    outs, logits = [], []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            logits.append(model(x).logits[0, -1].float())
            g = model.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
            outs.append(g[0, len(ids):].tolist())
    return outs, logits


def test_greedy_tokens_equal_transformers(make_engine, prompt_ids, hf_greedy):
    engine: LLMEngine = make_engine(dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, ids in enumerate(prompt_ids):
        engine.add_request(str(i), ids, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    for i, ref in enumerate(hf_greedy[0]):
        assert done[str(i)] == ref, f"prompt {i} ({PROMPTS[i]!r}) diverges from transformers"


def test_last_position_logits_match(make_engine, prompt_ids, hf_greedy):
    engine = make_engine(dtype="float32")
    for ids, ref in zip(prompt_ids, hf_greedy[1]):
        ours = engine.prompt_logits(ids)
        torch.testing.assert_close(ours, ref, atol=LOGIT_ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_close(make_engine, prompt_ids, hf_greedy, dtype):
    from engine_helpers import TEST_DEVICE

    if not TEST_DEVICE.startswith("cuda"):
        pytest.skip("half-precision engine runs on CUDA")
    engine = make_engine(dtype=dtype)
    tol = LOGIT_ATOL[getattr(torch, dtype)]
    for ids, ref in zip(prompt_ids, hf_greedy[1]):
        ours = engine.prompt_logits(ids)
        torch.testing.assert_close(ours, ref, atol=tol * 4, rtol=0.05)
        # The top choice may only differ where the reference itself is nearly tied.
        top = int(ours.argmax())
        assert top == int(ref.argmax()) or ref[top] >= ref.max() - 2 * tol
