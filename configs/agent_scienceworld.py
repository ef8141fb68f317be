"""SmolLM2-135M-Instruct plays ScienceWorld's "boil" task (`jaxrl_llm.envs.scienceworld_env`; a benchmark of EPO).

Needs: the model (`make smollm2`), Java 8+ on PATH (measured with OpenJDK 17) and the `envs` extra
(`pip install -e '.[envs]'`, which brings scienceworld 1.2.3 and its jar).
Run:  python -m jaxrl_llm --config=configs/agent_scienceworld.py --workdir=runs/sciworld
      (add --config.loss.name=epo for EPO's per-turn entropy smoothing, as configs/epo_tiny.py)

A delta over configs/smollm2_grpo.py. An episode: the task description and the first room description, then up
to 30 turns of at most 24 policy tokens (one command, e.g. "open door to kitchen"; only its first line is read),
each answered by ScienceWorld (5-15 tokens for most actions, ~100-175 for a room description). Return: the final
score / 100 (1.0 solved, -1.0 failed, e.g. focusing on the wrong substance, partial credit in between); an
unreadable command is answered "No known action matches that input." and the episode goes on. Each seed picks one
of boil's 14 training variations (`env.kwargs.variations="dev" | "test"` for the held-out ones).

Sizes (SmolLM2 tokenizer): the first message is at most 309 tokens raw and 339 through the chat template over
all 30 variations of boil (melt 294 / 324; find-living-thing 305 / 335 over its 300), so `prompt_width=384` (a
longer first message ends that episode "too_long", counted; other tasks: measure). 30 turns of 24 tokens and short
answers fit `max_episode_tokens=2048`; long room descriptions end some episodes "truncated".

Chat template: observations are appended as user messages through SmolLM2's template (the template's delta after
the model's `<|im_end|>`; `--config.task.chat_template=none` gives raw prompts instead).

Memory and time: each episode row holds its own ScienceWorld JVM while it plays (~0.3-0.45 GB with the 512 MB heap
cap; the JVMs are pooled and reused across batches): 2 prompts x 8 rows = 16 JVMs, and up to 16 + reward.workers
(8) - 1 = 23 once a second batch starts (measured: B=4 rows, 4 workers -> 7 JVMs; `scienceworld_env` docstring),
so ~7-10 GB beside the model.
The first batch starts them (~2-5 s each, more when many start at once on few cores) and every reset loads the
task (~0.5-3 s), hence `env.timeout_s=60`. There is no evaluation (evaluation is single-turn, on `task`).
"""

import pathlib

import ml_collections

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("smollm2_grpo.py"))
  c.env = ml_collections.ConfigDict()
  c.env.name = "scienceworld"
  c.env.kwargs = ml_collections.ConfigDict({"task": "boil", "simplification": "easy", "variations": "train",
                                            "step_limit": 100, "reward_scale": 0.01, "observation": "obs"})
  c.env.max_turns = 30
  c.env.turn_tokens = 24  # one command and the stop id ("use thermometer in inventory on substance in metal pot": 11)
  c.env.max_episode_tokens = 2048  # policy + environment tokens of one episode
  c.env.timeout_s = 60.0  # per environment call: the first reset of a row starts its JVM
  c.env.prompt_width = 384  # boil's first message: <= 309 tokens raw, <= 339 through the chat template (docstring)
  c.env.newest_each_turn = True
  c.env.kv_cache = True
  c.rollout.prompts_per_step = 2
  c.rollout.group_size = 8  # 16 episodes (JVMs) a step
  # reward.workers (8): the threads that run environment calls; more start JVMs faster in the first batch but keep
  # more JVMs alive (module docstring); a step is ~10-20 ms, so 8 keep up.
  c.sampler.temperature = 1.0  # explore: the commands are free text
  c.sft.steps = 0
  c.eval.every = 0
  c.loss.name = "ppo_clip"  # as configs/agent_tiny.py
  return c
