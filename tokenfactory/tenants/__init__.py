"""Tenants and API keys: who may use the server, at which priority, weight, limits and budget."""
