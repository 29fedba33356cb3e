"""Tools of the agent loop.

* :mod:`.base`: the contract, :class:`Tool` (an OpenAI function schema and ``call``), :class:`ToolResult` and
  :class:`ToolUnusable` (a tool whose environment broke: it stops the run);
* :mod:`.decorator`: ``@tool``, a tool from a plain Python function;
* :mod:`.schema`: checking a tool schema and the arguments a model wrote;
* :mod:`.config`: the YAML tool config (verl's ``tool_config``) and the built-ins by short name;
* :mod:`.execute`: running one turn's calls (limits, timeouts, errors as messages), the row's kwargs per tool,
  truncating a long output;
* :mod:`.builtin_calculator`, :mod:`.builtin_python` (the code sandbox), :mod:`.builtin_search` (BM25).
"""

from portrl.agent.tools.base import Tool, ToolResult, ToolUnusable
from portrl.agent.tools.config import BUILTINS, ToolConfigError, load_tool_config, tool_schemas
from portrl.agent.tools.decorator import FunctionTool, tool
from portrl.agent.tools.execute import merge_tools_kwargs, run_calls, run_calls_many, truncate_text
from portrl.agent.tools.schema import ToolSchemaError, argument_problem, check_schema

__all__ = ["BUILTINS", "FunctionTool", "Tool", "ToolConfigError", "ToolResult", "ToolSchemaError", "ToolUnusable",
           "argument_problem", "check_schema", "load_tool_config", "merge_tools_kwargs", "run_calls",
           "run_calls_many", "tool", "tool_schemas", "truncate_text"]
