"""docs/config.md must be the current output of its generator (regenerate: see jaxrl_llm.config_doc.COMMAND), every
field of the shipped configs must have a meaning line, and a field a config may lack has its default in one place."""

import os
import pathlib
import re
import subprocess
import sys

import ml_collections
import pytest

from jaxrl_llm import config as config_lib
from jaxrl_llm import config_doc, model_fields

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "config.md"


@pytest.fixture(scope="module")
def shipped():
  return config_doc.shipped()


def _fields(configs) -> set[str]:
  return {k for c in configs.values() for k in config_doc.leaves(c)}


def _comments(sources) -> dict:
  return {f: dict(config_doc.field_comments(src)) for f, src in sources.items()}


def test_config_page_is_current():
  # Rendered by the generator in a process of its own: the page lists registered environments, tasks and losses,
  # and a test worker's registries also hold those other tests registered.
  assert PAGE.exists(), f"docs/config.md is missing; run `{config_doc.COMMAND}`"
  out = subprocess.run([sys.executable, "-m", "jaxrl_llm.config_doc"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-2000:]
  assert PAGE.read_text(encoding="utf-8") == out.stdout, f"docs/config.md is stale; run `{config_doc.COMMAND}`"


def test_every_shipped_field_has_a_meaning(shipped):
  configs, sources = shipped
  fields = _fields(configs)
  assert len(fields) > 150  # the union over every configs/*.py
  missing = config_doc.undocumented(fields, _comments(sources))
  assert not missing, (f"add a trailing `# comment` on the line that sets each of these in its home file "
                       f"(configs/default.py or config_doc.HOME): {missing}")


def test_an_undocumented_field_is_reported(shipped):
  """The check above can fail: a field set without a comment (here, in a config that is not its home) is listed."""
  configs, sources = shipped
  c = config_lib.load_file(config_doc.CONFIG_DIR / "tiny.py")
  c.sampler.brand_new = 3
  srcs = {**sources, "new.py": "def get_config():\n  c.sampler.brand_new = 3  # a comment outside its home\n"}
  assert config_doc.undocumented(_fields({**configs, "new.py": c}), _comments(srcs)) == ["sampler.brand_new"]
  page = config_doc.render_from({**configs, "new.py": c}, srcs, {}, {})
  # not in default.py: no default there, and the configs that set it are named
  assert "| `sampler.brand_new` | int | required in the section (set in `new.py`) |" in page


def test_field_comments_read_assignments_and_dict_literals():
  src = '''def get_config():
  c.a.b = 1  # the b
  # a block comment (not a field's meaning)
  c.a.d = 2
  c.e = ml_collections.ConfigDict({
      "f": 1,  # the f
      "g": {"h": 2},  # the g
  })
  c.task.kwargs = ml_collections.ConfigDict({"x": 1})  # opaque: one field
'''
  got = dict(config_doc.field_comments(src))
  assert got["a.b"] == "the b" and got["a.d"] == "" and got["e.f"] == "the f" and got["e.g"] == "the g"
  assert got["e.g.h"] == "the g" and got["task.kwargs"] == "opaque: one field" and "task.kwargs.x" not in got


def test_page_shows_the_codes_allowed_values_and_absent_defaults():
  text = PAGE.read_text(encoding="utf-8")
  row = lambda f: next(line for line in text.splitlines() if line.startswith(f"| `{f}` |"))
  for f, values in (("rollout.mode", config_lib.rollout_modes()), ("sampler.kv_cache", config_lib.KV_CACHES),
                    ("model.remat", model_fields.REMAT), ("rollout.old_logp", config_lib.OLD_LOGP)):
    assert all(f"`{v}`" in row(f) for v in values), f
  assert "| `env.evict` | str | `'none'` |" in text  # an optional section: its default when absent
  assert "`agent_tiny.py`" in row("env.name")


def test_absent_defaults_are_default_py_values():
  """One value per field: a field configs/default.py has runs with default.py's value when a config lacks it."""
  base = config_doc.leaves(config_lib.load_file(config_doc.CONFIG_DIR / "default.py"))
  for field, value in config_lib.ABSENT_DEFAULTS.items():
    if field in base:
      assert base[field][0] == value, (field, base[field][0], value)
    else:  # the optional sections only
      assert field.split(".")[0] in ("env", "distill"), field


def test_read_takes_the_config_value_else_the_absent_default():
  c = config_lib.load_file(config_doc.CONFIG_DIR / "tiny.py")
  c.sampler.kv_window = 9
  assert config_lib.read(c, "sampler.kv_window") == 9
  del c.sampler["kv_window"]
  assert config_lib.read(c, "sampler.kv_window") == 64
  assert config_lib.read(c, "env.evict") == "none"  # the whole section absent
  c.env = ml_collections.ConfigDict({"name": "guess_number"})
  assert config_lib.read(c, "env.name") == "guess_number" and config_lib.read(c, "env.keep_last_turns") == 1
  del c.sampler["max_new_tokens"]
  with pytest.raises(KeyError):  # no absent default: a required field
    config_lib.read(c, "sampler.max_new_tokens")


def test_no_config_field_default_is_read_outside_absent_defaults():
  """`x.get("field", default)` of a field with an absent default would be a second home for that default."""
  names = {k.rsplit(".", 1)[1] for k in config_lib.ABSENT_DEFAULTS}
  pat = re.compile(r"\.get\(\s*[\"'](\w+)[\"']\s*,")
  found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "jaxrl_llm").rglob("*.py"))
           for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
           if any(m.group(1) in names for m in pat.finditer(line))]
  assert not found, f"read these with config.read (defaults: config.ABSENT_DEFAULTS): {found}"
