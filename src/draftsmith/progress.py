"""Progress bars that also work in log files.

Long jobs run non-interactively (nohup, CI, a scheduler), where rich draws nothing until the end. Off a terminal,
the bar instead prints one plain line per task at most every `every` seconds, and one when the task finishes.
"""

import time

from rich.console import Console
from rich.progress import Progress, TaskID


class LoggedProgress(Progress):
    def __init__(self, *columns, every: float = 30.0, **kwargs) -> None:
        super().__init__(*columns, **kwargs)
        self.every = every
        self._printed: dict[TaskID, float] = {}
        self._start = time.monotonic()

    def update(self, task_id: TaskID, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._log(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._log(task_id)

    def _log(self, task_id: TaskID) -> None:
        if self.console.is_terminal or self.disable:
            return
        task = self._tasks[task_id]
        now = time.monotonic()
        if task.finished or now - self._printed.get(task_id, self._start) >= self.every:
            self._printed[task_id] = now
            total = f"/{task.total:.0f}" if task.total is not None else ""
            self.console.print(
                f"{task.description}: {task.completed:.0f}{total} ({now - self._start:.0f}s)", highlight=False
            )


def progress_bar(*columns, console: Console | None = None, **kwargs) -> Progress:
    return LoggedProgress(*columns, console=console or Console(stderr=True), **kwargs)
