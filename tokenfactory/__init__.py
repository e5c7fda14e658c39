"""tokenfactory: from every watt to every token."""

from tokenfactory.types import FinishReason, GrammarSpec, PoolingParams, RequestOutput, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "FinishReason", "GrammarSpec", "PoolingParams", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> object:
    # LLM pulls in torch; keep `import tokenfactory` light for the CLI's planner and bench commands.
    if name == "LLM":
        from tokenfactory.engine.llm import LLM

        return LLM
    raise AttributeError(name)
