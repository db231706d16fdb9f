"""What users call: the offline `LLM`, the `atomrt` command line, and the OpenAI server."""
