"""The request service: a `Call` and a validated body in, typed results out; no HTTP inside. Every endpoint
(the HTTP routes, the Batch API, context compression) goes through it."""
