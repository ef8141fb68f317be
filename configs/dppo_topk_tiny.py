"""DPPO with a top-K divergence (`dppo_topk`) on the tiny model: the sampler records μ's top-K.

Run:  python -m jaxrl_llm --config=configs/dppo_topk_tiny.py --workdir=/tmp/dppo_topk

A delta over configs/tiny.py: `sampler.behavior_topk` = K makes the sampler record μ's K most likely
ids and their log-probs at every response position (`jaxrl_llm.sampling.behavior`); the learner gathers
π_θ at those ids in its forward, and the loss measures TV (or KL, `loss.hparams.divergence=topk_kl`) over
the K ids + the sampled token + "other". Stable-RL reads vLLM's top-20 log-probs (K = 20, vLLM's limit);
the tiny vocabulary of 64 characters keeps that. Advantages are mean-only, as in the paper.
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("tiny.py"))
  c.loss.name = "dppo_topk"
  c.sampler.behavior_topk = 20
  c.advantage.std_normalize = False
  return c
