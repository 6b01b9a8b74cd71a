"""Speculative decoding: a proposer drafts the next tokens of a decoding request, one target step verifies
them all, and a rejection sampler keeps the longest prefix the target agrees with (plus one token of its
own). Output is the same as without speculation: token-identical under greedy sampling, the same
distribution under random sampling.

Modules: config (vLLM's --speculative-config JSON), ngram (prompt lookup), draft (a draft model), rejection
(the acceptance rule), rows (which logit rows a step returns), metrics (vLLM's spec_decode counters), decoder
(the engine's hooks).
"""
