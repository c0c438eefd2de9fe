"""The offline API, shaped like vLLM's `LLM` class."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from fp8serve.config import EngineConfig
from fp8serve.engine.llm_engine import LLMEngine, PromptInput
from fp8serve.engine.tokenizer import check_text
from fp8serve.entrypoints.chat_utils import conversation_for_template, template_options
from fp8serve.errors import InvalidParameterError, UserError
from fp8serve.outputs import RequestOutput
from fp8serve.sampling_params import SamplingParams


class LLM:
    """`LLM(model=None, dtype="auto", max_model_len=None, kv_cache_memory=None, seed=0,
    kv_cache_dtype="auto", quantization_param_path=None, calculate_kv_scales=False,
    block_size=16, max_num_seqs=128, max_num_batched_tokens=None, device="auto", enforce_eager=False,
    enable_prefix_caching=False, enable_chunked_prefill=False, speculative_config=None)`;
    `max_logprobs` (default 20; -1 = the vocabulary) bounds a request's logprobs per position.
    `speculative_config` is vLLM's dict (or JSON text), e.g. `{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}`.

    `model=None` uses the built-in default model (SmolLM2-135M-Instruct)."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.llm_engine = LLMEngine.from_args(model, **kwargs)

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "LLM":
        """An LLM on an EngineConfig built beforehand (EngineConfig.create): a caller can check the
        resolved config (max_model_len, say) before the weights load."""
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine(config)
        return llm

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's generation-config defaults (--generation-config)."""
        return SamplingParams(**self.llm_engine.config.model_config.default_sampling_params)

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
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            if not isinstance(sampling_params, (list, tuple)):
                raise InvalidParameterError(
                    f"sampling_params must be a SamplingParams or a list of them, got "
                    f"{type(sampling_params).__name__}", "sampling_params")
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidParameterError(
                    f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts; "
                    "pass one, or one per prompt", "sampling_params")
        bad = next((i for i, p in enumerate(params_list) if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise InvalidParameterError(f"sampling_params[{bad}] must be a SamplingParams, got "
                                        f"{type(params_list[bad]).__name__}", "sampling_params")
        return self._run(prompt_list, params_list, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's: add_generation_prompt (default True, or False with continue_final_message, which
        leaves the last message open for the model to continue); chat_template_kwargs are extra
        template variables."""
        if not isinstance(messages, list) or not messages:
            raise InvalidParameterError("messages must be a conversation (a non-empty list of {'role': ..., "
                                        "'content': ...} dicts) or a non-empty list of conversations", "messages")
        one = isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(
                        c, add_generation_prompt, chat_template, where="messages" if one else f"messages[{i}]",
                        continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)}
                   for i, c in enumerate(conversations)]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool | None = None,
                            chat_template: str | None = None, where: str = "messages",
                            continue_final_message: bool = False,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        tok = self.llm_engine.tokenizer
        if tok is None or (tok.chat_template is None and chat_template is None):
            # The template comes with the tokenizer: name the directory it was read from.
            mc = self.llm_engine.config.model_config
            source = f"--tokenizer {mc.tokenizer}" if mc.tokenizer else mc.model
            raise UserError(f"{source} has no chat template" if tok is not None else
                            f"{source} has no tokenizer files, so no chat template (pass tokenizer=DIR / "
                            "--tokenizer DIR)")
        options = template_options(add_generation_prompt, continue_final_message, chat_template_kwargs)
        conversation = conversation_for_template(messages, where)
        check_text(conversation, where)
        try:
            ids = tok.apply_chat_template(conversation, tokenize=True, chat_template=chat_template, **options)
        except Exception as e:  # noqa: BLE001 - Jinja's errors: the template's or the messages' fault
            raise InvalidParameterError(f"chat template failed on {where}: {type(e).__name__}: {e}",
                                        "chat_template") from None
        # transformers 5 returns a BatchEncoding-like mapping; older versions a list.
        return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)

    @staticmethod
    def _as_prompt_list(prompts) -> list[PromptInput]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # a single prompt given as token ids
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidParameterError("prompts must be a string, a token-id dict, or a non-empty list of them",
                                        "prompts")
        return list(prompts)

    def _run(self, prompts: list[PromptInput], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        # Validate every prompt before queueing any, so one bad prompt leaves
        # nothing half-submitted in the engine.
        tokenized = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                sp.validate()
                text, token_ids = engine.prompt_for(p, sp)
                engine.validate_prompt(token_ids)
                engine.validate_params(sp)
            except InvalidParameterError as e:
                if len(prompts) == 1:
                    raise
                # Which prompt of the batch, as the message's start.
                raise InvalidParameterError(f"prompt {i}: {e}", e.parameter) from None
            tokenized.append({"prompt_token_ids": token_ids, "prompt": text})
        ids: list[str] = []
        try:
            for p, sp in zip(tokenized, params):
                ids.append(engine.add_request(None, p, sp).request_id)
        except BaseException:
            # Nothing half-submitted: the requests queued so far go too.
            for rid in ids:
                engine.abort_request(rid)
            raise
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
