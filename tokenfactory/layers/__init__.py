"""What model code is built from, below the models and the engine: paged attention, RMSNorm, rotary
embeddings, the compiled CPU kernels behind them, and weight-only quantized linear layers with their
formats. Imports only tokenfactory.types and tokenfactory.config (tests/test_layering.py)."""
