"""The HTTP side: OpenAI-compatible API, metrics, auth and admission."""
