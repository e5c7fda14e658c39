"""The naive baseline: a small FastAPI server around Hugging Face transformers' `generate`, one request at a
time, as such servers are commonly deployed. It is what `tokenfactory bench compare` measures us against.

    python -m tokenfactory.bench.hf_server --port 8001                  # the bundled SmolLM2 GGUF
    python -m tokenfactory.bench.hf_server --model path/to/x.gguf       # any GGUF transformers can read
    python -m tokenfactory.bench.hf_server --model path/to/hf-folder/

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming with
`stream_options.include_usage`, or not). The GGUF is loaded with `AutoModelForCausalLM.from_pretrained(
folder, gguf_file=name)` (dequantised to float32; needs `accelerate`). Requests wait on one lock: no
batching, no KV-cache reuse across requests, no continuous batching — deliberately.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

OWNED_BY = "hf-transformers-baseline"


@dataclass(frozen=True)
class HFServerConfig:
    model: str | None = None  # GGUF file or HF folder; None: the bundled GGUF
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8001
    dtype: str = "float32"
    threads: int | None = None  # torch intra-op threads; None: torch's default


@dataclass
class Generation:
    """One request, prepared: prompt ids and generate() arguments."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    ignore_eos: bool
    seed: int | None


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


class HFBaseline:
    """The model, its tokenizer, and the one lock every request waits on."""

    def __init__(self, config: HFServerConfig) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tokenfactory.models.loader import bundled_model_path, served_name

        if config.threads:
            torch.set_num_threads(config.threads)
        path = Path(config.model).expanduser() if config.model else bundled_model_path()
        folder, kwargs = (path, {}) if path.is_dir() else (path.parent, {"gguf_file": path.name})
        self.tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, config.dtype), **kwargs)
        self.model.eval()
        self.name = served_name(str(path), config.served_model_name)  # the same name our server gives it
        self.root = str(path)
        self.max_model_len = int(getattr(self.model.config, "max_position_embeddings", 2048))
        eos = self.model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        self.eos_token_ids = frozenset(int(i) for i in [*eos_ids, self.tokenizer.eos_token_id] if i is not None)
        self.lock = asyncio.Lock()
        self.torch = torch

    def prepare(self, body: dict[str, Any], chat: bool) -> Generation:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list", "messages")
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                ids = list(prompt)
            elif isinstance(prompt, str):
                ids = self.tokenizer(prompt).input_ids
            else:
                raise BadRequest("prompt must be a string or a list of token ids", "prompt")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or (16 if not chat else 256)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
        if len(ids) + max_tokens > self.max_model_len:
            raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                             f"window of {self.max_model_len}", "max_tokens")
        temperature = body.get("temperature")
        return Generation(ids, max_tokens, 1.0 if temperature is None else float(temperature),
                          float(body.get("top_p") or 1.0), bool(body.get("ignore_eos")), body.get("seed"))

    def generate(self, g: Generation, emit: Any) -> None:
        """Run generate() in this thread, calling emit(token_id) per new token and emit(None) at the end."""
        from transformers.generation.streamers import BaseStreamer

        class Streamer(BaseStreamer):
            def __init__(self) -> None:
                self.prompt_seen = False

            def put(self, value: Any) -> None:
                if not self.prompt_seen:  # generate() first hands over the prompt
                    self.prompt_seen = True
                    return
                for token in value.reshape(-1).tolist():
                    emit(int(token))

            def end(self) -> None:
                pass

        torch = self.torch
        if g.seed is not None:
            torch.manual_seed(int(g.seed))
        kwargs: dict[str, Any] = {"max_new_tokens": g.max_tokens, "streamer": Streamer(),
                                  "pad_token_id": self.tokenizer.pad_token_id or self.tokenizer.eos_token_id}
        if g.temperature > 0:
            kwargs |= {"do_sample": True, "temperature": g.temperature, "top_p": g.top_p}
        else:
            kwargs |= {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if g.ignore_eos:
            kwargs["min_new_tokens"] = g.max_tokens
        try:
            with torch.inference_mode():
                self.model.generate(torch.tensor([g.prompt_ids]), attention_mask=torch.ones(1, len(g.prompt_ids),
                                    dtype=torch.long), **kwargs)
        finally:
            emit(None)


class Detokenizer:
    """Text deltas from a growing list of token ids (a delta is held back while it ends mid-character)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


def build_app(baseline: HFBaseline) -> FastAPI:
    app = FastAPI(title="hf-transformers-baseline")

    def error(status: int, message: str, param: str | None = None) -> JSONResponse:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": baseline.name}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": baseline.name, "object": "model", "owned_by": OWNED_BY,
                                            "root": baseline.root, "max_model_len": baseline.max_model_len}]}

    async def handle(request: Request, chat: bool) -> Any:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return error(400, f"the request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        if body.get("model") not in (None, baseline.name):
            return error(404, f"the model {body.get('model')!r} does not exist; this server serves {baseline.name!r}",
                         "model")
        try:
            g = baseline.prepare(body, chat)
        except BadRequest as e:
            return error(e.status, e.message, e.param)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        stream = Responder(baseline, g, chat, include_usage)
        if body.get("stream"):
            return StreamingResponse(stream.events(), media_type="text/event-stream")
        return JSONResponse(await stream.whole())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


class Responder:
    """Runs one Generation under the lock and renders OpenAI chunks or a whole response."""

    def __init__(self, baseline: HFBaseline, g: Generation, chat: bool, include_usage: bool) -> None:
        self.baseline, self.g, self.chat, self.include_usage = baseline, g, chat, include_usage
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.num_generated = 0

    async def tokens(self) -> AsyncIterator[tuple[str, str | None]]:
        """(text delta, finish_reason) per generated token, as generate() produces it; the text is empty
        while a character is incomplete, and the finish_reason is set on the last token only."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        detok = Detokenizer(self.baseline.tokenizer)
        async with self.baseline.lock:  # one request at a time
            thread = threading.Thread(target=self.baseline.generate,
                                      args=(self.g, lambda t: loop.call_soon_threadsafe(queue.put_nowait, t)),
                                      daemon=True)
            thread.start()
            finished = False
            try:
                while (token := await queue.get()) is not None:
                    self.num_generated += 1
                    finish = None
                    if self.num_generated >= self.g.max_tokens:
                        finish = "length"
                    elif token in self.baseline.eos_token_ids and not self.g.ignore_eos:
                        finish = "stop"
                    finished = finished or finish is not None
                    yield detok.add(token), finish
            finally:  # a client that went away still holds the lock until generate() is done, as naive servers do
                await asyncio.to_thread(thread.join)
            if not finished:  # generate() stopped on its own (a stop criterion of the model's config)
                yield "", "stop"

    def usage(self) -> dict[str, Any]:
        prompt = len(self.g.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.num_generated,
                "total_tokens": prompt + self.num_generated}

    def chunk(self, text: str | None, finish: str | None) -> dict[str, Any]:
        if self.chat:
            delta = {"content": text} if text is not None else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.baseline.name,
                "choices": [choice]}

    async def events(self) -> AsyncIterator[str]:
        async for delta, finish in self.tokens():
            yield _sse(self.chunk(delta, finish))
        if self.include_usage:
            yield _sse({**self.chunk(None, None), "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"

    async def whole(self) -> dict[str, Any]:
        parts = [(delta, finish) async for delta, finish in self.tokens()]
        text = "".join(d for d, _ in parts)
        finish = next((f for _, f in parts if f), "stop")
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.baseline.name, "choices": [choice], "usage": self.usage()}


def _sse(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def parse_args(argv: list[str] | None = None) -> HFServerConfig:
    p = argparse.ArgumentParser(prog="python -m tokenfactory.bench.hf_server", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: bundled SmolLM2-135M)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    a = p.parse_args(argv)
    return HFServerConfig(a.model, a.served_model_name, a.host, a.port, a.dtype, a.threads)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    config = parse_args(argv)
    baseline = HFBaseline(config)
    print(f"hf baseline serving {baseline.name} from {baseline.root} on http://{config.host}:{config.port}/v1 "
          f"(one request at a time)", flush=True)
    uvicorn.run(build_app(baseline), host=config.host, port=config.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
