"""A verifiers v1 taskset written outside the package, as a user writes one (tests/test_verifiers_env.py): one task
"what is 3+4? use calc_add." with a `Toolset` (an MCP server verifiers runs as `python -m vf_tool_taskset`), reward 1
when the last reply is 7. `fail=True`: the reward raises (a failed episode)."""

import verifiers.v1 as vf


class CalcConfig(vf.ToolsetConfig):
  pass


class Calc(vf.Toolset[CalcConfig]):
  TOOL_PREFIX = "calc"

  @vf.tool
  async def add(self, a: int, b: int) -> str:
    """Add two integers."""
    return str(int(a) + int(b))


class ToolData(vf.TaskData):
  fail: bool = False


class ToolTask(vf.Task[ToolData]):

  @classmethod
  def toolsets(cls, config):
    return [Calc(CalcConfig())]

  @vf.reward(weight=1.0)
  async def correct(self, trace: vf.Trace) -> float:
    if self.data.fail:
      raise ValueError("this reward fails")
    return float((trace.last_reply or "").strip() == "7")


class ToolTasksetConfig(vf.TasksetConfig):
  fail: bool = False


class ToolTaskset(vf.Taskset[ToolTask, ToolTasksetConfig]):

  def load(self) -> list[ToolTask]:
    return [ToolTask(ToolData(prompt="what is 3+4? use calc_add.", fail=self.config.fail), self.config.task)]


__all__ = ["ToolTaskset"]

if __name__ == "__main__":  # verifiers starts the toolset's MCP server this way
  Calc.run()
