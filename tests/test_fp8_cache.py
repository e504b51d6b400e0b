"""kv_mode fp8 end to end (e4m3 keys and values, a scale per token and KV head): its configuration, generation
close to the fp16 cache under teacher forcing, prefix-cache hits read from e4m3 pages, and pages never leaked."""
import pytest
import torch
from pydantic import ValidationError

from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.config import KV_MODES, CacheConfig
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import load_checkpoint
from diffkv_serve.kernels.kv_write_sections import write_sections
from diffkv_serve.kernels.page_layout import PageFormat, page_bytes_for

from engine_helpers import TEST_DEVICE, assert_all_pages_free, run_all

# Teacher forcing along the fp16 engine's greedy tokens on the tiny random model (CPU, float32 model): measured
# top-1 agreement int8 0.995, fp8 0.979, int4 0.958; largest |logprob difference| of the forced tokens int8 0.003,
# fp8 0.010, int4 0.023. The bounds leave room for other seeds and devices, not for a broken decode.
MIN_AGREEMENT = 0.95
MAX_LOGPROB_DIFF = 0.05
TINY = None


def tiny_engine(mode: str, num_pages: int = 400, **cache) -> LLMEngine:
    global TINY
    if TINY is None:
        TINY = load_checkpoint("random:tiny")
    cfg = EngineConfig(device=TEST_DEVICE, max_model_len=256, enforce_eager=True, dtype="float32",
                       scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 256},
                       cache={"kv_mode": mode, "num_pages": num_pages, "block_size": 4, **cache})
    return LLMEngine(cfg, checkpoint=TINY)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (n,), generator=g).tolist() for n in lengths]


def _forced(engine, prompts, refs):
    """Teacher-forced outputs along refs (one request at a time: batch composition cannot matter)."""
    return [run_all(engine, [p], SamplingParams(temperature=0, max_tokens=len(r), ignore_eos=True, teacher_tokens=r,
                                                logprobs=True))[0] for p, r in zip(prompts, refs)]


# ---- configuration --------------------------------------------------------------------------------------------
def test_fp8_config_resolves_to_e4m3_k8v8_pages():
    cache = CacheConfig(kv_mode="fp8")
    assert "fp8" in KV_MODES and cache.float8 and not CacheConfig(kv_mode="int8").float8
    assert cache.precisions() == ((8, 8), None)
    d = cache.describe()
    assert d["high"] == "K8V8-e4m3" and d["low"] is None and d["prefix_caching"] is True
    assert "alpha_high" not in d  # the diffkv fields belong to diffkv only
    with pytest.raises(ValidationError, match="kv_mode"):
        CacheConfig(kv_mode="fp8_e5m2")


def test_float8_formats_are_checked():
    pb = page_bytes_for(16, 64, 4)
    fmt = PageFormat.make(8, 8, 64, pb, 4, float8=True)
    assert fmt.name == "K8V8-e4m3" and fmt.key_float8 and fmt.value_float8
    # Same bytes per token as integer K8V8: an fp8 pool holds as many tokens as an int8 one.
    assert fmt.tokens == PageFormat.make(8, 8, 64, pb, 4).tokens
    mixed = PageFormat.make(8, 4, 64, pb, 4, float8=True)
    assert mixed.key_float8 and not mixed.value_float8  # the 4-bit side keeps integer codes
    with pytest.raises(ValueError, match="float8"):
        PageFormat.make(4, 4, 64, pb, 4, float8=True)
    # diffkv's two-section writer holds integer codes only.
    low = PageFormat.make(4, 2, 64, pb, 4)
    with pytest.raises(ValueError, match="float8"):
        write_sections(torch.zeros(2, pb, dtype=torch.uint8), mixed, low, torch.float32, *([None] * 9))


# ---- generation ---------------------------------------------------------------------------------------------
def test_fp8_generation_agrees_with_fp16_and_frees_its_pages():
    prompts = _prompts((5, 17, 40, 60))
    ref_engine = tiny_engine("fp16")
    refs = [o.token_ids for o in run_all(ref_engine, prompts, SamplingParams(temperature=0, max_tokens=48,
                                                                             ignore_eos=True))]
    logprobs, usage = {}, {}
    for mode in ("fp16", "fp8", "int8", "int4"):
        eng = tiny_engine(mode)
        outs = _forced(eng, prompts, refs)
        agree = [a for o in outs for a in o.teacher_agree]
        logprobs[mode] = torch.tensor([x for o in outs for x in o.logprobs])
        usage[mode] = outs[-1].kv_usage
        if mode == "fp8":
            assert sum(agree) / len(agree) >= MIN_AGREEMENT
            assert eng.stats()["cache_dtype"] == "float32"
        assert_all_pages_free(eng)
    err = {m: (logprobs[m] - logprobs["fp16"]).abs().max().item() for m in ("fp8", "int8", "int4")}
    assert 0 < err["fp8"] <= MAX_LOGPROB_DIFF, err  # quantized (not a 16-bit copy), and close
    assert err["fp8"] < err["int4"], err  # 3 mantissa bits per element beat 4-bit integers
    # e4m3 pages have integer K8V8's size: the same pages for the same tokens, a quarter of a float32 cache.
    assert usage["fp8"]["pages_used"] == usage["int8"]["pages_used"]
    assert usage["fp8"]["bytes_used"] < 0.5 * usage["fp16"]["bytes_used"]
    assert_all_pages_free(ref_engine)


def test_fp8_prefix_cache_hit_reads_e4m3_pages():
    """A second request sharing a cached prefix attends over the prefix dequantized from its e4m3 pages: close to
    the same request computed without the cache, and every page comes back."""
    prefix, a_tail, b_tail = _prompts((30, 6, 7), seed=3)
    ref_engine = tiny_engine("fp16", enable_prefix_caching=False)
    ref = run_all(ref_engine, [prefix + b_tail], SamplingParams(temperature=0, max_tokens=16,
                                                                ignore_eos=True))[0].token_ids
    outs = {}
    for caching in (False, True):
        eng = tiny_engine("fp8", enable_prefix_caching=caching)
        _forced(eng, [prefix + a_tail], [ref])  # fills the cache (when on) with the prefix's blocks
        outs[caching] = _forced(eng, [prefix + b_tail], [ref])[0]
        st = eng.stats()
        block = eng.runner.kv.mm.fmt_high.tokens  # 14-token e4m3 pages here: the prefix is two blocks
        assert len(prefix) // block == 2
        assert (st["prefix_cache_hits"] >= 2 * block) == caching
        assert_all_pages_free(eng)
    diff = (torch.tensor(outs[True].logprobs) - torch.tensor(outs[False].logprobs)).abs().max().item()
    assert diff <= MAX_LOGPROB_DIFF
    assert sum(outs[True].teacher_agree) / len(ref) >= MIN_AGREEMENT - 0.1  # 16 tokens: one miss is 6%
    assert_all_pages_free(ref_engine)
