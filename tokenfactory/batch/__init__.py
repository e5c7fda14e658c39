"""The OpenAI Batch API: durable files and jobs (store), the runner that sends each line through the request
service, its HTTP routes, and `tokenfactory batch run` offline."""
