"""Tiny agent on an OpenEnv environment: the tiny model plays guess-the-number through OpenEnv's API
(`jaxrl_llm.envs.openenv_env`), in-process, or over HTTP from a running OpenEnv server.

A delta over configs/agent_tiny.py. Needs the `openenv` extra (`pip install -e '.[openenv]'`). The environment is
`jaxrl_llm.envs.openenv_bridge:guess_number` (this project's guess_number behind OpenEnv's `Environment`); any
OpenEnv environment class plays the same way: name it in `env.kwargs.environment` ("package.module:EnvClass"), and
the action field the policy's text fills in `env.kwargs.action_field` when its Action has more than one text field.

Run (in-process):  python -m jaxrl_llm --config=configs/agent_openenv_tiny.py --workdir=/tmp/openenv_tiny
Over HTTP:         python -m uvicorn --factory jaxrl_llm.envs.openenv_bridge:guess_number_app --port 8000 &
                   python -m jaxrl_llm --config=configs/agent_openenv_tiny.py --workdir=/tmp/openenv_http \
                     --config.env.kwargs.environment= --config.env.kwargs.base_url=http://127.0.0.1:8000 \
                     --config.env.kwargs.action_field=text
"""

import pathlib

import ml_collections

from jaxrl_llm.config import load_file


def get_config():
  c = load_file(pathlib.Path(__file__).with_name("agent_tiny.py"))
  c.env.name = "openenv"
  c.env.kwargs = ml_collections.ConfigDict({
      "environment": "jaxrl_llm.envs.openenv_bridge:guess_number",  # in-process: "package.module:EnvClass"
      "base_url": "",  # or a running OpenEnv server (then environment="")
      "action_field": "",  # the Action field the policy's text fills ("" = its only required str field)
      "observation_field": "",  # the Observation field shown ("" = its only field, else "name: value" lines)
  })
  return c
