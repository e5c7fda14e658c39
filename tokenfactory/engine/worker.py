"""An engine driven by the client's messages, with what it makes returned as data: the core of every host.

`EngineWorker` applies `AddRequest`/`AbortRequest`/`SetTenantWeight`/`ChargeEnergy` to an `LLMEngine` and
steps it; a request that cannot be added fails alone. `AsyncEngine` (in process) delivers its results to
event-loop streams; `serve_worker` is the loop of a replica in another process or a Ray actor
(fleet/process.py, fleet/ray_replica.py): messages in through `recv`, one `WorkerEvents` batch out through
`emit` after each step that made an output or ended a request, and at least every `BATCH_INTERVAL_S` while busy
(outputs, failures, the steps' `StepStats` for the gateway's meter, a snapshot), and a heartbeat batch while idle,
so the other side can tell a hung worker from an idle one. Steps and the snapshot ride along only when due: with
every batch that ends a request (the meter hears a request's steps before its end), every `BATCH_INTERVAL_S`, and
when the engine goes idle: pickled into every step's batch they cost the engine's thread 60 us a step (the
outputs alone take 7) and the gateway's receiver ~0.07 ms of CPU a token at one client (docs/benchmarks.md).

The engine must be built on the thread that calls `serve_worker` (AsyncEngine.launch says why).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from tokenfactory.engine.client import (
    AbortRequest,
    AddRequest,
    ChargeEnergy,
    EngineFacts,
    Message,
    RequestFailed,
    SetTenantWeight,
    Shutdown,
    WorkerEvents,
    WorkerReady,
)
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.types import ParameterError, RequestOutput, StepStats

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # an idle worker's batch interval: the other side's hang detection counts on it
BATCH_INTERVAL_S = 0.05  # a busy worker's steps and snapshot go out at least this often (AsyncEngine's interval)


class EngineWorker:
    """One engine and its message handling (see the module's docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.num_added = 0

    def apply(self, msg: Message) -> RequestFailed | None:
        """Apply one message; returns the failure of a request that could not be added."""
        engine = self.engine
        if isinstance(msg, AbortRequest):
            engine.abort_request(msg.request_id)
        elif isinstance(msg, SetTenantWeight):
            engine.set_tenant_weight(msg.tenant, msg.weight)
        elif isinstance(msg, ChargeEnergy):
            engine.charge_energy(dict(msg.request_id_to_joules))
        elif isinstance(msg, AddRequest):
            return self.add(msg)
        return None

    def add(self, msg: AddRequest) -> RequestFailed | None:
        self.num_added += 1
        try:
            self.engine.add_request({"prompt_token_ids": msg.prompt_token_ids}, msg.params, msg.request_id,
                                    arrival_time=msg.arrival_time, tenant=msg.tenant, priority=msg.priority,
                                    prompt_text=msg.prompt)
        except ParameterError as e:
            return RequestFailed(msg.request_id, str(e), param=e.param)
        except ValueError as e:
            return RequestFailed(msg.request_id, str(e))
        except Exception as e:  # noqa: BLE001 - a request that cannot be added fails alone
            logger.exception("request %s could not be added", msg.request_id)
            self.engine.abort_request(msg.request_id)
            return RequestFailed(msg.request_id, f"the engine could not take this request: {type(e).__name__}: {e}")
        return None

    def step(self) -> tuple[list[RequestOutput], list[RequestFailed]]:
        """One engine step: the outputs it made, and the requests it failed alone."""
        outputs: list[RequestOutput] = []
        failures: list[RequestFailed] = []
        for out in self.engine.step():
            if out.error is not None:
                failures.append(RequestFailed(out.request_id, out.error, param=out.error_param))
            else:
                outputs.append(out)
        return outputs, failures


def engine_facts(engine: LLMEngine) -> EngineFacts:
    """What a built engine holds (every host reports it the same way)."""
    cap = engine.capacity
    return EngineFacts(engine.model_path, str(engine.device), str(engine.dtype).removeprefix("torch."),
                       weight_bytes=engine.weight_bytes, kv_bytes=cap.total_bytes, kv_blocks=cap.num_blocks,
                       kv_tokens=cap.num_tokens, max_model_len=cap.max_model_len,
                       max_concurrent_seqs=cap.max_concurrent_seqs)


def worker_ready(engine: LLMEngine) -> WorkerReady:
    """A replica host's first message: the engine is built and warmed up."""
    return WorkerReady(engine.info, engine.tokenizer, engine.stats(), engine_facts(engine))


def compact_output(out: RequestOutput, first: bool) -> RequestOutput:
    """What crosses the process boundary: the deltas, not the whole state again every step (a step of 32
    sequences at 130 + 128 tokens pickles 38 kB whole; the lists grow with every token). The prompt goes with
    a request's first output, the full text with its last (text held back for a stop string is in neither
    delta), prompt logprobs with the first too (they are complete by then); the receiver rebuilds the rest from the
    deltas (fleet/remote.py)."""
    outputs = [dataclasses.replace(c, text=c.text if c.finished else "", token_ids=[], logprobs=None)
               for c in out.outputs]
    return dataclasses.replace(out, outputs=outputs, prompt=out.prompt if first else None,
                               prompt_token_ids=out.prompt_token_ids if first else [],
                               prompt_logprobs=out.prompt_logprobs if first else None)


def serve_worker(engine: LLMEngine, recv: Callable[[float | None], list[Message]],
                 emit: Callable[[WorkerEvents], None]) -> None:
    """Step `engine` until a `Shutdown` arrives (or the engine breaks: the last batch says why).
    `recv(timeout)` returns the messages that arrived (waiting up to `timeout` s for one; 0: none waited for)."""
    worker = EngineWorker(engine)
    sent: set[str] = set()  # requests whose first output went out
    steps: list[StepStats] = []
    engine.step_listeners.append(steps.append)
    last_full = time.monotonic()  # when steps and a snapshot last went out (WorkerReady carried the first)
    try:
        while True:
            busy = engine.has_unfinished_requests
            failures: list[RequestFailed] = []
            aborted: list[str] = []
            for msg in recv(0.0 if busy else HEARTBEAT_S):
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, AbortRequest):
                    sent.discard(msg.request_id)
                    aborted.append(msg.request_id)
                if (failure := worker.apply(msg)) is not None:
                    failures.append(failure)
            outputs: list[RequestOutput] = []
            if engine.has_unfinished_requests:
                outputs, failed = worker.step()
                failures += failed
            compact = []
            ended = bool(failures or aborted)
            for out in outputs:
                compact.append(compact_output(out, out.request_id not in sent))
                if out.finished:
                    sent.discard(out.request_id)
                    ended = True
                else:
                    sent.add(out.request_id)
            for failure in failures:
                sent.discard(failure.request_id)
            now = time.monotonic()
            full = ended or not engine.has_unfinished_requests or now - last_full >= BATCH_INTERVAL_S
            if full:
                emit(WorkerEvents(tuple(compact), tuple(failures), tuple(steps), engine.stats(),
                                  aborted=tuple(aborted)))
                steps.clear()
                last_full = now
            elif compact:
                emit(WorkerEvents(tuple(compact)))
    except Exception as e:  # the engine itself is broken: say so once, then stop
        logger.exception("engine worker crashed")
        emit(WorkerEvents(dead_reason=f"the engine stopped: {type(e).__name__}: {e}"))
