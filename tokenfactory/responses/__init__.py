"""The OpenAI Responses API (/v1/responses) over the request service; stored responses in the ledger's database."""
