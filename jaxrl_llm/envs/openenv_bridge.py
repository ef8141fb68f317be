"""Any jaxrl_llm text environment served as an OpenEnv environment (the other direction of `envs.openenv_env`).

Imports openenv (the `openenv` extra) at import time, so `jaxrl_llm.envs` does not import it. It is what
`configs/agent_openenv_tiny.py` plays through the adapter, in-process:

  env.name = "openenv"; env.kwargs.environment = "jaxrl_llm.envs.openenv_bridge:guess_number"

or as a server over HTTP (OpenEnv's own FastAPI app; one WebSocket session per episode):

  python -m uvicorn --factory jaxrl_llm.envs.openenv_bridge:guess_number_app --port 8000
  ... --config.env.kwargs.environment= --config.env.kwargs.base_url=http://127.0.0.1:8000
      --config.env.kwargs.action_field=text

The action is `TextAction(text=...)`; the observation `TextObservation(text=...)` carries the environment's message
(message lists are joined by newlines: an OpenEnv observation is one text here). An `InvalidAction` of the wrapped
environment ends its episode with reward 0 and `metadata={"invalid": ...}`: OpenEnv has no invalid-action signal,
so the adapter on the other side sees an ordinary end (a round trip through both counts it as done, not invalid).
"""

from __future__ import annotations

from openenv.core.env_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from jaxrl_llm import envs


class TextAction(Action):
  text: str


class TextObservation(Observation):
  text: str = ""


def _text(message) -> str:
  if isinstance(message, str):
    return message
  return "\n".join(m.get("content", "") for m in message)


class TextEnvironment(Environment[TextAction, TextObservation, State]):
  """The registered environment `name` (built with `kwargs`) behind OpenEnv's reset / step / state."""

  SUPPORTS_CONCURRENT_SESSIONS = True  # one wrapped instance per OpenEnv session; they share nothing

  def __init__(self, name: str = "guess_number", **kwargs):
    super().__init__()
    self.env = envs.get(name, **kwargs)
    self._state = State(step_count=0)

  def reset(self, seed=None, episode_id=None, **kwargs) -> TextObservation:
    self._state = State(episode_id=episode_id, step_count=0)
    return TextObservation(text=_text(self.env.reset(int(seed or 0))), done=False, reward=0.0)

  def step(self, action: TextAction, timeout_s=None, **kwargs) -> TextObservation:
    self._state.step_count += 1
    try:
      obs, reward, done = self.env.step(action.text)[:3]
    except envs.InvalidAction as e:
      return TextObservation(text="", done=True, reward=0.0, metadata={"invalid": str(e)})
    return TextObservation(text=_text(obs), done=bool(done), reward=float(reward))

  @property
  def state(self) -> State:
    return self._state

  def close(self) -> None:
    close = getattr(self.env, "close", None)
    if close is not None:
      close()


def guess_number() -> TextEnvironment:
  """`envs.guess_number` (4 turns) as an OpenEnv environment."""
  return TextEnvironment("guess_number", max_turns=4)


def guess_number_app(max_concurrent_envs: int = 64):
  """OpenEnv's FastAPI app serving `guess_number` (`uvicorn --factory`)."""
  return create_fastapi_app(guess_number, TextAction, TextObservation, max_concurrent_envs=max_concurrent_envs)
