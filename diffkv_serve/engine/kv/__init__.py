"""The KV cache's vocabulary, one module per part (docs/DESIGN.md "Memory manager"):

  layout.py            the pool's shape and how many pages a byte budget buys (page bytes: diffkv_serve/kernels/page_layout.py)
  pool.py              MemoryManager: one rank's on-device pool, free list and bidirectional page table
  prefix_blocks.py     the pool's prefix-cache block pages
  invariants.py        what tests check of a pool (every page free or owned exactly once)
  reservation.py       worst-case page reservations the scheduler plans with
  footprint.py         learned prompt reservation: what DiffKV prompts of a length really keep
  policy.py            KVCache: the compression policy driving the pool and the kernels per step
  request_settings.py  KVRequestSettings: one request's DiffKV thresholds and prune phase, resolved once
  prefix_cache.py      the driver's prefix-cache index (hash-chained, reference-counted blocks)
  slots.py             sequence slots (rows of the page and length tables)
  distributed.py       DistributedPages: the driver's page view over tensor-parallel ranks
"""
