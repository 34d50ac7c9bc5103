"""The conformance scenarios (``conformance/scenarios/*.yaml``): their schema, loaded and checked.

A scenario is data: the workers it starts (each a driver process of the client
under test), then steps run in order. ``conformance/PROTOCOL.md`` says what each
command and event means; this module says what a scenario file may hold, and
refuses anything else with the file and the field named (pydantic, ``extra``
forbidden). Every step is a mapping with exactly one of these keys:

``send``    a command to a worker, with ``expect``: the events that answer it (its ``id``);
``expect``  an event a worker sends on its own (a loss, an abort), at most ``within_s`` late;
``do``      something the runner does: ``pause``/``resume``/``kill`` a worker (SIGSTOP,
            SIGCONT, SIGKILL), ``revoke``/``cancel`` a task (an operator's RPC), ``proxy``
            (a network fault between the workers and the server);
``check``   what the server holds now (a task's lease, its history, its effects, the
            heartbeat streams open) or the outside system (the lines of an effect's file);
``wait``    until a check holds (polled);
``never``   an event no worker may have sent by the end (checked after every worker exited).

An event pattern names the ``event`` and the fields to compare; a value is
compared exactly (a mapping field by field), or is ``{one_of: [...]}`` (any of
them), or ``{owner_of: worker}`` (that worker's owner id, from its ``ready``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

ROOT = Path(__file__).resolve().parents[2]
SCENARIO_DIR = ROOT / "conformance" / "scenarios"
STEP_S = 15.0
"""The longest a step may take on a loaded machine, unless it says ``within_s``."""

_NAME = r"^[a-z][a-z0-9-]*$"


class Strict(BaseModel):
    """A part of a scenario: unknown keys are refused, values are not changed after loading."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# --- commands (sent to a driver; PROTOCOL.md "Commands") -------------------------------------


class Hold(Strict):
    """``hold``: claim the task the way the client's workers do, and keep it renewed."""

    worker: str
    cmd: Literal["hold"]
    task_id: str = Field(pattern=_NAME)
    ttl_s: float = Field(gt=0)
    wait_s: float | None = Field(default=None, gt=0)
    heartbeat_interval_s: float | None = Field(default=None, gt=0)


class Work(Strict):
    """``work``: announce ``progress`` every ``interval_s`` while the lease is held."""

    worker: str
    cmd: Literal["work"]
    interval_s: float = Field(gt=0)


class Act(Strict):
    """``act``: an effect through the effect ledger, done to the outside system."""

    worker: str
    cmd: Literal["act"]
    effect_key: str = Field(pattern=_NAME)
    policy: Literal["ONCE", "LATEST"]
    result: str = Field(min_length=1)
    reconcile: bool = False
    stall: Literal["before_outside", "after_outside"] | None = None


class SaveCheckpoint(Strict):
    """``save_checkpoint``: save the task's progress under the lease."""

    worker: str
    cmd: Literal["save_checkpoint"]
    version: int = Field(ge=1)
    data: str


class Release(Strict):
    """``release``: end the hold; the lease is released."""

    worker: str
    cmd: Literal["release"]


Command = Annotated[Hold | Work | Act | SaveCheckpoint | Release, Field(discriminator="cmd")]
COMMANDS: tuple[str, ...] = ("hold", "work", "act", "save_checkpoint", "release")
EVENTS: tuple[str, ...] = (
    "ready",
    "granted",
    "refused",
    "lost",
    "released",
    "progress",
    "aborted",
    "checkpoint_saved",
    "outside",
    "effect",
    "error",
    "bye",
)


# --- event patterns ---------------------------------------------------------------------------


def _check_pattern(value: dict[str, Any]) -> dict[str, Any]:
    event = value.get("event")
    if event not in EVENTS:
        raise ValueError(f"event: must be one of {', '.join(EVENTS)}, not {event!r}")
    return value


Pattern = Annotated[dict[str, Any], Field(min_length=1)]


