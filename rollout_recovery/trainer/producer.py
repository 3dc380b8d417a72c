"""The producer of asynchronous GRPO: which groups to start, which finished ones to train on,
and the cursor a restore goes on from (docs/async_grpo.md).

Prompts are numbered in dispatch order: prompt `c` is prompt `c % P` of producer step
`c // P` (P = `grpo.prompts_per_step`; `environment.tasks` gives each producer step's P tasks,
as it gives a synchronous step's), generated as group `group_id(c // P, c % P)`. A group that
went stale before it was trained is consumed untrained and its prompt generated again as
`<group id>-r<k>`. The cursor splits the prompts into four: trained, open (started and not
trained: generating, or finished and waiting in the buffer), dropped attempts (counted), and
not yet dispatched (from `next`). It is saved with each trainer checkpoint (`Cursor`, in the
checkpoint's `extra`), so a restore neither skips a prompt nor trains one twice: the open
prompts are started again first (their restored episodes resume, finished ones answer from
the buffer), then dispatch goes on from `next`.

    fill()    start groups until `max_groups_in_flight` are open
    take(n)   the first n finished groups young enough to train on (stale ones dropped and
              started again); the caller trains on them, then calls trained()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pydantic import BaseModel, ConfigDict, Field

from rollout_recovery.controller.stream import StartedGroup
from rollout_recovery.protocol import GroupResult, group_id, parse_group_id
from rollout_recovery.trainer.tasks import make_tasks

CURSOR_KEY = "async_cursor"  # the cursor's key in a trainer checkpoint's `extra`


class OpenPrompt(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: int  # dispatch order
    attempt: int = 0  # 0, then 1, 2, ... for each time it went stale


class Cursor(BaseModel):
    """Where dispatch stands, as a trainer checkpoint keeps it."""

    model_config = ConfigDict(extra="forbid")

    next: int = 0  # the first prompt never dispatched
    open: list[OpenPrompt] = Field(default_factory=list)  # started, not trained; in start order
    trained: int = 0  # prompts trained on
    dropped_stale: int = 0  # group attempts dropped for age


class Producer:
    """Dispatch for one training loop on a `TrainingRun` (`run`); `seeds(prompt, attempt,
    generation)` gives each rollout its sampler seed."""

    def __init__(
        self, run, seeds: Callable[[int, int, int], int], cursor: Cursor | None = None,
        restored: Iterable[str] = (),
    ) -> None:  # fmt: skip
        """`cursor`: the one the restored trainer checkpoint kept; `restored`: the group ids the
        restored snapshot holds (TrainingRun.restored_groups), whose attempts win over the
        cursor's when newer (the prompt went stale after that checkpoint)."""
        self.run, self.seeds = run, seeds
        g = run.cfg.grpo
        self.per_step, self.size = g.prompts_per_step, g.generations_per_prompt
        self.limit, self.max_age = g.groups_in_flight(), g.async_grpo.max_trajectory_age_steps
        self.cursor = cursor or Cursor()
        self._tasks: dict[int, list[dict]] = {}
        self._started: set[OpenPrompt] = set()  # started by this process (a restore: none yet)
        self._by_group: dict[str, OpenPrompt] = {}
        self._restored: dict[int, int] = {}  # prompt -> its newest attempt restored
        for gid in restored:
            parsed = parse_group_id(gid)
            if parsed is not None:
                prompt, attempt = parsed[0] * self.per_step + parsed[1], parsed[2]
                self._restored[prompt] = max(attempt, self._restored.get(prompt, 0))

    def group_of(self, p: OpenPrompt) -> str:
        return group_id(p.prompt // self.per_step, p.prompt % self.per_step, p.attempt)

    def _task(self, prompt: int) -> dict:
        step, i = divmod(prompt, self.per_step)
        if step not in self._tasks:
            self._tasks = {step: make_tasks(self.run.cfg, step)}  # dispatch moves forward
        return self._tasks[step][i]

    def _start(self, prompts: list[OpenPrompt]) -> None:
        groups = []
        for p in map(self._newest, prompts):
            gid = self.group_of(p)
            seeds = [self.seeds(p.prompt, p.attempt, gen) for gen in range(self.size)]
            groups.append(StartedGroup(gid, self._task(p.prompt), seeds))
            self._by_group[gid] = p
            self._started.add(p)
        if groups:
            self.run.start_groups(groups)

    def _newest(self, p: OpenPrompt) -> OpenPrompt:
        """`p`, or the newer attempt of its prompt a restore brought back (the attempts between
        were dropped stale before the crash)."""
        newest = self._restored.pop(p.prompt, p.attempt)
        if newest <= p.attempt:
            return p
        again = OpenPrompt(prompt=p.prompt, attempt=newest)
        self.cursor.open[self.cursor.open.index(p)] = again
        self.cursor.dropped_stale += newest - p.attempt
        return again

    def fill(self) -> int:
        """Start the open prompts this process has not started (after a restore), then new
        ones until `max_groups_in_flight` are open; returns how many were started."""
        todo = [p for p in self.cursor.open if p not in self._started]
        while len(self.cursor.open) < self.limit:
            p = OpenPrompt(prompt=self.cursor.next)
            self.cursor.next += 1
            self.cursor.open.append(p)
            todo.append(p)
        self._start(todo)
        return len(todo)

    def age(self, result: GroupResult) -> int:
        """Trainer steps between the oldest weights among the group's tokens and the weights
        it would be trained on now."""
        return self.run.weight_version - min(r.weight_version_min for r in result.rows)

    def take(self, n: int) -> list[GroupResult]:
        """The first `n` finished groups no older than `max_trajectory_age_steps`; each stale
        one is consumed untrained (counted) and its prompt started again."""
        fresh: list[GroupResult] = []
        while len(fresh) < n:
            for result in self.run.finished_groups(n - len(fresh)):
                if self.age(result) <= self.max_age:
                    fresh.append(result)
                    continue
                self.run.drop_groups([result], "stale")
                self.cursor.dropped_stale += 1
                old = self._by_group.pop(result.group_id)
                again = OpenPrompt(prompt=old.prompt, attempt=old.attempt + 1)
                self.cursor.open[self.cursor.open.index(old)] = again
                self._start([again])
        return fresh

    def trained(self, results: list[GroupResult]) -> None:
        """These groups were trained on (after the optimizer step): their prompts are done."""
        for result in results:
            p = self._by_group.pop(result.group_id)
            self.cursor.open.remove(p)
            self._started.discard(p)
            self.cursor.trained += 1
