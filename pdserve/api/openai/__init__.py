"""The OpenAI-compatible HTTP contract: request/response models (`protocol`), error bodies (`errors`), request
fields -> SamplingParams (`params`) and /tokenize, /detokenize (`tokenization`). Shared by the engine server and
the render tier, which import it and never each other."""
