"""CUDA graphs for decode steps. Per bucket size up to three graphs are captured and replayed back to back:

  policy             Algorithm 1 for the token leaving each head's window (diffkv only)
  memory management  page growth, token moves and the new tokens' write targets (KVCache.decode_pages)
  forward            the model with the paged attention kernels, and the logits

so a decode step costs one host-to-device copy and two or three graph launches instead of one launch per
operator (the step is launch-bound at small batch otherwise). Per-request settings (thresholds, prompt length,
prunable positions) are not among the step's inputs: the policy graph gathers them from the policy's per-slot
table (KVCache.slot_alphas / slot_ranges, written at each sequence's prefill) by the step's slots. CUDA
events around the memory-management replay time it on the device.

Static buffers hold the step's inputs. Padding rows point at the memory manager's dummy slot (every
section empty, length 0, all-zero settings): they allocate nothing, their write targets are page -1 (skipped) and they read
no token. Capture runs with every row padded, because the captured work is not idempotent (it moves
tokens and adds attention to their scores); the real inputs are copied in afterwards. The decode kernel
is captured with max_len = max_model_len, which fixes its split count for every length.

Memory (diffkv_serve/engine/graph_memory.py): every bucket writes its logits into one static buffer sized for
the largest, the buckets share one graph pool, and capture_all captures the largest first so smaller buckets
reuse its blocks. `memory_bytes` is what capturing took (device memory reserved before vs after).
"""
from __future__ import annotations

import logging

import torch

from diffkv_serve.engine.attention import PagedAttention, StepMetadata
from diffkv_serve.engine.graph_memory import graph_buckets
from diffkv_serve.engine.model import CausalLM
from diffkv_serve.engine.profiling import cost_range


log = logging.getLogger(__name__)

ROWS = 4  # a step's inputs: ids, positions, slots, new lengths


def reserved_by(dev: torch.device, capture) -> int:
    """Run `capture` (warm-ups on a side stream, then graph captures) and return the device memory it left
    reserved: the side stream's cached warm-up blocks go back first, the graphs' pool stays."""
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_reserved(dev)
    capture()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    return max(torch.cuda.memory_reserved(dev) - before, 0)


