"""The tokens-only routes (vLLM's `--enable-scale-out`), one spelling: served by `pdserve serve`, called by the
render tier, split into P/D legs by the proxy. No imports: the proxy reads it without pydantic."""

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
# vLLM's unauthenticated spelling of ABORT_PATH, kept on `--tokens-only` servers
# (vllm/entrypoints/serve/disagg/api_router.py `abort_router`)
LEGACY_ABORT_PATH = "/abort_requests"
# what an instance names a generate request: this + (its X-Request-Id, else the body's request_id); vLLM's
# ServingTokens does the same (vllm/entrypoints/serve/disagg/serving.py)
GENERATE_ID_PREFIX = "generate-tokens-"
