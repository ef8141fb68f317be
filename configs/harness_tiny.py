"""Tiny harness run: the tiny model served on 127.0.0.1 to a scripted agent written with the `openai` client
(`jaxrl_llm.serve.example_harness`: a tool-call turn with the `add` tool, then an answer turn; reward 1 when the
answer holds the sum). Every call is recorded under its episode; a rewarded episode is one learner row.

A delta over configs/tiny.py: rollout.mode="harness" (admission as async: lag ≤ rollout.lag), 2 groups of 4
episodes per step, no SFT warm start and no evaluation (the harness is the task).

Run:  python -m jaxrl_llm --config=configs/harness_tiny.py --workdir=/tmp/harness_tiny
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("tiny.py"))
  c.num_steps = 2
  c.rollout.mode = "harness"
  c.rollout.lag = 1  # η: every consumed episode was served by a version at most 1 behind the learner
  c.rollout.prompts_per_step = 2
  c.rollout.group_size = 4
  c.serve.harness = "jaxrl_llm.serve.example_harness:run"
  c.serve.concurrency = 8  # 2 groups of 4 episodes at once: their calls share sampler batches
  c.serve.max_batch = 8
  c.serve.timeout_s = 120.0
  # The tools block (Hermes text, one char per id) is 603 of the first prompt's ids. A learner row holds that prompt
  # in prompt_width and both replies plus the second turn's user message (about 40 ids) in the 64 after it.
  c.serve.max_context = 704
  c.serve.prompt_width = 640
  c.serve.max_tokens = 8
  c.sft.steps = 0
  c.eval.every = 0
  return c
