"""The per-host agent and its engine backends (sim, vllm)."""
