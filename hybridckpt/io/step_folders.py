"""Numbered step folders: which steps a run's output folder holds, and which one is read.

A training run saves one folder per step under one output folder, named by a pattern
(`StepPattern`): torchtitan `step-N/`, the HF and PaddleFormers Trainers `checkpoint-N/`,
Megatron `iter_NNNNNNN/`, DeepSpeed `global_stepN/` (its universal form `global_stepN_universal/`),
MaxText and ours (Orbax) `N/`. `listing(root, pattern, holds)` lists them and
`StepFolders.pick(step)` chooses one: the step asked for (`--step`), else the default (the
latest, or the step a tracker names: Megatron's `latest_checkpointed_iteration.txt`, DeepSpeed's
`latest`); a step not there is one FormatError listing the steps that are.

Folder names are data: a step number is 1 to `MAX_DIGITS` ASCII digits (no sign, no space, no
other script's digits), and a step folder is `root/<the name as listed>`, a direct child of
`root`, never a path read from a file. Listing looks at names only: `holds(folder)` (the format's
test that a folder holds its files) lists that folder's names and opens no file, so a damaged or
unfinished step matters only when it is the one read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hybridckpt.errors import FormatError

MAX_DIGITS = 18  # a step number below 10**18 (an int64); longer digit runs are not steps
MAX_LISTED = 12  # steps an error message names (the first and last few of a long run)


@dataclass(frozen=True)
class StepPattern:
    """Folder names `<prefix><digits><suffix>`, e.g. ("step-", "") or ("global_step", "_universal")."""

    prefix: str
    suffix: str = ""

    def number(self, name: str) -> int | None:
        """The step a folder name gives, or None when it is not `<prefix><digits><suffix>`."""
        if not (name.startswith(self.prefix) and name.endswith(self.suffix)):
            return None
        digits = name[len(self.prefix) : len(name) - len(self.suffix)]
        if not (0 < len(digits) <= MAX_DIGITS and digits.isascii() and digits.isdigit()):
            return None
        return int(digits)

    @property
    def shape(self) -> str:
        """The pattern as a user reads it: `step-N/`, `N/`."""
        return f"{self.prefix}N{self.suffix}/"


@dataclass(frozen=True)
class StepFolders:
    """The step folders of one output folder.

    root:         the output folder
    pattern:      how its step folders are named
    folders:      step -> its folder (`root/<name>`), for every folder that holds the format's files
    unfinished:   names that look like step folders but hold none of the format's files
    duplicates:   step -> the names of two or more folders of that step (`iter_5`, `iter_0000005`)
    default:      the step read when none is asked, or None when that is no numbered folder
    default_from: where the default comes from ("the latest", "latest_checkpointed_iteration.txt")
    """

    root: str
    pattern: StepPattern
    folders: Mapping[int, str]
    unfinished: tuple[str, ...] = ()
    duplicates: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    default: int | None = None
    default_from: str = "the latest"

    @property
    def steps(self) -> list[int]:
        """Every step held, ascending."""
        return sorted(self.folders)

    def described(self) -> str:
        """`steps 3, 5 (default 5: the latest)`, at most `MAX_LISTED` numbers."""
        steps = self.steps
        shown = ", ".join(map(str, steps)) if len(steps) <= MAX_LISTED else (
            f"{', '.join(map(str, steps[:6]))}, ... ({len(steps) - 9} more), {', '.join(map(str, steps[-3:]))}"
        )
        default = "" if self.default is None else f" (default {self.default}: {self.default_from})"
        return f"steps {shown or 'none'}{default}"

    def folder(self, step: int) -> str:
        """The folder of `step`; one FormatError naming the steps present when it is not there."""
        if step in self.duplicates:
            raise FormatError(
                f"{self.root}: step {step} is in several folders {list(self.duplicates[step])}: pass the one to read"
            )
        if step in self.folders:
            return self.folders[step]
        half = [n for n in self.unfinished if self.pattern.number(n) == step]
        why = f" ({half[0]} holds no checkpoint files: an unfinished save?)" if half else ""
        raise FormatError(f"{self.root}: no step {step}{why}; it holds {self.pattern.shape} {self.described()}")

    def note(self, step: int) -> str:
        """What a reader says of the step it read."""
        name = os.path.basename(self.folders[step]) + ("/" if os.path.isdir(self.folders[step]) else "")
        asked = "" if step == self.default else " (asked for)"
        return f"read step {step}{asked}, {name}, of {self.described()}"


def listing(
    root: str,
    pattern: StepPattern,
    holds: Callable[[str], bool] = os.path.isdir,
    *,
    default: int | None = None,
    default_from: str | None = None,
) -> StepFolders:
    """The folders directly under `root` named by `pattern` that `holds` accepts (names only).

    default: the step a tracker names (else the latest held), with `default_from` saying where
    it comes from."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    folders: dict[int, str] = {}
    named: dict[int, list[str]] = {}
    unfinished = []
    for name in names:
        step = pattern.number(name)
        if step is None:
            continue
        full = os.path.join(root, name)
        if not (os.path.isdir(full) and holds(full)):
            unfinished.append(name)
            continue
        folders[step] = full
        named.setdefault(step, []).append(name)
    duplicates = {s: tuple(n) for s, n in named.items() if len(n) > 1}
    if default is None and default_from is None and folders:
        default, default_from = max(folders), "the latest"
    return StepFolders(root, pattern, folders, tuple(unfinished), duplicates, default, default_from or "the latest")
