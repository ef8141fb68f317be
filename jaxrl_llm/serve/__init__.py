"""An OpenAI-compatible endpoint that turns unmodified agent harnesses into training data (issue 34, part 1).

  batcher.py          concurrent calls sampled together at one pinned version (the run's sampler, no new decode loop)
  chat.py             chat messages -> prompt ids (an episode's earlier ids reused, never re-encoded); tool calls
  recorder.py         every call under its episode id; a finished episode -> one learner row
  app.py              the FastAPI routes (/v1/chat/completions, /v1/completions, /inference/v1/generate, rewards),
                      OpenAI-style errors, and the in-process uvicorn server
  service.py          the three started / stopped together by a run
  example_harness.py  a scripted harness written with the official `openai` client (configs/harness_tiny.py)
  verifiers_env.py    verifiers (0.4, v1) environments as a harness: their tasksets, rewards and MCP tools

The batch source is `rollout/sources/harness.py` (`rollout.mode="harness"`). FastAPI, uvicorn and openai come with
the `serve` extra; importing this package's text-only modules (chat, recorder) needs none of them.
"""
