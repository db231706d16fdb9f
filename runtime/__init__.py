"""atomrt.runtime: config, forward context, scheduler, engine, offline `LLM`, executors, CLI.

The package itself imports nothing: `import atomrt.runtime.config` stays a leaf import. The names
a user's script imports (`LLM`, `SamplingParams`, ...) are the top-level package's
(`from atomrt import LLM, SamplingParams`, atomrt/__init__.py).
"""
