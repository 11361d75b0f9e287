"""Task evaluation: offline datasets, prompts, graders, a sandboxed executor and a runner.

``load_task(name)`` returns the records of ``math500``, ``aime24``, ``aime25``, ``gsm8k``,
``humaneval`` or ``line_retrieval``; ``grade(task, record, response)`` returns a
:class:`Grade` with ``.correct`` and ``.reason``. ``kvarn eval`` drives :func:`run_eval`.
"""

from .grading import Grade, grade
from .report import pass_at_k, summarize, write_summary
from .runner import RunSpec, SamplingConfig, expand_runs, regrade, run_eval
from .tasks import TASKS, load_task

__all__ = ["TASKS", "load_task", "grade", "Grade", "SamplingConfig", "RunSpec", "run_eval",
           "expand_runs", "regrade", "pass_at_k", "summarize", "write_summary"]
