"""DiffKV Serve: an LLM engine with a DiffKV-compressed paged KV cache (engine, kernels) and its Ray Serve
OpenAI-compatible service (service). One installed package, so nothing of ours claims a generic top-level name."""
