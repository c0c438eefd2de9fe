"""The offline API, shaped like vLLM's `LLM` class."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from fp8serve.engine.llm_engine import LLMEngine, PromptInput
from fp8serve.engine.tokenizer import check_text
from fp8serve.errors import UserError
from fp8serve.outputs import RequestOutput
from fp8serve.sampling_params import SamplingParams


class LLM:
    """`LLM(model=None, dtype="auto", max_model_len=None, kv_cache_memory=None, seed=0,
    kv_cache_dtype="auto", quantization_param_path=None, calculate_kv_scales=False,
    block_size=16, max_num_seqs=128, max_num_batched_tokens=None, device="auto", enforce_eager=False,
    enable_prefix_caching=False, enable_chunked_prefill=False, speculative_config=None)`;
    `speculative_config` is vLLM's dict (or JSON text), e.g. `{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}`.

    `model=None` uses the built-in default model (SmolLM2-135M-Instruct)."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.llm_engine = LLMEngine.from_args(model, **kwargs)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache (--enable-prefix-caching): later requests share nothing computed before."""
        self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`."""
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise UserError(
                    f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts; "
                    "pass one, or one per prompt"
                )
        return self._run(prompt_list, params_list, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt, chat_template)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> list[int]:
        tok = self.llm_engine.tokenizer
        if tok is None or (tok.chat_template is None and chat_template is None):
            raise UserError(f"{self.llm_engine.config.model_config.model} has no chat template")
        check_text(messages, "messages")
        ids = tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, chat_template=chat_template
        )
        # transformers 5 returns a BatchEncoding-like mapping; older versions a list.
        return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)

    @staticmethod
    def _as_prompt_list(prompts) -> list[PromptInput]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # a single prompt given as token ids
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise UserError("prompts must be a string, a token-id dict, or a non-empty list of them")
        return list(prompts)

    def _run(self, prompts: list[PromptInput], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        # Validate every prompt before queueing any, so one bad prompt leaves
        # nothing half-submitted in the engine.
        tokenized = []
        for p in prompts:
            text, token_ids = engine.tokenize_prompt(p)
            engine.validate_prompt(token_ids)
            tokenized.append({"prompt_token_ids": token_ids, "prompt": text})
        ids = [engine.add_request(None, p, sp).request_id for p, sp in zip(tokenized, params)]
        finished: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, leave=False) as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        return [finished[rid] for rid in ids]
