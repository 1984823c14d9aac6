"""The OpenAI-compatible HTTP server: engine thread, routes, metrics."""
