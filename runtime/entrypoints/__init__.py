"""What users call: the offline `LLM` and the `atomrt` command line."""
