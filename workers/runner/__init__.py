"""One rank's step: the model runner, its inputs, graph capture and replay, the sampler, the KV
cache and its sizing."""
