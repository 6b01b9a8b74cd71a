"""pdserve: disaggregated prefill/decode LLM serving."""

from typing import TYPE_CHECKING

from pdserve.version import __version__

if TYPE_CHECKING:
    from pdserve.llm import LLM
    from pdserve.types.sampling_params import SamplingParams
    from pdserve.types.structured_params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import pdserve` (e.g. in the proxy or render tier) never pulls in torch.
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.types.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from pdserve.types.structured_params import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(name)
