"""Finding the samples of a dataset folder and validating every file before anything is
encoded. All problems are collected and reported together, each naming the file and the fix.

Two layouts (see the README):

one folder                          parallel folders
  cat.png         target              images/cat.png      target
  cat.txt         caption             images/cat.txt      caption
  cat_control.png reference 1         control/cat.png     reference 1
  cat_control_1.png reference 2       control_1/cat.png   reference 2

No references at all is plain FLUX.1-dev training. Images: png, jpg / jpeg, webp.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .image_files import IMAGE_EXTENSIONS, FileProblem, read_image, upright_size
from .sizing import MAX_SIDE

CONTROL_NAME = re.compile(r"^(?P<stem>.+)_control(?:_(?P<slot>\d+))?$")
CONTROL_FOLDER = re.compile(r"^control(?:_(?P<slot>\d+))?$")
TARGET_FOLDER = "images"


class DatasetProblems(ValueError):
    """Everything wrong with a dataset folder, one line per problem."""

    def __init__(self, root: Path, problems: list[str]):
        self.root, self.problems = root, problems
        listed = "\n".join(f"  - {p}" for p in problems)
        super().__init__(
            f"The dataset in {root} has {len(problems)} problem(s); nothing was encoded:\n{listed}"
        )


@dataclass
class SampleFiles:
    name: str  # the shared file stem
    target: Path
    references: list[Path]  # in reference order (control, control_1, ...)
    caption: Path | None  # None: no caption file (trained with the empty caption)


@dataclass
class DatasetScan:
    root: Path
    layout: str  # "one_folder" or "parallel_folders"
    samples: list[SampleFiles]
    notices: list[str] = field(default_factory=list)  # conversions and warnings, not errors


def _slot(match) -> int:
    """`_control` / `control` is slot 0; `_control_N` / `control_N` is slot N."""
    return int(match.group("slot")) if match.group("slot") is not None else 0


def _images_by_stem(folder: Path, problems: list[str]) -> dict[str, Path]:
    found: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS:
            found[path.stem].append(path)
    for stem, paths in found.items():
        if len(paths) > 1:
            names = ", ".join(p.name for p in paths)
            problems.append(f"{folder}: {names} are two images for '{stem}'; keep one of them")
    return {stem: paths[0] for stem, paths in found.items()}


def _check_slots(name: str, slots: dict[int, Path], where: str, problems: list[str]) -> list[Path]:
    """References must be numbered control, control_1, control_2, ... without gaps."""
    expected = list(range(len(slots)))
    if sorted(slots) != expected:
        have = ", ".join(_slot_name(s) for s in sorted(slots))
        missing = ", ".join(_slot_name(s) for s in range(max(slots) + 1) if s not in slots)
        problems.append(
            f"{where}: '{name}' has {have} but no {missing}; add the missing reference or renumber"
        )
    return [slots[s] for s in sorted(slots)]


def _slot_name(slot: int) -> str:
    return "control" if slot == 0 else f"control_{slot}"


def _scan_one_folder(root: Path, problems: list[str]) -> list[SampleFiles]:
    targets, references = {}, defaultdict(dict)
    for stem, path in _images_by_stem(root, problems).items():
        match = CONTROL_NAME.match(stem)
        if match:
            references[match.group("stem")][_slot(match)] = path
        else:
            targets[stem] = path
    for stem, slots in references.items():
        if stem not in targets:
            for path in slots.values():
                problems.append(
                    f"{path}: a reference without a target image '{stem}.png/.jpg/.webp'; "
                    "add the target or remove the reference"
                )
    samples = []
    for stem, target in targets.items():
        refs = _check_slots(stem, references.get(stem, {}), str(root), problems) if stem in references else []
        caption = root / f"{stem}.txt"
        samples.append(SampleFiles(stem, target, refs, caption if caption.is_file() else None))
    return samples


def _scan_parallel(root: Path, problems: list[str]) -> list[SampleFiles]:
    target_dir = root / TARGET_FOLDER
    targets = _images_by_stem(target_dir, problems)
    control_dirs = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        match = CONTROL_FOLDER.match(folder.name)
        if match:
            control_dirs[_slot(match)] = folder
    if control_dirs and sorted(control_dirs) != list(range(len(control_dirs))):
        have = ", ".join(f"{_slot_name(s)}/" for s in sorted(control_dirs))
        problems.append(
            f"{root}: reference folders {have} skip a number; rename them control/, control_1/, ..."
        )
    per_folder = {slot: _images_by_stem(folder, problems) for slot, folder in control_dirs.items()}
    for images in per_folder.values():
        for stem, path in images.items():
            if stem not in targets:
                problems.append(
                    f"{path}: a reference without a target {TARGET_FOLDER}/{stem}.png/.jpg/.webp; "
                    "add the target or remove the reference"
                )
    samples = []
    for stem, target in targets.items():
        refs = []
        for slot in sorted(per_folder):
            if stem in per_folder[slot]:
                refs.append(per_folder[slot][stem])
            else:
                problems.append(
                    f"{target}: no reference {control_dirs[slot].name}/{stem}.png/.jpg/.webp; "
                    "add it or remove the target"
                )
        caption = target_dir / f"{stem}.txt"
        samples.append(SampleFiles(stem, target, refs, caption if caption.is_file() else None))
    return samples


def _check_reference_counts(samples: list[SampleFiles], problems: list[str]) -> None:
    by_count = defaultdict(list)
    for sample in samples:
        by_count[len(sample.references)].append(sample.name)
    if len(by_count) > 1:
        groups = "; ".join(
            f"{len(names)} with {count} ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
            for count, names in sorted(by_count.items())
        )
        problems.append(
            f"samples have different numbers of references: {groups}; every sample needs the same number"
        )


def read_caption(path: Path | None) -> str:
    if path is None:
        return ""
    try:
        return path.read_text(encoding="utf-8-sig").strip()
    except UnicodeDecodeError:
        raise FileProblem(f"{path}: the caption is not UTF-8 text; save it as UTF-8") from None


def scan_dataset(root: Path, min_size: int = 0, decode: bool = True) -> DatasetScan:
    """Find the samples under `root` and validate every file; raise DatasetProblems listing
    all problems at once. With `decode`, each image is fully decoded (catches truncated
    files); otherwise only headers are read."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetProblems(root, [f"{root} is not a folder; choose a folder of images"])
    problems: list[str] = []
    parallel = (root / TARGET_FOLDER).is_dir()
    samples = _scan_parallel(root, problems) if parallel else _scan_one_folder(root, problems)
    if not samples and not problems:
        where = root / TARGET_FOLDER if parallel else root
        problems.append(f"{where}: no target images (.png, .jpg, .webp) found")
    _check_reference_counts(samples, problems)
    notices = []
    for sample in samples:
        for path in [sample.target, *sample.references]:
            try:
                width, height = upright_size(path) if path.stat().st_size else (0, 0)
                if decode or width == 0:
                    loaded = read_image(path)
                    width, height = loaded.size
                    notices += loaded.notices
                if max(width, height) > MAX_SIDE:
                    problems.append(
                        f"{path}: {width}x{height} is over the {MAX_SIDE} px cap on a side; downscale it"
                    )
                if min(width, height) < min_size:
                    problems.append(
                        f"{path}: {width}x{height} is below the minimum side of {min_size} px; "
                        "use a larger image or lower min_size"
                    )
            except FileProblem as problem:
                problems.append(str(problem))
        if sample.caption is None:
            notices.append(
                f"{sample.target.name}: no caption file ({sample.name}.txt); trained with an empty caption"
            )
        else:
            try:
                if not read_caption(sample.caption):
                    notices.append(
                        f"{sample.caption.name}: the caption is empty; trained with an empty caption"
                    )
            except FileProblem as problem:
                problems.append(str(problem))
    if problems:
        raise DatasetProblems(root, problems)
    return DatasetScan(root, "parallel_folders" if parallel else "one_folder", samples, notices)
