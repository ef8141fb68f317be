"""TRL's `GRPOTrainer` on workload R (what most PyTorch researchers would otherwise pick).

Runs ONLY under `bench/.venv-bench` (CPU torch, `transformers.generate`), as a subprocess of
`bench/run.py`, taking turns with our side (`bench/peers/turns.py`). Same workload as
`bench/grpo_real.py`: the HF folder (fp32), `arithmetic_chat` prompts (same seed and order: the
dataset is not shuffled) as conversational prompts (TRL renders the chat template), `num_generations`
= G, `max_completion_length` = N, temperature 1 (no top-k / top-p), β = 0.04 (TRL's k3 KL to a frozen
reference), one iteration per batch, `loss_type="grpo"` (sequence-mean of token-means, as ours),
rewards scaled by the group std, AdamW (β₂ 0.98, no weight decay) with max_grad_norm 1.0; TRL's default
gradient checkpointing (on), as ours' remat "full".

Timing: wall time between the ends of consecutive optimizer steps (`on_step_end`); one step =
generate, reward, reference log-probs, one update.

Usage: bench/.venv-bench/bin/python bench/peers/trl_grpo.py --workload R_small --model DIR [--warmup 1 --steps 1 --rounds 2]
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.peers import turns  # noqa: E402


def run(workload: str, model_dir: str, warmup: int, steps: int, rounds: int) -> dict:
  import datasets
  import numpy as np
  import torch
  import transformers
  import trl
  from bench import workloads
  from jaxrl_llm.tasks import arithmetic

  threads = turns.pick_torch_threads()
  r = {**workloads.REAL_RUN, **workloads.REAL[workload]}
  G, N, n_prompts = r["group_size"], r["max_new_tokens"], r["prompts_per_step"]
  task = arithmetic.make_chat_task(num_digits=r["num_digits"])
  clock = turns.StepClock(warmup, steps, rounds)
  rng = np.random.default_rng(r["seed"])
  exs = [task.make_example(rng) for _ in range(clock.total * n_prompts)]
  data = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": e["prompt"]}], "question": e["prompt"],
                                      "answer": e["answer"]} for e in exs])
  lens, rewards_all = [], []

  def reward(prompts, completions, question, answer, completion_ids=None, **kwargs):
    del prompts, kwargs
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    out = [task.reward(q, a, t) for q, a, t in zip(question, answer, texts)]
    if completion_ids is not None:
      lens.extend(len(ids) for ids in completion_ids)
    rewards_all.extend(out)
    return out

  class Clock(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
      clock.end_of_step()

  out_dir = tempfile.mkdtemp(prefix="trl_grpo_")
  args = trl.GRPOConfig(
      output_dir=out_dir, per_device_train_batch_size=n_prompts * G, gradient_accumulation_steps=1,
      num_generations=G, max_completion_length=N, temperature=r["temperature"], top_p=1.0, top_k=0,
      beta=r["beta"], num_iterations=1, epsilon=r["epsilon"], loss_type="grpo", learning_rate=r["lr"],
      lr_scheduler_type="constant", adam_beta1=0.9, adam_beta2=0.98, weight_decay=0.0, max_grad_norm=1.0,
      max_steps=clock.total, shuffle_dataset=False, seed=r["seed"], use_cpu=True, bf16=False, fp16=False,
      report_to="none", logging_steps=10 ** 6, save_strategy="no", disable_tqdm=True,
      dataloader_num_workers=0, model_init_kwargs={"dtype": torch.float32})
  trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=data,
                            callbacks=[Clock()])
  trainer.train()
  out = clock.summary()
  n_rollouts = len(rewards_all) // max(clock.total, 1)
  return {**out, "rollouts_per_step": n_rollouts, "completion_len_mean": float(np.mean(lens)) if lens else -1.0,
          "reward_mean": float(np.mean(rewards_all)), "trl_version": trl.__version__, "torch_version": torch.__version__,
          **threads}


def main() -> None:
  turns.peer_main(__doc__.splitlines()[0], "trl", ("trl",), run)


if __name__ == "__main__":
  main()
