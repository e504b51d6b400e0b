"""Named workloads shared by benchmarks/throughput.py and benchmarks/vllm_baseline.py, so both engines run the same
prompts, lengths and pool, with prefix caching off as vLLM runs there (`--workload NAME` sets these defaults; flags
given beside it still win).

long-decode   128 random prompts of 64-256 tokens x 2,048 new tokens in a 0.98 GiB pool: few sequences, long
              decodes, the pool (not the batch limit) bounds the batch.
serving       1,024 random prompts of 512 tokens x 256 new tokens in an 8 GiB pool (about 390 sequences of 768
              tokens at 16 bits): prefill-heavy, hundreds of sequences at once.
"""
from __future__ import annotations

WORKLOADS: dict[str, dict] = {
    "long-decode": {"prompts": "synthetic", "num_prompts": 128, "prompt_len": None, "max_tokens": 2048,
                    "kv_memory_gb": 0.98, "prefix_caching": "off"},
    "serving": {"prompts": "synthetic", "num_prompts": 1024, "prompt_len": 512, "max_tokens": 256,
                "kv_memory_gb": 8.0, "max_num_seqs": 512, "prefix_caching": "off"},
}


def apply_workload(parser, argv: list[str]):
    """Parse `argv` with the named workload's values as defaults (explicit flags override them)."""
    known, _ = parser.parse_known_args(argv)
    name = getattr(known, "workload", None)
    if name is not None:
        parser.set_defaults(**WORKLOADS[name])
    return parser.parse_args(argv)
