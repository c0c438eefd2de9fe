"""The OpenAI-compatible server: `build_app` (api_server) and `fp8serve serve` (serve)."""
