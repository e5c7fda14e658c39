"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`, `.chat()` and
`.embed(prompts)` (each output's `embedding`)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenfactory.config import OFFLINE_BATCHING, EngineConfig
from tokenfactory.engine.engine import LLMEngine, Prompt
from tokenfactory.types import PoolingParams, RequestOutput, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, *, device: str = "cpu", dtype: str = "auto",
                 max_model_len: int | None = None, **engine_kwargs: object) -> None:
        """`model`: a GGUF file or a Hugging Face model folder; None loads the bundled SmolLM2-135M-Instruct.
        Other keyword arguments are EngineConfig fields (max_num_seqs, kv_cache_memory, block_size, ...); batching
        defaults to the offline sizes (`OFFLINE_BATCHING`: larger steps than a server's, nobody waits on them)."""
        config = EngineConfig(model=model, device=device, dtype=dtype, max_model_len=max_model_len,
                              **{**OFFLINE_BATCHING, **engine_kwargs})  # type: ignore[arg-type]
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a string, a list of token ids, or {"prompt_token_ids": [...]}).
        All prompts are validated before any is queued, so a bad one leaves nothing allocated."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        return self._run(prompts, params)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None
              ) -> list[RequestOutput]:
        """One embedding per prompt (`output.embedding`): the hidden states pooled as the engine pools them
        (`EngineConfig.pooling`), normalised unless `pooling_params` says otherwise. Prefill only."""
        prompts = _prompt_list(prompts)
        return self._run(prompts, [pooling_params or PoolingParams()] * len(prompts))

    def _run(self, prompts: list[Prompt], params: Sequence[SamplingParams | PoolingParams]) -> list[RequestOutput]:
        for prompt, p in zip(prompts, params, strict=True):
            _, ids = self.engine.tokenize_prompt(prompt)
            self.engine.check_prompt_length(len(ids), generates=isinstance(p, SamplingParams) and not p.prompt_only)
            self.engine.check_params(p)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        try:
            final = self.engine.run_to_completion(ids)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [final[rid] for rid in ids]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)  # type: ignore[arg-type]
            prompts.append({"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params)


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