class WorkerPattern(Strict):
    """An event of one worker: ``worker``, ``event`` and the fields to compare."""

    model_config = ConfigDict(extra="allow", frozen=True)
    worker: str
    event: str

    @model_validator(mode="after")
    def _known_event(self) -> WorkerPattern:
        _check_pattern({"event": self.event})
        return self

    @property
    def fields(self) -> dict[str, Any]:
        """The fields compared, besides the event's name."""
        return dict(self.model_extra or {})


# --- steps ------------------------------------------------------------------------------------


class SendStep(Strict):
    """Send a command; wait for the events that answer it (those carrying its ``id``)."""

    send: Command
    expect: list[Pattern] = []
    within_s: float = Field(default=STEP_S, gt=0)

    @field_validator("expect", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, dict) else value

    @field_validator("expect")
    @classmethod
    def _known_events(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [_check_pattern(pattern) for pattern in value]


class ExpectStep(Strict):
    """Wait for an event of a worker, at most ``within_s`` after the previous step ended."""

    expect: WorkerPattern
    within_s: float = Field(default=STEP_S, gt=0)


class SignalStep(Strict):
    """``pause`` (SIGSTOP), ``resume`` (SIGCONT) or ``kill`` (SIGKILL) a worker's process."""

    do: Literal["pause", "resume", "kill"]
    worker: str


class OperatorStep(Strict):
    """``revoke`` the task's lease or ``cancel`` the task, with an admin token."""

    do: Literal["revoke", "cancel"]
    task_id: str = Field(pattern=_NAME)
    reason: str = Field(min_length=1)


class ProxyStep(Strict):
    """A fault of the proxy between the workers and the server (``tests/fault/proxy.py``)."""

    do: Literal["proxy"]
    fault: Literal["black_hole", "delay", "restore"]
    direction: Literal["both", "upstream", "downstream"] = "both"
    seconds: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _seconds_for_delay(self) -> ProxyStep:
        if (self.fault == "delay") != (self.seconds is not None):
            raise ValueError("seconds: required for fault delay, and only for it")
        return self


DoStep = Annotated[SignalStep | OperatorStep | ProxyStep, Field(discriminator="do")]


class LeaseCheck(Strict):
    """The task's lease (GetLease) has these fields (``state``, ``fence``, ``owner_id``...)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    lease: str


class RecordsCheck(Strict):
    """The task's ``history`` or ``effects``: ``count`` of those matching ``where``, or ``equals``.

    ``equals`` lists every record, in order (effects by key, history oldest first), each
    compared on the fields it names.
    """

    history: str | None = None
    effects: str | None = None
    where: dict[str, Any] = {}
    count: int | None = Field(default=None, ge=0)
    equals: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_listing(self) -> RecordsCheck:
        if (self.history is None) == (self.effects is None):
            raise ValueError("check: name exactly one of history, effects")
        if (self.count is None) == (self.equals is None):
            raise ValueError("check: give exactly one of count, equals")
        return self


class StreamsCheck(Strict):
    """The server has this many heartbeat streams open (its metric; one server per scenario)."""

    streams_open: int = Field(ge=0)


class OutsideCheck(Strict):
    """The outside system's file of one effect key holds exactly these lines (one per doing)."""

    outside: str = Field(pattern=_NAME)
    lines: list[str]


def _key_of(keys: tuple[str, ...]) -> Any:
    """A discriminator: the one key of ``keys`` that a mapping (or a model) has, else None.

    ``send`` comes with an ``expect`` of its own: where ``send`` is, ``expect`` is its part.
    """

    def key_of(value: Any) -> str | None:
        if isinstance(value, BaseModel):
            value = dict(value)
        if not isinstance(value, dict):
            return None
        named = [key for key in keys if value.get(key) is not None]
        if "send" in named and "expect" in named:
            named.remove("expect")
        return named[0] if len(named) == 1 else None

    return key_of


CHECK_KEYS = ("lease", "history", "effects", "outside", "streams_open")
Check = Annotated[
    Annotated[LeaseCheck, Tag("lease")]
    | Annotated[RecordsCheck, Tag("history")]
    | Annotated[RecordsCheck, Tag("effects")]
    | Annotated[OutsideCheck, Tag("outside")]
    | Annotated[StreamsCheck, Tag("streams_open")],
    Discriminator(
        _key_of(CHECK_KEYS),
        custom_error_type="check_kind",
        custom_error_message=f"a check names exactly one of {', '.join(CHECK_KEYS)}",
    ),
]


class CheckStep(Strict):
    """Check what the server (or the outside system) holds now."""

    check: Check


class WaitStep(Strict):
    """Poll a check until it holds (every 20 ms, at most ``within_s``)."""

    wait: Check
    within_s: float = Field(default=STEP_S, gt=0)


class NeverStep(Strict):
    """No event of the worker matches, up to its exit (checked at the end)."""

    never: WorkerPattern


STEP_KEYS = ("send", "expect", "do", "wait", "check", "never")
Step = Annotated[
    Annotated[SendStep, Tag("send")]
    | Annotated[ExpectStep, Tag("expect")]
    | Annotated[DoStep, Tag("do")]
    | Annotated[WaitStep, Tag("wait")]
    | Annotated[CheckStep, Tag("check")]
    | Annotated[NeverStep, Tag("never")],
    Discriminator(
        _key_of(STEP_KEYS),
        custom_error_type="step_kind",
        custom_error_message=f"a step has exactly one of {', '.join(STEP_KEYS)}",
    ),
]


class Scenario(Strict):
    """One scenario file: its title and summary (the docs' table), its workers, its steps."""

    name: str = Field(pattern=_NAME)
    title: str = Field(min_length=1)
    summary: str = Field(min_length=1)
    workers: list[str] = Field(min_length=1)
    steps: list[Step] = Field(min_length=1)

    @model_validator(mode="after")
    def _known_workers(self) -> Scenario:
        if len(set(self.workers)) != len(self.workers):
            raise ValueError("workers: each name once")
        for index, step in enumerate(self.steps):
            named = step_worker(step)
            if named is not None and named not in self.workers:
                raise ValueError(f"steps[{index}]: worker {named!r} is not in workers")
        return self


def step_worker(step: Step) -> str | None:
    """The worker a step names, if any."""
    if isinstance(step, SendStep):
        return step.send.worker
    if isinstance(step, ExpectStep):
        return step.expect.worker
    if isinstance(step, NeverStep):
        return step.never.worker
    if isinstance(step, SignalStep):
        return step.worker
    return None


class ScenarioError(ValueError):
    """A scenario file that is not a valid scenario; the message names the file and the field."""


def load(path: Path) -> Scenario:
    """The scenario in ``path`` (its name is the file's stem).

    Raises:
        ScenarioError: not YAML, or not a valid scenario (the file and field named).
    """
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ScenarioError(f"{path.name}: not YAML: {error}") from error
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path.name}: must be a mapping")
    try:
        return Scenario.model_validate({"name": path.stem, **raw})
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in issue['loc']) or '(top)'}: {issue['msg']}"
            for issue in error.errors()
        )
        raise ScenarioError(f"{path.name}: {problems}") from error


def load_all(folder: Path = SCENARIO_DIR) -> list[Scenario]:
    """Every scenario of ``folder``, by file name."""
    return [load(path) for path in sorted(folder.glob("*.yaml"))]


def markdown_table(scenarios: list[Scenario]) -> str:
    """The docs' table of scenarios (docs/reference/conformance.md holds it, tested to match)."""
    rows = ["| Scenario | What a client must do |", "|---|---|"]
    for scenario in scenarios:
        summary = re.sub(r"\s+", " ", scenario.summary).strip()
        rows.append(f"| **{scenario.title}** (`{scenario.name}`) | {summary} |")
    return "\n".join(rows) + "\n"
