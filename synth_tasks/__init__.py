"""synth_tasks: the 74-task synthetic benchmark of the DCFormer paper.

    from synth_tasks import load_dataset, evaluate, generate, TASKS
    ds = load_dataset("../shared/data/synthetic_dataset.jsonl")
    res = evaluate(model, ds)            # model.forward(int32 [B, T]) -> [B, T, V]
    res.summary["overall"]               # {"acc": ..., "ppl": ..., "n": 5328, ...}
    res.per_task["task56"].acc           # per task, typed (TaskResult: acc, n, ppl, ...)
    lines = generate(lines_per_task=100, seed=1)   # new data, same format

Command line: ``dclens synth --model DIR [--data FILE] [--out DIR] [--limit N]``
(:func:`synth_tasks.cli.main`).
"""

from .dataset import Answer, Dataset, DatasetError, Example, Line, load_dataset, parse_texts
from .evaluate import AnswerResult, EvalResult, TaskResult, aggregate, evaluate
from .generate import analyse, generate, write_jsonl
from .tasks import PATTERNS, TASKS, TRANSFORMS, Task
from .tokenize import tokenize_line, tokenize_lines

__all__ = [
    "Answer",
    "AnswerResult",
    "Dataset",
    "DatasetError",
    "EvalResult",
    "Example",
    "Line",
    "PATTERNS",
    "TASKS",
    "TRANSFORMS",
    "Task",
    "TaskResult",
    "aggregate",
    "analyse",
    "evaluate",
    "generate",
    "load_dataset",
    "parse_texts",
    "tokenize_line",
    "tokenize_lines",
    "write_jsonl",
]
