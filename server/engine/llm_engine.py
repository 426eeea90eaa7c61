"""The synchronous engine: validate requests, then step = schedule -> run -> sample -> update.

Single-threaded by design; `AsyncEngine` drives it from its own thread and `LLM` from a loop.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..model.checkpoints.pooling import read_pooler_config, resolve_task
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .kv_cache_manager import KVCacheManager
from .kv_event_publisher import open_kv_event_publisher
from .outputs import CompletionOutput, Logprob, RequestOutput
from .pooler import Pooler, PoolingTask
from .prompt_logprobs import PromptLogprobs
from .proposer import Proposer
from .sampler import Sampler, SamplerOutput, to_logprob_dict
from .sampling_params import InvalidRequestError, SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .scheduling_policy import build_policy
from .sequence import DraftPosition, Request, SamplingRow, Sequence, SequenceStatus
from .spec_decode.speculator import SpeculationTarget, Speculator, build_speculator
from .stats import EngineStats
from .structured_output import GrammarBackend, GrammarBackendHolder
from .validation import check_fits, max_prompt_chars, prompt_token_ids

if TYPE_CHECKING:
    from ..model.loader import LoadedModel
    from .lora import EngineAdapters

log = logging.getLogger(__name__)
T = TypeVar("T")


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: "LoadedModel | None" = None,
                 speculator: Speculator | None = None) -> None:
        """`speculator`: speculative decoding's drafts (`spec_decode/speculator.py` around a
        proposer, `proposer.py`); None = the one `config.speculative_config` names, if any,
        else one token a step."""
        from .model_runner import ModelRunner

        self.task = resolve_task(config.task, config.model)
        if self.task == "embed" and config.world_size > 1:
            raise ValueError("--task embed: embedding models run on one device (--tensor-parallel-size 1, "
                             "--pipeline-parallel-size 1)")
        if self.task == "embed" and (config.speculative_config is not None or config.enable_lora):
            raise ValueError("--task embed: speculative decoding and LoRA adapters apply to text generation only")
        if loaded is None and config.world_size > 1:  # TP / PP hook: shards + worker processes
            from ..parallel.launch import load_tensor_parallel

            loaded = load_tensor_parallel(config)
        if loaded is None:
            from ..model.loader import load_model

            loaded = load_model(config.model, config.dtype, config.device, config.quantization,
                                embed=self.task == "embed", quantize_head=config.quantize_lm_head)
        self.config = config
        self.loaded = loaded
        self.tokenizer = self.loaded.tokenizer
        self.model_config = self.loaded.config
        self.generation_defaults = dict(self.loaded.generation_defaults)
        self.served_model_name = config.served_model_name or self.loaded.name
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | self.model_config.eos_token_ids
        self.prompt_logprobs = PromptLogprobs()
        self.adapters = self._adapters(config) if config.enable_lora else None
        self.runner = ModelRunner(self.loaded, config, prompt_logprobs=self.prompt_logprobs, adapters=self.adapters)
        # every layer windowed (Mistral, Phi-3): blocks that left the window go back while a sequence
        # runs; Gemma's interleaved global layers read the whole context, so theirs stay
        window = self.model_config.sliding_window if not self.model_config.layer_types else None
        self.max_model_len = self._max_model_len(config, self.runner.num_blocks, window)
        longest_token = max(map(len, self.tokenizer.backend.get_vocab()), default=1)
        self.max_prompt_chars = max_prompt_chars(self.max_model_len, longest_token)
        # embeddings (`pooler.py`): pooled hidden states instead of sampled tokens
        self.pooler = Pooler(read_pooler_config(config.model)) if self.task == "embed" else None
        prefix_caching = config.enable_prefix_caching and (self.pooler is None or self.pooler.config.reuses_prefix_cache)
        if self.pooler is not None:
            log.info("embedding model: %s pooling%s (%s)%s", self.pooler.config.pooling_type,
                     ", normalized" if self.pooler.config.normalize else "", self.pooler.config.source,
                     "" if prefix_caching == config.enable_prefix_caching else "; prefix caching off (needs last-token pooling)")
        if config.kv_events_config is not None and config.kv_events_config.enabled and not prefix_caching:
            raise ValueError("--kv-events-config: KV-cache events describe the prefix cache; "
                             "enable prefix caching (and use a generate model with it)")
        publisher = open_kv_event_publisher(config.kv_events_config, config.block_size)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, prefix_caching, window, publisher,
                                 hash_key=config.kv_hash_key)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   build_policy(config.scheduling_policy, config.priority_aging_seconds),
                                   admit=self.adapters.admit if self.adapters is not None else None)
        self.sampler = Sampler(config.seed, self.loaded.device)
        if speculator is None and config.speculative_config is not None:
            speculator = build_speculator(config.speculative_config, SpeculationTarget(
                self.loaded, self.runner, self.sampler, config, self.max_model_len))
        self.speculator = speculator
        self.requests: dict[str, Request] = {}
        self._grammars = GrammarBackendHolder(self.tokenizer, self.model_config.vocab_size,
                                              sorted(self.eos_token_ids))
        self.counters = EngineStats(num_blocks_total=self.runner.num_blocks)
        if self.task == "generate":
            self.runner.capture_decode_graphs(config, self.max_model_len)

    def _adapters(self, config: EngineConfig) -> "EngineAdapters":
        """LoRA slots in the model, for the scheduler (admission) and the runner (token slots)."""
        from .lora import EngineAdapters

        return EngineAdapters(self.loaded.model, config, self.loaded.dtype, self.loaded.device)

    def _max_model_len(self, config: EngineConfig, num_blocks: int, window: int | None) -> int:
        model_max = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({model_max})")
        wanted = config.max_model_len or model_max
        capacity = num_blocks * config.block_size
        # with blocks given back behind the window, a sequence alone holds at most its window,
        # one step's chunk and a block either side (KVCacheManager._release_out_of_window)
        if window is not None and capacity >= window + config.max_num_batched_tokens + 3 * config.block_size:
            return wanted
        if wanted > capacity:  # a longer request could never fit, even alone
            log.warning("max_model_len lowered from %d to %d tokens: the KV cache holds no more",
                        wanted, capacity)
        return min(wanted, capacity)

    # -- requests ---------------------------------------------------------------------------

    @property
    def grammars(self) -> GrammarBackend:
        """Compiles structured-output grammars (built on first use; thread-safe)."""
        return self._grammars.get()

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     prompt_param: str = "prompt", add_special_tokens: bool = True,
                     adapter: str | None = None) -> Request:
        """Validate and tokenize; raises InvalidRequestError with a client-facing message whose
        `param` names the field at fault (`prompt_param` for the prompt). Thread-safe: the
        server calls it off the event loop while the engine thread steps. `adapter`: the LoRA
        adapter to run it with (None: the base model)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use.")
        if self.pooler is not None:
            raise InvalidRequestError("This model serves embeddings (--task embed): it does not generate text.")
        if adapter is not None and (self.adapters is None or not self.adapters.known(adapter)):
            raise InvalidRequestError(f"The model `{adapter}` does not exist.", param="model", code="model_not_found")
        explicit = params.explicit_fields
        params = params.with_defaults(self.generation_defaults)
        params.validate()
        vocab_size = self.model_config.vocab_size
        prompt_ids = prompt_token_ids(prompt, self.tokenizer, vocab_size, self.max_model_len,
                                      self.max_prompt_chars, prompt_param, add_special_tokens)
        room = self.max_model_len - len(prompt_ids)
        if "max_tokens" not in explicit and params.max_tokens is not None and room > 0:
            params.max_tokens = min(params.max_tokens, room)  # a default never overflows
        check_fits(len(prompt_ids), params, self.max_model_len, vocab_size, prompt_param)
        factories = []
        if params.structured_outputs is not None:  # a cache hit when the server compiled it first
            grammar = self.grammars.compile(params.structured_outputs)
            is_json = params.structured_outputs.json is not None or params.structured_outputs.json_object
            factories.append(self.grammars.processor_factory(grammar, is_json))
        request = Request(request_id, prompt_ids, params, self.eos_token_ids, self.max_model_len,
                          processor_factories=factories, adapter=adapter)
        for seq in request.seqs:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens,
                params.include_stop_str_in_output)
        return request

    def make_pooling_request(self, request_id: str, prompt: str | list[int], dimensions: int | None = None,
                             prompt_param: str = "input", add_special_tokens: bool = True,
                             priority: int = 0) -> Request:
        """An embedding request: validated and tokenized like `make_request` (thread-safe); the
        whole prompt must fit the context (nothing is generated after it)."""
        if self.pooler is None:
            raise InvalidRequestError("This model does not support embeddings: it serves text generation "
                                      "(start it with --task embed to serve an embedding model).")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use.")
        error = self.pooler.config.check_dimensions(dimensions, self.model_config.hidden_size, self.served_model_name)
        if error is not None:
            raise InvalidRequestError(error, param="dimensions")
        prompt_ids = prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                      self.max_prompt_chars, prompt_param, add_special_tokens)
        if len(prompt_ids) > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt_ids)} tokens in the input for embedding generation. Please reduce the length "
                "of the input.", param=prompt_param, code="context_length_exceeded")
        return Request(request_id, prompt_ids, SamplingParams(max_tokens=None, priority=priority),
                       self.eos_token_ids, self.max_model_len, pooling=PoolingTask(dimensions))

    def add_request(self, request_id: str, prompt: str | list[int] | Request,
                    params: SamplingParams | None = None) -> Request:
        request = prompt if isinstance(prompt, Request) else self.make_request(
            request_id, prompt, params or SamplingParams())
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (None if unknown)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        request.aborted = True
        for seq in request.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                seq.finish_reason = "abort"
                self._retire(seq)
        request.metrics.finished_time = time.monotonic()
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.monotonic()
        if self.speculator is not None:
            self.speculator.draft(self.scheduler.running)
        out = self.scheduler.schedule()
        touched: dict[str, Request] = {}
        if self.adapters is not None:   # adapters that would not load for a waiting request
            self._fail_adapter_requests(self.adapters.failures, touched)
            self.adapters.failures = []
        if out.is_empty:
            return [self._failed_output(request) for request in touched.values()]
        if self.pooler is not None:
            return self._pooling_step(out, start)
        try:
            logits, seqs = self.runner.run(out)
        except BaseException:
            self.kv.drop_cache()   # it holds this step's blocks, never computed
            raise
        if self.prompt_logprobs.failures:   # scoring a prompt raised: those requests fail, no others
            self._fail_adapter_requests(self.prompt_logprobs.failures, touched)
            self.prompt_logprobs.failures = []
        if self.adapters is not None:   # an adapter whose delta raised: its requests fail, no others
            failed = self.adapters.failed_requests(out.scheduled)
            if failed:
                self.kv.drop_cache()   # blocks cached at scheduling hold K/V of a failed delta
                self._fail_adapter_requests(failed, touched)
        sampled = self.sampler(logits, seqs) if logits is not None else None
        self.scheduler.update(out)
        if sampled is not None and out.num_drafts:
            self._append_verified(seqs, sampled, touched)
        elif sampled is not None:
            now = time.monotonic()
            for row, (seq, token, logprobs) in enumerate(zip(seqs, sampled.token_ids, sampled.logprobs)):
                request = seq.request
                touched[request.request_id] = request
                if request.error is None:
                    error = sampled.errors.get(row)
                    self._guarded(request, self._append_token, seq, token, logprobs, now, error=error)
        outputs = []
        for request in touched.values():
            if request.error is None and request.finished:
                request.metrics.finished_time = time.monotonic()
                self.requests.pop(request.request_id, None)
            output = self._guarded(request, self._output, request) if request.error is None else None
            outputs.append(output if output is not None else self._failed_output(request))
        self._count_step(out, start)
        return outputs

    def _count_step(self, out: SchedulerOutput, start: float) -> None:
        end = time.monotonic()
        c = self.counters
        c.num_steps += 1
        c.last_step_seconds, c.last_step_time = end - start, end
        c.last_step_tokens, c.last_step_seqs = out.num_tokens, len(out.scheduled)

    def _pooling_step(self, out: SchedulerOutput, start: float) -> list[RequestOutput]:
        """An embedding engine's step: the forward pass returns the hidden states the pooler
        needs; every request whose prompt is complete finishes with its embedding."""
        assert self.pooler is not None
        try:
            hidden = self.runner.run_hidden(out, self.pooler.rows(out))
        except BaseException:
            self.kv.drop_cache()   # it holds this step's blocks, never computed
            raise
        done = self.pooler.accept(out, hidden)
        self.scheduler.update(out)
        now = time.monotonic()
        outputs = []
        for seq in done:
            request = seq.request
            seq.finish_reason = "stop"
            self._retire(seq)
            self.counters.prompt_tokens += seq.num_prompt_tokens
            metrics = request.metrics
            metrics.first_token_time = metrics.last_token_time = metrics.finished_time = now
            self.requests.pop(request.request_id, None)
            outputs.append(self._output(request))
        self._count_step(out, start)
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprobs: tuple | None, now: float
                      ) -> None:
        request, params = seq.request, seq.params
        seq.token_ids.append(token)
        for processor in seq.logits_processors:
            processor.accept(token)
        self.counters.generation_tokens += 1
        if seq.num_output_tokens == 1 and seq.index == 0:
            self.counters.prompt_tokens += seq.num_prompt_tokens
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(to_logprob_dict(logprobs, token, self._decode_one))
        detok = seq.detokenizer
        assert detok is not None
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            seq.finish_reason = "stop"
            seq.stop_reason = token if token in params.stop_token_ids else None
            if params.include_stop_str_in_output:
                detok.add_token(token, check_stop=False)
        else:
            stop = detok.add_token(token, check_stop=seq.num_output_tokens >= params.min_tokens)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
        if seq.finish_reason is None and (
                seq.num_tokens >= request.max_total_tokens):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self._retire(seq)

    # -- per-request fault isolation ----------------------------------------------------------

    def _guarded(self, request: Request, work: Callable[..., T], *args: Any,
                 error: Exception | None = None) -> T | None:
        """Run one request's share of the step; if it raises (or `error` is already known),
        that request alone fails and the step goes on for the others."""
        if error is None:
            try:
                return work(*args)
            except Exception as raised:  # noqa: BLE001 - pinned to this request
                error = raised
        self._fail(request, error)
        return None

    def _fail(self, request: Request, error: Exception) -> None:
        if isinstance(error, InvalidRequestError):   # e.g. a constraint its vocabulary cannot finish
            log.info("request %s refused while generating: %s", request.request_id, error)
            request.error, request.client_error = str(error), True
        else:
            log.error("request %s failed; the engine goes on", request.request_id, exc_info=error)
            request.error = f"the server failed while generating this request ({type(error).__name__})"
        self.requests.pop(request.request_id, None)
        for seq in request.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                seq.finish_reason = "error"
                self._retire(seq)
        request.metrics.finished_time = time.monotonic()

    def _fail_adapter_requests(self, failed: list[tuple[Request, Exception]], touched: dict[str, Request]) -> None:
        for request, error in failed:
            if request.error is None and request.request_id in self.requests:
                self._fail(request, error)
                touched[request.request_id] = request

    def _failed_output(self, request: Request) -> RequestOutput:
        """The last output of a failed request: what was already sent, no new text."""
        completions = [CompletionOutput(
            index=seq.index, text=seq.detokenizer.sent_text if seq.detokenizer else "",
            token_ids=seq.output_token_ids[:seq.num_sent_tokens], delta_text="", delta_token_ids=[],
            logprobs=None, finish_reason="error", stop_reason=None) for seq in request.seqs]
        return RequestOutput(request.request_id, request.prompt_token_ids, request.num_cached_tokens,
                             completions, True, request.metrics, error=request.error,
                             client_error=request.client_error)

    # -- speculative decoding (with a proposer) ------------------------------------------------

    @property
    def proposer(self) -> Proposer | None:
        return self.speculator.proposer if self.speculator is not None else None

    def _append_verified(self, rows: list[SamplingRow], sampled: SamplerOutput, touched: dict[str, Request]
                         ) -> None:
        """A speculative step's tokens: per sequence, the drafts up to the first one its sampled
        token disagrees with, then that sampled token (1 + accepted drafts tokens)."""
        now = time.monotonic()
        start = 0
        while start < len(rows):
            seq = rows[start]
            assert isinstance(seq, Sequence)
            drafts = seq.draft_token_ids
            end = start + 1
            while end < len(rows) and isinstance(rows[end], DraftPosition):
                end += 1
            tokens = sampled.token_ids[start:end]
            accepted = 0
            while accepted < len(tokens) - 1 and tokens[accepted] == drafts[accepted]:
                accepted += 1
            assert self.speculator is not None
            self.speculator.verified(seq, len(tokens) - 1, accepted)
            request = seq.request
            request.metrics.draft_tokens += len(tokens) - 1
            request.metrics.accepted_draft_tokens += accepted
            touched[request.request_id] = request
            if request.error is None:
                error = next((sampled.errors[row] for row in range(start, end) if row in sampled.errors), None)
                self._guarded(request, self._append_tokens, seq, tokens[:accepted + 1],
                              sampled.logprobs[start:start + accepted + 1], now, error=error)
            seq.draft_token_ids, seq.draft_probs = [], None
            start = end

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list, now: float) -> None:
        """Append verified tokens (accepted drafts, then the sampled one) until one finishes the
        sequence; a sequence still running keeps the drafts' K/V and gives back the rest."""
        for token, entry in zip(tokens, logprobs):
            self._append_token(seq, token, entry, now)
            if seq.finish_reason is not None:
                return
        self.scheduler.accept_drafts(seq, len(tokens) - 1)

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.sampler.forget(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        for processor in seq.logits_processors:
            processor.release()
        seq.logits_processors = []

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _output(self, request: Request) -> RequestOutput:
        if request.pooling is not None:
            return RequestOutput(request.request_id, request.prompt_token_ids, request.num_cached_tokens, [],
                                 request.finished, request.metrics, embedding=request.pooling.embedding)
        completions = []
        for seq in request.seqs:
            finished = seq.status is SequenceStatus.FINISHED
            assert seq.detokenizer is not None
            delta_text = seq.detokenizer.take_delta(finished)
            output_ids = seq.output_token_ids
            completions.append(CompletionOutput(
                index=seq.index, text=seq.detokenizer.sent_text, token_ids=output_ids,
                delta_text=delta_text, delta_token_ids=output_ids[seq.num_sent_tokens:],
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
            seq.num_sent_tokens = len(output_ids)
        return RequestOutput(request.request_id, request.prompt_token_ids,
                             request.num_cached_tokens, completions, request.finished,
                             request.metrics, prompt_logprobs=self._prompt_logprobs(request))

    def _prompt_logprobs(self, request: Request) -> list[dict[int, Logprob] | None] | None:
        """The request's prompt logprobs as vLLM returns them, decoded once all are in."""
        if request.prompt_logprobs is None or request.owes_prompt_logprobs:
            return None
        if request.decoded_prompt_logprobs is None:
            ids = request.prompt_token_ids
            request.decoded_prompt_logprobs = [None] + [
                to_logprob_dict(entry, ids[position], self._decode_one)
                for position, entry in enumerate(request.prompt_logprobs[1:], start=1) if entry is not None]
        return request.decoded_prompt_logprobs

    def stats(self) -> EngineStats:
        c, kv = self.counters, self.kv
        evictable = kv.num_evictable_blocks
        running, waiting = self.adapters.running_and_waiting(self.scheduler) if self.adapters is not None else ((), ())
        return EngineStats(
            max_lora=self.adapters.max_loras if self.adapters is not None else 0,
            running_lora_adapters=tuple(running), waiting_lora_adapters=tuple(waiting),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + sum(
                1 for r in self.requests.values()
                for s in r.seqs if s.status is SequenceStatus.FORK_PENDING),
            kv_cache_usage=(kv.pool.num_blocks - kv.pool.num_free - evictable) / kv.pool.num_blocks,
            num_blocks_total=kv.pool.num_blocks, num_blocks_free=kv.pool.num_free,
            num_blocks_evictable=evictable,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            recent_prefix_cache_hits=kv.recent_prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=c.prompt_tokens, generation_tokens=c.generation_tokens,
            num_steps=c.num_steps, last_step_seconds=c.last_step_seconds,
            last_step_tokens=c.last_step_tokens, last_step_seqs=c.last_step_seqs,
            last_step_time=c.last_step_time,
            spec_decode=self.speculator.stats.copy() if self.speculator is not None else None)