class DecodeGraphs:
    def __init__(self, model: CausalLM, attn: PagedAttention, max_batch: int, max_model_len: int,
                 token_table: torch.Tensor | None = None, budget: int | None = None):
        self.model, self.attn, self.kv = model, attn, attn.kv
        # Async scheduling: the forward gathers each row's input id from the slot's last sampled token on the
        # device (ModelRunner.token_table) instead of the staged ids, which the host may not know yet.
        self.token_table = token_table
        self.dummy = self.kv.mm.dummy_slot
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.buckets = graph_buckets(max_batch)
        dev = self.kv.mm.device
        # ids, positions, slots, new lengths
        self.ints = torch.zeros(ROWS, max_batch, dtype=torch.int64, device=dev)
        # A pinned staging copy, filled through a numpy view: a pin_memory() per step cost ~0.2 ms of host time.
        # A step of bucket b uses its first ROWS * b entries as a contiguous [ROWS, b] block.
        self.ints_host = torch.zeros(ROWS * max_batch, dtype=torch.int64).pin_memory()
        self.copied = torch.cuda.Event()  # the last step's staging copies are done (the buffers may be reused)
        self.graphs: dict[int, tuple] = {}  # bucket -> (plan graph or None, memory graph, forward graph, outputs)
        # fp32 logits of every bucket (a bucket of b rows writes the first b): outside the graph pool, shared
        self.logits = torch.empty(max_batch, model.vocab_rows, dtype=torch.float32, device=dev)
        self.memory_bytes = self.logits.numel() * 4  # the logits buffer, then what each capture took
        self.budget = budget  # bytes the pool's sizing set aside for the graphs (None: not budgeted)
        # One stream for every bucket's warm-up: the caching allocator keeps freed blocks per stream, so a new
        # stream per bucket would strand a step's activations for each.
        self.side = torch.cuda.Stream(dev)
        self._warned = False
        self.pool = None
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def capture_all(self) -> None:
        """Capture every bucket now (benchmarks: capturing, and compiling what it runs, stays out of timed
        steps). Only between steps: capture runs padding rows through the step's work. Largest first: the
        shared pool then holds about one largest step, which the smaller ones reuse."""
        for b in sorted(self.buckets, reverse=True):
            if b not in self.graphs:
                self._capture(b)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _pad(self, start: int, stop: int) -> None:
        self.ints[:, start:stop].zero_()
        self.ints[2, start:stop] = self.dummy

    def _plan(self, b: int):
        slots, lens = self.ints[2, :b], self.ints[3, :b]
        return self.kv.plan_decode(slots.int(), lens.int())

    def _pages(self, b: int, plan):
        slots, lens = self.ints[2, :b], self.ints[3, :b]
        return self.kv.decode_pages(slots.int(), lens.int(), plan, timed=False)

    def _forward(self, b: int, dst_page: torch.Tensor, dst_row: torch.Tensor) -> torch.Tensor:
        ids, pos, slots = self.ints[0, :b], self.ints[1, :b], self.ints[2, :b]
        if self.token_table is not None:
            ids = self.token_table[slots]
        self.attn.meta = StepMetadata(False, pos.int(), dst_page, dst_row, slots.int(), self.max_model_len)
        return self.model.logits(self.model(ids, pos, self.attn), out=self.logits[:b])

    def _capture(self, b: int) -> None:
        self.memory_bytes += reserved_by(self.ints.device, lambda: self._capture_graphs(b))
        if self.budget is not None and self.memory_bytes > self.budget and not self._warned:
            self._warned = True
            log.warning("CUDA graphs up to batch %d took %.0f MiB, past the %.0f MiB the KV pool's sizing set "
                        "aside (lower max_graph_batch_size or gpu_memory_utilization)", b,
                        self.memory_bytes / 2**20, self.budget / 2**20)

    def _capture_graphs(self, b: int) -> None:
        self._pad(0, b)
        side = self.side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up on padding only: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                self._forward(b, *self._pages(b, self._plan(b)))
        torch.cuda.current_stream().wait_stream(side)
        g_plan = None
        if self.kv.diffkv:
            g_plan = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_plan, pool=self.pool):
                plan = self._plan(b)
            self.pool = g_plan.pool()
        else:
            plan = None
        g_mm, g_fwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_mm, pool=self.pool):
            dst = self._pages(b, plan)
        self.pool = g_mm.pool()
        with torch.cuda.graph(g_fwd, pool=self.pool):
            self._forward(b, *dst)
        self.graphs[b] = (g_plan, g_mm, g_fwd, plan, dst)  # keep plan and dst alive: later graphs read them

    def run(self, ids: list[int], positions: list[int], slots: list[int], new_lens: list[int],
            snapshot: bool = False) -> torch.Tensor:
        """One decode step of n <= max_batch sequences -> logits [n, V]. snapshot: copy the memory manager's
        step state to the host right after the memory-management graph (async scheduling)."""
        n = len(ids)
        b = self.bucket(n)
        if b not in self.graphs:
            if not self.graphs and b != self.buckets[-1]:
                self._capture(self.buckets[-1])  # the largest first: smaller buckets then reuse its pool blocks
            self._capture(b)
        self.copied.synchronize()  # long done (the last step's tokens were read), but never overwrite in flight
        stage = self.ints_host[:ROWS * b].view(ROWS, b)
        h = stage.numpy()
        for row, vals, fill in ((0, ids, 0), (1, positions, 0), (2, slots, self.dummy), (3, new_lens, 0)):
            h[row, :n] = vals
            h[row, n:] = fill
        self.ints[:, :b].copy_(stage, non_blocking=True)
        self.copied.record()
        g_plan, g_mm, g_fwd, _, _ = self.graphs[b]
        if g_plan is not None:
            with cost_range("policy"):
                g_plan.replay()
        start, end = self.events
        start.record()
        with cost_range("memory"):  # kernels replayed inside a graph are attributed to the range of its launch
            g_mm.replay()
        end.record()
        if snapshot:
            self.kv.mm.snapshot_step_state()
        with cost_range("model"):
            g_fwd.replay()
        self.kv.set_mm_events(start, end)
        return self.logits[:n]
