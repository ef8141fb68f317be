"""A tool-using agent from the real SmolLM2-135M-Instruct: GSM8K with a calculator tool, multi-turn GRPO (CPU-sized).

Prepare the model once:  make smollm2
Run:  python -m jaxrl_llm --config=configs/smollm2_agent.py --workdir=runs/smollm2_agent
Async (later turns generate from the newest parameters, each token's version recorded):
      python -m jaxrl_llm --config=configs/smollm2_agent.py --workdir=runs/smollm2_agent_async \
        --config.rollout.mode=async --config.rollout.lag=2

A delta over configs/smollm2_grpo.py. Each episode is `envs.gsm8k_calculator`: the first message is the
problem, rendered through SmolLM2's chat template with the calculator's schema in a Hermes-style system block
(its template does not render `tools`); each turn the model either calls the tool
(`<tool_call>{"name": "calculator", "arguments": {"expression": ...}}</tool_call>`, answered by a `tool`
message appended as the template's delta after the model's `<|im_end|>`) or answers, scored by the math checker.
The model's own tokens are trained exactly as sampled; the appended template and tool tokens get no loss.
Metrics per step include env_tool_calls / env_tool_malformed / env_tool_failed, env_turns_mean and the statuses.

Sizes: the first message is 263–328 tokens with the system block (the 50-problem sample shipped in
`jaxrl_llm/envs/data/`; `--config.env.kwargs.path=` takes a GSM8K JSONL, e.g. the full train file), so
`env.prompt_width=336`. Held-out success before and after RL: `python -m experiments.agent_real` (docs/RESULTS.md);
a 135M model rarely solves GSM8K problems or calls the tool unprompted, so this config shows the loop, not a result.
"""

import pathlib

import ml_collections

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("smollm2_grpo.py"))
  c.env = ml_collections.ConfigDict()
  c.env.name = "gsm8k_calculator"
  # heldout: the sample's last 10 problems are the held-out evaluation's only (training never draws them)
  c.env.kwargs = ml_collections.ConfigDict({"max_tool_calls": 4, "heldout": 10})
  c.env.max_turns = 4  # up to 3 tool calls and an answer
  c.env.turn_tokens = 96  # one tool call is ~30 tokens; an answer with its reasoning more
  c.env.max_episode_tokens = 512  # policy + tool tokens of the whole episode
  c.env.timeout_s = 10.0
  c.env.prompt_width = 336  # the longest first message of the shipped sample, rounded up to 16
  c.env.newest_each_turn = True
  c.env.kv_cache = True
  c.sampler.temperature = 0.7
  c.rollout.prompts_per_step = 2
  c.rollout.group_size = 4
  c.num_steps = 20
  c.eval.every = 20  # held-out success before RL and at the end (eval_episode_success; experiments/agent_real.py)
  c.eval.num_prompts = 10  # greedy episodes: each held-out problem once
  return c
