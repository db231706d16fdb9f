"""Speculative decoding on the worker: the n-gram proposer (which the driver calls), the draft-model
proposer and its `DraftGraph`s, and the rejection sampler that verifies a step's drafts."""
