"""The endpoint as one object a run starts and stops: batcher thread + recorder + uvicorn on 127.0.0.1.

`Service.start(gen, store, settings)` samples with the run's `Generation` (its sampler model, settings and
encoder) from the newest snapshot of the ParamStore `store` (`async_engine.worker_params`), so a call always
sees the newest published version, pinned for that sampler call.
"""

from __future__ import annotations

import dataclasses

from jaxrl_llm.keys import fold_in
from jaxrl_llm.rollout.async_engine import worker_params
from jaxrl_llm.serve.app import Endpoint, Limits, Server, make_app
from jaxrl_llm.serve.batcher import Batcher, make_sample_fn
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
  def start(cls, gen, store, s, *, auto_open: bool = False, sample_fn=None) -> "Service":
    """Serves `gen`'s policy from `store` with `s` (`rollout.settings.ServeSettings`); `sample_fn` replaces the
    run's sampler (tests); `auto_open`: a call with a new episode id opens it (else the caller opens episodes)."""
    sample_fn = sample_fn or make_sample_fn(gen, s.max_context, s.max_tokens, s.max_batch)
    batcher = Batcher(sample_fn, store.acquire, store.release, worker_params, fold_in(gen.key_root, SERVE_KEY),
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
