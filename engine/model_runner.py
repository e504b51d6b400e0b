"""Owns the model, the KV memory manager and one device; turns a scheduled batch into sampled tokens."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import PagedAttention, StepMetadata
from engine.config import EngineConfig
from engine.memory import CacheShape, MemoryManager
from engine.model import CausalLM
from engine.model_config import ModelArch
from engine.parallel import SINGLE, ParallelContext
from engine.sampler import sample
from engine.sequence import Sequence

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but no CUDA device is available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class Batch:
    is_prefill: bool
    seqs: list[Sequence]


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ModelArch, weights: dict | None, max_model_len: int,
                 pc: ParallelContext = SINGLE):
        self.config = config
        self.arch = arch
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        # Build directly on the device in the target dtype (an 8B model never exists in fp32).
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = CausalLM(arch, max_model_len, pc)
        finally:
            torch.set_default_dtype(prev)
        if weights is None:
            model.init_random(config.seed)
        else:
            model.load_weights(weights)
        self.model = model.eval()
        shape = CacheShape(arch.num_layers, arch.num_kv_heads // pc.world_size, arch.head_dim,
                           config.scheduler.max_num_seqs, max_model_len, config.cache.block_size)
        self.mm = MemoryManager(shape, self._num_pages(shape), self.dtype, self.device)
        self.attn = PagedAttention(self.mm, arch.head_dim ** -0.5)
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            from engine.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.attn, self.mm,
                                       min(config.max_graph_batch_size, config.scheduler.max_num_seqs), max_model_len)
        log.info("KV cache: %d pages of %d bytes (%d tokens each) on %s",
                 self.mm.num_pages, self.mm.page_bytes, self.mm.fmt.tokens, self.device)

    def _num_pages(self, shape: CacheShape) -> int:
        cc = self.config.cache
        if cc.num_pages is not None:
            return cc.num_pages
        if cc.kv_cache_memory_gb is not None:
            nbytes = cc.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations of a full batch of prefill tokens and logits.
            act = 64 * self.config.scheduler.max_num_batched_tokens * self.arch.hidden_size
            nbytes = max(free - (1 - cc.gpu_memory_utilization) * total - act, 2**26)
        else:
            nbytes = 0.5 * 2**30
        return MemoryManager.pages_for_bytes(shape, self.dtype, nbytes)

    @torch.inference_mode()
    def execute(self, batch: Batch, keep_logits: bool = False) -> tuple[list[int], list[float] | None]:
        """Run one step; with keep_logits the last positions' fp32 logits stay in self.last_logits."""
        seqs = batch.seqs
        if batch.is_prefill:
            ids, pos, cu = [], [], [0]
            for s in seqs:
                toks = s.all_token_ids  # recompute after preemption re-reads the outputs too
                ids.extend(toks)
                pos.extend(range(len(toks)))
                cu.append(cu[-1] + len(toks))
            new_lens = [s.num_tokens for s in seqs]
            token_slots = [s.slot for s in seqs for _ in range(s.num_tokens)]
            last = [c - 1 for c in cu[1:]]
        else:
            ids = [s.all_token_ids[-1] for s in seqs]
            pos = [s.num_cached for s in seqs]
            new_lens = [s.num_cached + 1 for s in seqs]
            token_slots = [s.slot for s in seqs]
            last = list(range(len(seqs)))
            cu = []
        if not batch.is_prefill and self.graphs is not None and len(seqs) <= self.graphs.max_batch:
            logits = self.graphs.run(ids, pos, [s.slot for s in seqs], new_lens)
        else:
            logits = self._eager(batch.is_prefill, ids, pos, new_lens, token_slots, last, cu, seqs)
        self.last_logits = logits if keep_logits else None
        tokens, logprobs = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for s, n in zip(seqs, new_lens):
            s.num_cached = n
        return tokens.tolist(), (logprobs.tolist() if logprobs is not None else None)

    def _eager(self, is_prefill, ids, pos, new_lens, token_slots, last, cu, seqs) -> torch.Tensor:
        dev, mm = self.device, self.mm
        old_lens = [0 if is_prefill else s.num_cached for s in seqs]
        max_new = max(-(-n // mm.fmt.tokens) - -(-o // mm.fmt.tokens) for n, o in zip(new_lens, old_lens))
        # One host-to-device copy for every per-step integer.
        host = torch.tensor([*ids, *pos, *[s.slot for s in seqs], *new_lens, *token_slots, *last, *cu],
                            dtype=torch.int64)
        packed = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host
        n_tok, B = len(ids), len(seqs)
        input_ids, positions, slots, lens, token_slots_t, last_t, cu_t = packed.split(
            [n_tok, n_tok, B, B, n_tok, len(last), len(cu)])
        positions, slots, lens = positions.int(), slots.int(), lens.int()
        mm.reserve(slots, lens, max_new)
        mm.set_lengths(slots, lens)
        dst_page, dst_row = mm.write_targets(token_slots_t, positions)
        self.attn.meta = StepMetadata(is_prefill, positions, dst_page, dst_row, slots, max(new_lens),
                                      cu_t.int() if is_prefill else None)
        hidden = self.model(input_ids, positions.long(), self.attn)
        return self.model.logits(hidden[last_t])
