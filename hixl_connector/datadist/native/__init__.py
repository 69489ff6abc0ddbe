"""The LLM-DataDist v2 API on the project's native engine (host memory)."""
