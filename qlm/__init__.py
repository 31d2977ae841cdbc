"""qlm: SLO-aware durable queue manager for LLM serving."""
