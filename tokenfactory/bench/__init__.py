"""Benchmarks: offline engine throughput, and load generation against OpenAI-compatible servers."""
