"""Stages of benchmarks/real_gpu.py (the real SmolLM2-135M-Instruct on the lent GPU): long, eval, evolve, train."""
