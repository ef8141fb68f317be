"""The endpoint as one object a run starts and stops: batcher thread + recorder + uvicorn on 127.0.0.1.

`Service.start(gen, store, settings, sample_fn=, params_of=)` serves the run's `Generation` (its encoder, sampler
settings and key root) with `sample_fn` (`rollout.sources.harness.make_sample_fn`) from the newest snapshot of the
ParamStore `store` (`params_of(snapshot)`: `async_engine.worker_params`), so a call always sees the newest published
version, pinned for that sampler call. Both are passed in: `jaxrl_llm.serve` imports nothing of `jaxrl_llm.rollout`.
"""

from __future__ import annotations

import dataclasses

from typing import Callable

from jaxrl_llm.keys import fold_in
from jaxrl_llm.serve.app import Endpoint, Limits, Server, make_app
from jaxrl_llm.serve.batcher import Batcher, SampleFn
from jaxrl_llm.serve.recorder import Recorder

SERVE_KEY = 0x5E7E  # the serve stream of the run's sampling keys


@dataclasses.dataclass
class Service:
  """A running endpoint: `base_url` (http://127.0.0.1:port), its batcher, recorder and server."""
  endpoint: Endpoint
  server: Server

  @property
  def base_url(self) -> str:
    return self.server.base_url

  @property
  def batcher(self) -> Batcher:
    return self.endpoint.batcher

  @property
  def recorder(self) -> Recorder:
    return self.endpoint.recorder

  @classmethod
  def start(cls, gen, store, s, *, sample_fn: SampleFn, params_of: Callable = lambda snap: snap.params,
            auto_open: bool = False) -> "Service":
    """Serves `gen`'s policy from `store` with `s` (`rollout.settings.ServeSettings`) and `sample_fn`;
    `auto_open`: a call with a new episode id opens it (else the caller opens its episodes)."""
    batcher = Batcher(sample_fn, store.acquire, store.release, params_of, fold_in(gen.key_root, SERVE_KEY),
                      stop_ids=gen.encoder.tokenizer.stop_ids, max_batch=s.max_batch, window_s=s.batch_window_s)
    cfg = gen.sampler_cfg
    limits = Limits(model_name=s.model_name, max_context=s.max_context, max_tokens=s.max_tokens,
                    temperature=float(cfg.temperature), top_p=float(cfg.top_p), top_k=int(cfg.top_k),
                    vocab_size=int(gen.encoder.tokenizer.vocab_size))
    ep = Endpoint(gen.encoder, batcher.start(), Recorder(auto_open=auto_open), limits)
    try:
      server = Server(make_app(ep)).start()
    except BaseException:
      batcher.close()
      raise
    return cls(ep, server)

  def close(self) -> None:
    """Stops the HTTP server, then the batcher (queued requests fail); idempotent."""
    self.server.stop()
    self.batcher.close()
