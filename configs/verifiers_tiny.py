"""A verifiers environment trained through the endpoint: the tiny model plays `jaxrl_llm.envs.verifiers_sums`, a
verifiers (0.4, `verifiers.v1`) taskset of digit sums scored by its own async reward, with the in-process chat
harness (`jaxrl_llm.serve.verifiers_env`). Every model call reaches `/v1/chat/completions` through verifiers'
interception server; the recorder keeps the served tokens, so the learner trains them exactly as sampled.

A delta over configs/harness_tiny.py: the harness is `verifiers_env:run` with the taskset's id in
`serve.harness_kwargs`, and tiny.py's SFT warm start back on (its arithmetic prompts are the taskset's); any verifiers
taskset importable by module name runs the same way (`serve.harness_kwargs.taskset_args` sets its config fields,
`.harness` another in-process harness).

Needs verifiers: `pip install --no-deps verifiers==0.4.0` and `pip install -e '.[verifiers]'` (`make .venv/.test`
does both; jaxrl_llm/serve/verifiers_env.py says why --no-deps).

Run:  python -m jaxrl_llm --config=configs/verifiers_tiny.py --workdir=/tmp/verifiers_tiny
"""

import pathlib

import ml_collections

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("harness_tiny.py"))
  c.serve.harness = "jaxrl_llm.serve.verifiers_env:run"
  c.serve.harness_kwargs = ml_collections.ConfigDict({"taskset": "jaxrl_llm.envs.verifiers_sums"})
  c.serve.max_context = 96  # the chat-rendered "a+b=" prompt and one short reply
  c.serve.prompt_width = 80
  c.serve.max_tokens = 4
  c.sft.steps = 150  # tiny.py's warm start on the arithmetic task, whose raw "a+b=" prompts the taskset's are
  return c
