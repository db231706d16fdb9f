"""The OpenAI-compatible HTTP server: request bodies, engine requests, responses, metrics."""
